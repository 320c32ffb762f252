"""Direct preference optimisation: malformed preference records counted by reason, the pair store and its
loader (chosen and rejected rows of their own, the reply alone a target), sequence log-probabilities against a
gather by hand, the loss and its gradients against TRL's DPOTrainer, a short run that learns the preference,
and a run resumed mid-way exactly."""

import shutil
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from helpers import (
    DPO_OVERRIDES,
    PREFERENCE_REJECTS,
    dpo_config,
    pair_loader,
    recording_metrics,
    tiny_config,
    write_preference_data,
)
from liandan.config import ConfigError
from liandan.data.documents.corpus import ReadStats
from liandan.data.documents.preferences import read_preferences
from liandan.track.logger import format_metrics
from liandan.train.preference import EMPTY_REPLY_LOGP, dpo_loss, sequence_logps


def test_malformed_preference_records_are_counted_with_their_reasons(tmp_path):
    stats, rejects = ReadStats(), []
    pairs = list(read_preferences(write_preference_data(tmp_path, n=6), stats=stats, on_reject=rejects.append))
    assert len(pairs) == stats.documents == 6
    assert stats.skipped == Counter(PREFERENCE_REJECTS.values())
    assert Counter(r["reason"] for r in rejects) == stats.skipped
    conversational = pairs[1]
    assert [m["role"] for m in conversational.chosen] == ["system", "user", "assistant"]
    assert conversational.chosen[:-1] == conversational.rejected[:-1]
    assert conversational.chosen[-1]["content"] == "one two three four" != conversational.rejected[-1]["content"]


def test_pairs_travel_as_two_rows_with_the_reply_alone_a_target(tmp_path):
    stats, store, loader = pair_loader(tmp_path)
    assert stats.documents == 6 and store.num_documents == 12
    assert store.loss_mask["pairs"] and store.loss_mask["read"]["skipped"] == dict(Counter(PREFERENCE_REJECTS.values()))
    batch = loader.next_step(2)[0]
    assert batch.inputs.shape == (4, 64) and loader.truncated() == (0, 12)
    decode = store.tokenizer._tok.decode
    for row in range(4):
        kept = batch.targets[row] >= 0
        reply = decode(batch.targets[row][kept].tolist(), skip_special_tokens=False)
        assert reply.endswith("<|im_end|>") and "<|im_start|>" not in reply
        assert (reply == "one two three four<|im_end|>") == (row % 2 == 0)  # chosen rows first in each pair
        assert decode(batch.inputs[row][:1].tolist(), skip_special_tokens=False) == "<|im_start|>"  # a row's start
    chosen, rejected = (decode(batch.inputs[r][batch.doc_ids[r] == 0].tolist()) for r in (0, 1))
    assert chosen.split("assistant")[0] == rejected.split("assistant")[0]  # the same prompt
    again = loader.batch_at(0, 2)[0]
    assert torch.equal(again.inputs, batch.inputs) and torch.equal(again.targets, batch.targets)


def test_gradient_accumulation_gives_the_loss_and_gradients_of_the_whole_batch(tmp_path):
    from liandan.train.components import build_environment, build_train_module

    _, store, loader = pair_loader(tmp_path)
    cfg = tiny_config(tmp_path, tmp_path / "unused.jsonl", *DPO_OVERRIDES)
    module = build_train_module(cfg, build_environment(cfg, say=lambda m: None), store.tokenizer)
    params = list(module.model.parameters())
    found = {}
    for micro_batch in (4, 1):
        for p in params:
            p.grad = None
        loss = module.train_batch(loader.batch_at(0, micro_batch), lambda *args, **kwargs: None, 1)
        found[micro_batch] = loss, [p.grad.clone() for p in params], dict(module.preference_metrics)
    torch.testing.assert_close(found[1][0], found[4][0], rtol=0, atol=1e-6)
    for ours, theirs in zip(found[1][1], found[4][1]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    assert found[1][2] == pytest.approx(found[4][2], abs=1e-6)
    assert not any(p.grad is not None for p in module.reference.parameters())  # frozen


def test_sequence_logps_and_their_means_equal_a_gather_by_hand():
    torch.manual_seed(0)
    logits, targets = torch.randn(4, 7, 11), torch.randint(0, 11, (4, 7))
    targets[:, :3] = -1
    by_hand = torch.zeros(4)
    for row in range(4):
        for t in range(3, 7):
            by_hand[row] += torch.log_softmax(logits[row, t], -1)[targets[row, t]]
    torch.testing.assert_close(sequence_logps(logits, targets), by_hand, rtol=0, atol=1e-5)
    torch.testing.assert_close(sequence_logps(logits, targets, average=True), by_hand / 4, rtol=0, atol=1e-6)
    targets[0] = -1  # a row without any target has no mean: it is given a constant
    assert sequence_logps(logits, targets, average=True)[0].item() == EMPTY_REPLY_LOGP


def test_the_dpo_loss_and_its_gradients_equal_the_formula_trl_computes():
    """On the same log-probabilities, liandan's loss equals TRL's DPOTrainer "sigmoid" expression
    (-logsigmoid(beta * delta), mean over pairs) in fp32, its gradients too; with label smoothing it is
    conservative DPO's."""
    torch.manual_seed(0)
    logps = [(torch.randn(5) * 3).requires_grad_() for _ in range(4)]
    delta = (logps[0] - logps[2]) - (logps[1] - logps[3])
    theirs = (-F.logsigmoid(0.3 * delta)).mean()
    ours, chosen, rejected = dpo_loss(*logps, beta=0.3)
    torch.testing.assert_close(ours.mean(), theirs, rtol=0, atol=1e-5)
    for a, b in zip(torch.autograd.grad(ours.mean(), logps, retain_graph=True), torch.autograd.grad(theirs, logps)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)
    smoothed, _, _ = dpo_loss(*logps, beta=0.3, label_smoothing=0.1)
    z = 0.3 * delta
    torch.testing.assert_close(smoothed, -0.9 * F.logsigmoid(z) - 0.1 * F.logsigmoid(-z), rtol=0, atol=1e-6)
    torch.testing.assert_close(chosen, 0.3 * (logps[0] - logps[2]).detach())
    torch.testing.assert_close(rejected, 0.3 * (logps[1] - logps[3]).detach())


def test_a_short_dpo_run_learns_the_preference(tmp_path):
    from liandan.train import Trainer

    data = write_preference_data(tmp_path, n=16, malformed=False)
    said = []
    trainer = Trainer(dpo_config(tmp_path, data, "--train.steps=12", "--optim.lr=3e-3", "--checkpoint.every=0"),
                      say=said.append)  # fmt: skip
    assert any("preference optimisation on 16 pairs" in line for line in said), said
    records = recording_metrics(trainer)
    trainer.train()
    first, last = records[0], records[-1]
    assert abs(first["rewards/margins"]) < 1e-6 and first["kl/token"] < 1e-6  # the policy starts as the reference
    assert last["rewards/accuracies"] > 0.5 and last["rewards/margins"] > first["rewards/margins"] + 0.1
    assert last["loss"] < first["loss"] and last["kl/token"] > 0
    assert last["logps/chosen"] > first["logps/chosen"]
    assert f"reward acc {last['rewards/accuracies']:.2f}" in format_metrics(last)


def test_a_dpo_run_resumes_exactly(tmp_path):
    from liandan.train import Trainer

    data = write_preference_data(tmp_path, n=6)
    common = ["--train.steps=6", "--checkpoint.every=2"]
    trainer = Trainer(dpo_config(tmp_path, data, *common), say=lambda m: None)
    straight = trainer.train()
    shutil.rmtree(trainer.run_dir / "checkpoints" / "step-00000006")
    resumed = Trainer(dpo_config(tmp_path, data, *common), say=lambda m: None)
    assert resumed.step == 4
    assert resumed.train().losses[-2:] == straight.losses[-2:]


def test_a_preference_store_written_ahead_trains_and_a_chat_store_is_refused(tmp_path):
    from helpers import liandan_here, write_chat_data
    from liandan.data.documents.corpus import DataError
    from liandan.train import Trainer

    data = write_preference_data(tmp_path, n=4)
    said = liandan_here("data", "chat", data, "--pairs", "--out", tmp_path / "prefs", "--bpe-vocab-size=300",
                        check=True).stdout  # fmt: skip
    assert "4 pairs" in said and "1 'chosen' equals 'rejected'" in said and "--train.objective=dpo" in said
    stores = f'--data.stores=["{tmp_path / "prefs"}"]'
    trainer = Trainer(dpo_config(tmp_path, data, stores, "--train.global_batch=2"), say=lambda m: None)
    assert trainer.parts.data.loader.next_step(2)[0].inputs.shape == (4, 64)
    liandan_here("data", "chat", write_chat_data(tmp_path), "--out", tmp_path / "sft", "--bpe-vocab-size=300",
                 check=True)  # fmt: skip
    with pytest.raises(DataError, match="without preference pairs"):
        Trainer(dpo_config(tmp_path, data, f'--data.stores=["{tmp_path / "sft"}"]', "--run.name=sft"),
                say=lambda m: None)  # fmt: skip


def test_dpo_refuses_what_it_does_not_run(tmp_path):
    from liandan.train import Trainer

    data = write_preference_data(tmp_path, n=4, malformed=False)
    with pytest.raises(ConfigError, match="dpo_beta must be positive"):
        Trainer(dpo_config(tmp_path, data, "--train.dpo_beta=0"), say=lambda m: None)
    with pytest.raises(ConfigError, match="missing: no such file or directory"):
        Trainer(dpo_config(tmp_path, data, f"--checkpoint.init_from={tmp_path / 'missing'}", "--run.name=r2"),
                say=lambda m: None)  # fmt: skip
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="no checkpoint there"):
        Trainer(dpo_config(tmp_path, data, f"--checkpoint.init_from={tmp_path / 'empty'}", "--run.name=r3"),
                say=lambda m: None)  # fmt: skip


def test_a_missing_init_from_is_refused_before_any_data_is_prepared(tmp_path):
    from liandan.resilience.roles import run_training

    config = tmp_path / "run.toml"
    config.write_text(dpo_config(tmp_path, write_preference_data(tmp_path, n=4, malformed=False)).to_toml())
    missing = tmp_path / "missing"
    with pytest.raises(ConfigError, match=f"checkpoint.init_from = {missing}: no such file or directory"):
        run_training(config, overrides=[f"--checkpoint.init_from={missing}", "--run.name=early"])
    assert not (tmp_path / "early").exists()  # no run directory, no data prepared


@pytest.mark.slow  # TRL's import and trainer: about 13 s
def test_the_loss_and_gradients_equal_trl_dpo_trainer_on_its_own_batch(tmp_path):
    """TRL's DPOTrainer (sigmoid loss, reference on the fly) and liandan's loss on the same tiny Llama weights,
    the same chosen/rejected rows and the same completion mask: losses and policy gradients equal in fp32."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    from helpers import CHATML_GENERATION_TEMPLATE, write_hf_chat_tokenizer
    from liandan.checkpoint.hf import hf_config, to_hf_tensors
    from liandan.model import ModelArgs, Transformer

    tokenizer_file = write_hf_chat_tokenizer(tmp_path / "model", CHATML_GENERATION_TEMPLATE)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_file.parent))
    torch.manual_seed(0)
    args = ModelArgs(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=256)
    policy, reference = Transformer(args), Transformer(args)  # two inits: the reference differs from the policy
    config = LlamaConfig(**{k: v for k, v in hf_config(args).items() if k != "architectures"},
                         attn_implementation="eager")  # fmt: skip
    hf_models = []
    for model in (policy, reference):
        hf_models.append(LlamaForCausalLM(config))
        hf_models[-1].load_state_dict(to_hf_tensors(args, model.state_dict()))
    pairs = [{"prompt": [{"role": "user", "content": "Count to four."}],
              "chosen": [{"role": "assistant", "content": "one two three four"}],
              "rejected": [{"role": "assistant", "content": "seven, maybe"}]}]  # fmt: skip
    # bf16 off: TRL turns it on wherever the device has it (CPUs too), and the reference would run autocast
    trl_args = DPOConfig(output_dir=str(tmp_path / "trl"), beta=0.3, report_to=[], max_length=None, bf16=False,
                         per_device_train_batch_size=1, use_cpu=True)  # fmt: skip
    trainer = DPOTrainer(model=hf_models[0], ref_model=hf_models[1], args=trl_args,
                         train_dataset=Dataset.from_list(pairs), processing_class=hf_tokenizer)  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    trl_loss = trainer.compute_loss(hf_models[0], batch)

    ids, attention, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    assert ids.shape[0] == 2  # chosen, then rejected: liandan's row order for one pair
    rows = _liandan_rows(tmp_path, pairs, tokenizer_file)
    for row in range(2):  # the same tokens; the same reply but for the newline ChatML writes after <|im_end|>
        length = int(attention[row].sum())
        assert rows.inputs[row, : length - 1].tolist() == ids[row, : length - 1].tolist()
        theirs = completion[row, 1:length].clone()
        theirs[length - 2] = 0  # the template's newline after the end token: TRL's completion, not liandan's
        assert (rows.targets[row, : length - 1] >= 0).tolist() == theirs.bool().tolist()
    targets = torch.where((completion[:, 1:] == 1) & (attention[:, 1:] == 1), ids[:, 1:], -1)
    logps = [sequence_logps(model(ids[:, :-1]), targets) for model in (policy, reference)]
    loss, _, _ = dpo_loss(logps[0][0::2], logps[0][1::2], logps[1][0::2].detach(), logps[1][1::2].detach(), 0.3)
    loss = loss.mean()
    torch.testing.assert_close(loss, trl_loss, rtol=0, atol=1e-5)
    loss.backward()
    trl_loss.backward()
    ours = to_hf_tensors(args, {name: p.grad for name, p in policy.named_parameters()})
    for name, param in hf_models[0].named_parameters():
        torch.testing.assert_close(ours[name], param.grad, rtol=0, atol=1e-5)


def _liandan_rows(tmp_path, pairs, tokenizer_file):
    """The pair loader's rows of `pairs` written to a preference store with liandan's ChatML and the tokenizer."""
    import json

    from liandan.config import load_config
    from liandan.data.pipeline.preferences import prepare_preference_store
    from liandan.data.tokens.pairs import PairLoader
    from liandan.data.tokens.store import TokenStore

    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(p) + "\n" for p in pairs))
    cfg = load_config(None, [f'--data.paths=["{data}"]', f"--data.tokenizer={tokenizer_file}"]).data
    prepare_preference_store(cfg, tmp_path / "store", say=lambda m: None)
    return PairLoader(TokenStore(tmp_path / "store"), 64, 1, seed=0).next_step(1)[0]


@pytest.mark.slow  # two runs, one of two processes
def test_dpo_on_two_fsdp_ranks_equals_one_process(tmp_path):
    from helpers import read_run, run_liandan

    data = write_preference_data(tmp_path, n=8, malformed=False)
    config = tmp_path / "dpo.toml"
    config.write_text(dpo_config(tmp_path / "runs", data, "--train.steps=4", "--run.name=").to_toml())
    losses = {}
    for nproc in (1, 2):
        done = run_liandan("train", config, f"--nproc={nproc}", f"--run.name=n{nproc}", timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        records = read_run(tmp_path / "runs" / f"n{nproc}").metrics
        losses[nproc] = [(r["loss"], r["rewards/margins"], r["kl/token"]) for r in records]
        assert read_run(tmp_path / "runs" / f"n{nproc}").summary["world_size"] == nproc
    assert len(losses[1]) == 4 and abs(losses[1][-1][1]) > 0
    for single, sharded in zip(losses[1], losses[2]):
        assert sharded == pytest.approx(single, rel=1e-5, abs=1e-7)


def test_the_reference_is_init_from_on_every_start_a_resume_included(tmp_path):
    """From a checkpoint (`init_from`) the policy starts as the reference: margins and KL are 0 at the first
    step; a resume reloads the reference from `init_from`, not from the resumed policy, and continues exactly."""
    from liandan.train import Trainer

    data = write_preference_data(tmp_path, n=6, malformed=False)
    first = Trainer(dpo_config(tmp_path, data, "--train.steps=2", "--run.name=a", "--optim.lr=3e-3"),
                    say=lambda m: None)  # fmt: skip
    first.train()
    start = first.run_dir / "checkpoints" / "step-00000002"
    common = ["--train.steps=4", "--checkpoint.every=2", "--run.name=b", f"--checkpoint.init_from={start}"]
    trainer = Trainer(dpo_config(tmp_path, data, *common), say=lambda m: None)
    records = recording_metrics(trainer)
    straight = trainer.train()
    assert records[0]["kl/token"] < 1e-9 and abs(records[0]["rewards/margins"]) < 1e-6
    assert records[-1]["kl/token"] > 0
    shutil.rmtree(trainer.run_dir / "checkpoints" / "step-00000004")
    resumed = Trainer(dpo_config(tmp_path, data, *common), say=lambda m: None)
    assert resumed.step == 2
    assert resumed.train().losses[-2:] == straight.losses[-2:]
