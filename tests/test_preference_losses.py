"""The reference-free preference losses (`train.preference_loss`): SimPO and ORPO against TRL's CPOTrainer and
ORPOTrainer on the same weights and batch, gradient accumulation and data parallelism giving the loss of the
whole batch, short runs that learn the preference without building a reference and resume exactly, and the
config's refusals."""

import shutil

import pytest
import torch

from helpers import DPO_OVERRIDES, dpo_config, pair_loader, recording_metrics, tiny_config, write_preference_data
from liandan.config import ConfigError, load_config
from liandan.data.tokens.loader import Batch

LOSSES = {"simpo": ["--train.preference_loss=simpo", "--train.dpo_beta=2", "--train.simpo_gamma=0.5"],
          "orpo": ["--train.preference_loss=orpo", "--train.dpo_beta=0.5"]}  # fmt: skip


def _module(tmp_path, *overrides, tokenizer=None):
    from liandan.train.components import build_environment, build_train_module

    cfg = tiny_config(tmp_path, tmp_path / "unused.jsonl", *DPO_OVERRIDES, *overrides)
    return build_train_module(cfg, build_environment(cfg, say=lambda m: None), tokenizer)


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_accumulation_and_data_parallel_ranks_give_the_loss_and_gradients_of_the_whole_batch(tmp_path, loss):
    """4 pairs at once, one pair per micro-batch, and 2 data-parallel ranks' shares (their gradients averaged,
    as data parallelism does) give the same loss, gradients and metrics; no reference model is built."""
    from liandan.data.tokens.pairs import PairLoader

    _, store, loader = pair_loader(tmp_path)
    module = _module(tmp_path, *LOSSES[loss], tokenizer=store.tokenizer)
    assert module.reference is None
    params = list(module.model.parameters())
    ranks = [PairLoader(store, 64, 4, seed=1, dp_rank=rank, dp_size=2) for rank in (0, 1)]
    shares = {"whole": [loader.batch_at(0, 4)], "micro": [loader.batch_at(0, 1)],
              "ranks": [rank.batch_at(0, 2) for rank in ranks]}  # fmt: skip
    found = {}
    for name, per_rank in shares.items():
        for p in params:
            p.grad = None
        losses, metrics = [], []
        for batches in per_rank:
            losses.append(module.train_batch(batches, lambda *args, **kwargs: None, 1))
            metrics.append(module.preference_metrics)
        grads = [p.grad / len(per_rank) for p in params]
        mean_metrics = {k: sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]}
        found[name] = sum(losses) / len(losses), grads, mean_metrics
    assert "kl/token" not in found["whole"][2] and found["whole"][2]["rewards/margins"] != 0
    # the guard's replay of a step and a validation batch of its own weigh the same
    torch.testing.assert_close(module.replay_loss(loader.batch_at(0, 1), 1), found["whole"][0], rtol=0, atol=1e-6)
    torch.testing.assert_close(module.eval_batch(loader.batch_at(0, 4)), found["whole"][0], rtol=0, atol=1e-6)
    for name in ("micro", "ranks"):
        torch.testing.assert_close(found[name][0], found["whole"][0], rtol=0, atol=1e-6)
        for ours, theirs in zip(found[name][1], found["whole"][1]):
            torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        assert found[name][2] == pytest.approx(found["whole"][2], abs=1e-6)


def test_a_reply_cut_off_whole_gives_its_pair_a_constant_loss(tmp_path):
    """A pair whose reply the row's cut leaves without a target (its prompt fills the row) adds a constant to
    the loss, never a NaN, under both reference-free losses."""
    _, store, loader = pair_loader(tmp_path)
    batch = loader.batch_at(0, 4)[0]
    batch.targets[1] = -1  # the first pair's rejected reply: no target left
    for loss in ("simpo", "orpo"):
        module = _module(tmp_path, *LOSSES[loss], f"--run.name={loss}", tokenizer=store.tokenizer)
        value, _ = module._pair_loss(batch, 1)
        value.backward()
        assert torch.isfinite(value)
        assert all(torch.isfinite(p.grad).all() for p in module.model.parameters())


@pytest.mark.parametrize("loss", ["simpo", "orpo"])
def test_a_reference_free_run_learns_the_preference_and_resumes_exactly(tmp_path, loss):
    from liandan.train import Trainer

    data = write_preference_data(tmp_path, n=16, malformed=False)
    common = [*LOSSES[loss], "--train.steps=12", "--optim.lr=3e-3", "--checkpoint.every=6"]
    said = []
    trainer = Trainer(dpo_config(tmp_path, data, *common), say=said.append)
    assert any(f"({loss} loss)" in line for line in said), said
    assert trainer.module.reference is None
    records = recording_metrics(trainer)
    straight = trainer.train()
    first, last = records[0], records[-1]
    assert "kl/token" not in last and (("nll_loss" in last) == (loss == "orpo"))
    assert last["loss"] < first["loss"] - 0.05
    assert last["rewards/accuracies"] > max(0.5, first["rewards/accuracies"])
    assert last["rewards/margins"] > first["rewards/margins"] + 0.1 and last["logps/chosen"] > first["logps/chosen"]
    if loss == "orpo":
        assert last["nll_loss"] < first["nll_loss"] and last["log_odds_chosen"] > first["log_odds_chosen"]
    shutil.rmtree(trainer.run_dir / "checkpoints" / "step-00000012")
    resumed = Trainer(dpo_config(tmp_path, data, *common), say=lambda m: None)
    assert resumed.step == 6
    assert resumed.train().losses[-6:] == straight.losses[-6:]


def test_the_preference_loss_is_checked_with_the_keys_it_meets(tmp_path):
    with pytest.raises(ConfigError, match="choose one of 'dpo', 'simpo', 'orpo'"):
        load_config(None, ["--train.objective=dpo", "--train.preference_loss=kto"])
    with pytest.raises(ConfigError, match='preference_loss = "simpo" is for train.objective = "dpo", not "sft"'):
        load_config(None, ["--train.objective=sft", "--train.preference_loss=simpo"])
    with pytest.raises(ConfigError, match="dpo_label_smoothing does not apply"):
        load_config(None, ["--train.objective=dpo", "--train.preference_loss=orpo", "--train.dpo_label_smoothing=0.1"])
    with pytest.raises(ConfigError, match="simpo_gamma"):
        load_config(None, ["--train.simpo_gamma=-1"])


@pytest.mark.slow  # TRL's import and two trainers: about 10 CPU seconds
def test_simpo_and_orpo_equal_trl_cpo_and_orpo_trainers(tmp_path):
    """On the same tiny Llama weights and TRL's own batch of two pairs of different lengths, liandan's SimPO
    equals CPOTrainer's loss (loss_type "simpo", cpo_alpha 0, label smoothing) and ORPO ORPOTrainer's, losses and
    gradients in fp32 to 1e-5; the loss functions equal TRL's `cpo_loss` and `odds_ratio_loss` on the same
    log-probabilities. ORPO's NLL is compared on the chosen replies: TRL's decoder-only NLL also counts the
    prompt's tokens (its encoder-decoder one does not); liandan's counts the reply's, as the ORPO paper writes
    it."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl.experimental.cpo import CPOConfig, CPOTrainer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from helpers import CHATML_GENERATION_TEMPLATE, write_hf_chat_tokenizer
    from liandan.checkpoint.hf import hf_config, to_hf_tensors
    from liandan.data.tokens.tokenizer import load_tokenizer
    from liandan.train.preference import orpo_loss, simpo_loss

    tokenizer_file = write_hf_chat_tokenizer(tmp_path / "model", CHATML_GENERATION_TEMPLATE)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_file.parent))
    pairs = [{"prompt": [{"role": "user", "content": "Count to four."}],
              "chosen": [{"role": "assistant", "content": "one two three four"}],
              "rejected": [{"role": "assistant", "content": "seven, maybe"}]},
             {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
              "chosen": [{"role": "assistant", "content": "Blue, the colour of the sky at noon."}],
              "rejected": [{"role": "assistant", "content": "Seven."}]}]  # fmt: skip
    common = {"report_to": [], "max_length": None, "bf16": False, "use_cpu": True, "per_device_train_batch_size": 2}
    simpo_args = CPOConfig(output_dir=str(tmp_path / "cpo"), loss_type="simpo", cpo_alpha=0.0, beta=2.0,
                           simpo_gamma=0.7, label_smoothing=0.1, **common)  # fmt: skip
    trainers = {"simpo": (CPOTrainer, simpo_args),
                "orpo": (ORPOTrainer, ORPOConfig(output_dir=str(tmp_path / "orpo"), beta=0.3, **common))}  # fmt: skip
    overrides = {"simpo": ["--train.dpo_beta=2", "--train.simpo_gamma=0.7", "--train.dpo_label_smoothing=0.1"],
                 "orpo": ["--train.dpo_beta=0.3"]}  # fmt: skip
    for loss, (trainer_type, trl_args) in trainers.items():
        module = _module(tmp_path, f"--train.preference_loss={loss}", f"--run.name={loss}", *overrides[loss],
                         "--model.max_seq_len=128", "--train.seq_len=128",
                         tokenizer=load_tokenizer(tokenizer_file))  # fmt: skip
        config = LlamaConfig(**{k: v for k, v in hf_config(module.args).items() if k != "architectures"},
                             attn_implementation="eager")  # fmt: skip
        hf_model = LlamaForCausalLM(config)
        hf_model.load_state_dict(to_hf_tensors(module.args, module.model.state_dict()))
        trainer = trainer_type(model=hf_model, args=trl_args, train_dataset=Dataset.from_list(pairs),
                               processing_class=hf_tokenizer)  # fmt: skip

        # The loss functions on the same log-probabilities (means over tokens, so in (-inf, 0)).
        torch.manual_seed(0)
        logps = [(-torch.rand(5) * 3 - 0.01).requires_grad_() for _ in range(2)]
        if loss == "simpo":
            theirs, their_chosen, their_rejected = trainer.cpo_loss(*logps)
            ours, our_chosen, our_rejected = simpo_loss(*logps, beta=2.0, gamma=0.7, label_smoothing=0.1)
        else:
            theirs, their_chosen, their_rejected, _, _ = trainer.odds_ratio_loss(*logps)
            theirs = -theirs  # TRL returns beta * logsigmoid and subtracts it
            ours, our_chosen, our_rejected, _ = orpo_loss(*logps, beta=0.3)
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
        torch.testing.assert_close((our_chosen, our_rejected), (their_chosen, their_rejected), rtol=0, atol=1e-6)
        for a, b in zip(torch.autograd.grad(ours.mean(), logps), torch.autograd.grad(theirs.mean(), logps)):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)

        # The whole loss on TRL's batch: chosen rows, then rejected ones, padded to one length.
        batch = next(iter(trainer.get_train_dataloader()))
        joined = trainer.concatenated_inputs(batch, is_encoder_decoder=False, padding_value=0, device="cpu")
        ids, labels = joined["concatenated_input_ids"], joined["concatenated_labels"]
        attention = joined["concatenated_attention_mask"]
        assert ids.shape[0] == 4 and attention.sum(-1).unique().numel() == 4  # four lengths
        order = torch.tensor([0, 2, 1, 3])  # liandan's rows: pair i's chosen and rejected side by side
        targets = torch.where(labels[:, 1:] == -100, -1, labels[:, 1:])
        rows = Batch(ids[order, :-1], targets[order], (1 - attention[order, :-1]).int())
        ours, _ = module._pair_loss(rows, 1)
        if loss == "simpo":
            theirs = trainer.compute_loss(hf_model, batch)
        else:  # TRL's loss with its NLL taken over the chosen replies (its labels) instead of whole conversations
            chosen_logps, rejected_logps, chosen_logits, _, _ = trainer.concatenated_forward(hf_model, batch)
            reply_nll = torch.nn.CrossEntropyLoss()(chosen_logits.flatten(0, 1), labels[:2, 1:].flatten())
            theirs = reply_nll - trainer.odds_ratio_loss(chosen_logps, rejected_logps)[0].mean()
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
        ours.backward()
        theirs.backward()
        grads = to_hf_tensors(module.args, {name: p.grad for name, p in module.model.named_parameters()})
        for name, param in hf_model.named_parameters():
            torch.testing.assert_close(grads[name], param.grad, rtol=0, atol=1e-5)
