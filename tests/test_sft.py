"""Supervised fine-tuning on chat data: malformed records counted by reason, the loss mask of the built-in
ChatML template and of a model's own template, the store that carries the mask (and a pretraining store
without one), the masked loss against a cross-entropy by hand, and a fine-tuning run resumed mid-epoch."""

import json
from collections import Counter

import numpy as np
import pytest
import torch

from helpers import (
    CHAT_REJECTS,
    CHATML_GENERATION_TEMPLATE,
    SFT_OVERRIDES,
    chat_conversations,
    liandan_here,
    tiny_config,
    write_chat_data,
    write_corpus,
    write_hf_chat_tokenizer,
)
from liandan.config import ConfigError, load_config
from liandan.data.documents.chat import read_conversations
from liandan.data.documents.corpus import DataError, ReadStats
from liandan.data.tokens.chat import IM_END, ChatMLTemplate, ModelTemplate, encode_conversation, with_chat_tokens
from liandan.data.tokens.tokenizer import ByteTokenizer, train_bpe

SFT = SFT_OVERRIDES


def _masked_runs(tokenizer, ids, mask) -> list[str]:
    """The text of each maximal run of masked-in tokens, special tokens spelled out."""
    runs, current = [], []
    for token, kept in zip([*ids, None], [*mask, 0]):
        if kept:
            current.append(token)
        elif current:
            runs.append(tokenizer._tok.decode(current, skip_special_tokens=False))
            current = []
    return runs


def test_malformed_chat_records_are_counted_with_their_reasons(tmp_path):
    stats, rejects = ReadStats(), []
    conversations = list(read_conversations(write_chat_data(tmp_path), stats=stats, on_reject=rejects.append))
    assert len(conversations) == stats.documents == 13  # 12 conversations and the prompt/response pair
    assert stats.skipped == Counter(CHAT_REJECTS.values())
    assert Counter(r["reason"] for r in rejects) == stats.skipped
    assert all(isinstance(r["record"], int) and r["file"].endswith("chat.jsonl") for r in rejects)
    pair = conversations[-1].messages
    assert [m["role"] for m in pair] == ["user", "assistant"] and pair[1]["content"].startswith("Nothing")


def test_chatml_mask_covers_exactly_the_assistant_turns():
    unicode = [{"role": "user", "content": "你好, and café?"}, {"role": "assistant", "content": " 世界 🙂\n\n ok "}]
    conversations = [*chat_conversations(6), unicode]  # multi-byte characters and whitespace at the edges
    tokenizer = with_chat_tokens(train_bpe([t["content"] for c in conversations for t in c], 300))
    assert tokenizer.token_id(IM_END) is not None
    template = ChatMLTemplate()
    for messages in conversations:
        rendered = template.render(messages)
        ids, mask = encode_conversation(tokenizer, rendered)
        assert tokenizer._tok.decode(ids, skip_special_tokens=False) == rendered.text
        assert ids.count(tokenizer.token_id(IM_END)) == len(messages)  # the marker is one token, never split
        expected = [m["content"] + IM_END for m in messages if m["role"] == "assistant"]
        assert _masked_runs(tokenizer, ids, mask) == expected


def test_a_models_chat_template_renders_as_transformers_does_and_masks_each_assistant_turn(tmp_path):
    from transformers import AutoTokenizer

    from liandan.data.tokens.tokenizer import HFTokenizer

    tokenizer_file = write_hf_chat_tokenizer(tmp_path / "model")
    tokenizer, template = HFTokenizer.load(tokenizer_file), ModelTemplate(tokenizer_file.parent)
    reference = AutoTokenizer.from_pretrained(str(tokenizer_file.parent))
    for messages in chat_conversations(4):
        rendered = template.render(messages)
        ids, mask = encode_conversation(tokenizer, rendered)
        assert rendered.text == reference.apply_chat_template(messages, tokenize=False)
        assert ids == reference(rendered.text, add_special_tokens=False)["input_ids"]
        expected = [m["content"] + "</s>" for m in messages if m["role"] == "assistant"]
        assert _masked_runs(tokenizer, ids, mask) == expected


def test_a_models_template_writes_the_store_with_its_own_tokens_and_its_refusals_counted(tmp_path):
    from liandan.config import load_config
    from liandan.data.pipeline.chat import prepare_chat_store
    from liandan.data.tokens.store import TokenStore, verify_store
    from liandan.data.tokens.tokenizer import HFTokenizer

    tokenizer_file = write_hf_chat_tokenizer(tmp_path / "model")
    data = write_chat_data(tmp_path, n=4, malformed=False)
    late_system = [{"role": "user", "content": "hi"}, {"role": "system", "content": "be brief"},
                   {"role": "assistant", "content": "hello"}]  # fmt: skip
    with data.open("a") as handle:
        handle.write(json.dumps({"messages": late_system}) + "\n")
    overrides = [f'--data.paths=["{data}"]', f"--data.tokenizer={tokenizer_file}", "--data.chat_template=tokenizer"]
    stats = prepare_chat_store(load_config(None, overrides).data, tmp_path / "sft", say=lambda m: None)
    assert stats.documents == 5 and dict(stats.skipped) == {"chat template error: a system turn comes first": 1}
    store = TokenStore(tmp_path / "sft", verify=True)
    assert store.fingerprint == HFTokenizer.load(tokenizer_file).fingerprint()  # nothing added to a model's own
    assert store.loss_mask["template"].startswith("tokenizer:") and store.num_documents == 5
    kept = ModelTemplate(tmp_path / "sft")  # the store keeps the model's tokenizer_config.json, checked as its files
    assert kept.name == store.loss_mask["template"] and kept.eos_token == "</s>"
    (tmp_path / "sft" / "tokenizer_config.json").write_text("{}")
    assert any("tokenizer_config.json holds" in p for p in verify_store(tmp_path / "sft"))


def test_chat_data_needs_a_tokenizer_with_room_for_special_tokens():
    with pytest.raises(DataError, match="byte tokenizer"):
        with_chat_tokens(ByteTokenizer())


def test_a_fine_tuning_store_describes_its_mask_and_a_pretraining_store_has_none(tmp_path):
    from liandan.data.documents.readers import read_file
    from liandan.data.pipeline.chat import REJECTS
    from liandan.data.tokens.loader import PackedLoader
    from liandan.data.tokens.store import TokenStore, verify_store, write_manifest, write_shard

    write = ["data", "chat", write_chat_data(tmp_path), "--out", tmp_path / "sft", "--bpe-vocab-size=320"]
    said = liandan_here(*write, check=True).stdout
    assert "13 conversations" in said and "1 no assistant turn" in said and "1 malformed JSON" in said
    refused = liandan_here(*write)
    assert refused.returncode == 2 and "--overwrite" in refused.stderr  # a store is never replaced unasked
    store = TokenStore(tmp_path / "sft", verify=True)
    assert store.loss_mask["template"] == "chatml" and store.loss_mask["read"]["conversations"] == 13
    assert store.loss_mask["read"]["skipped"] == dict(Counter(CHAT_REJECTS.values()))
    rejects = [json.loads(line) for line in (tmp_path / "sft" / REJECTS).read_text().splitlines()]
    assert sorted(r["reason"] for r in rejects) == sorted(CHAT_REJECTS.values())
    shard = store.shards[0]
    ends = shard.doc_starts[1:] - 1  # each conversation's end-of-document token: never a target
    assert shard.loss_mask.shape == shard.tokens.shape and not shard.loss_mask[ends].any()
    assert 0 < shard.loss_mask.mean() < 1

    assert "loss mask (chatml template)" in liandan_here("data", "info", tmp_path / "sft", check=True).stdout

    mask_file = tmp_path / "sft" / "shard-00000.mask.npy"
    mask_file.write_bytes(mask_file.read_bytes()[:-1] + b"\x07")  # one flipped entry: the checksum sees it
    assert any("mask.npy: checksum mismatch" in p for p in verify_store(tmp_path / "sft"))

    tokenizer = ByteTokenizer()
    info = write_shard(read_file(write_corpus(tmp_path, 3)), tokenizer, tmp_path / "lm" / "shard-00000")
    write_manifest(tmp_path / "lm", [info], tokenizer)
    plain = TokenStore(tmp_path / "lm")
    with pytest.raises(DataError, match="without a loss mask"):
        PackedLoader(plain, 64, 4, seed=0, loss_mask=True)
    assert "loss_mask" not in plain.manifest and plain.loss_mask is None and plain.shards[0].loss_mask is None
    assert sorted(p.name for p in (tmp_path / "lm").iterdir()) == [
        "manifest.json", "shard-00000.bin", "shard-00000.docs.jsonl", "tokenizer.json"
    ]  # fmt: skip


@pytest.mark.parametrize("size", ["-1", "0", "5", "259"])
def test_a_bpe_vocabulary_below_the_bound_of_data_bpe_vocab_size_is_refused_in_one_line(tmp_path, size):
    done = liandan_here("data", "chat", write_chat_data(tmp_path), "--out", tmp_path / "sft", "--bpe-vocab-size", size)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == f"liandan: error: --bpe-vocab-size = {size} is too small; it must be >= 260"
    assert not (tmp_path / "sft").exists()
    with pytest.raises(ConfigError, match=f"data.bpe_vocab_size = {size} is too small; it must be >= 260"):
        load_config(None, [f"--data.bpe_vocab_size={size}"])  # the same bound, worded the same


def _sft_batch(tmp_path):
    from liandan.config import load_config
    from liandan.data.pipeline.chat import prepare_chat_store
    from liandan.data.tokens.loader import PackedLoader
    from liandan.data.tokens.store import TokenStore

    cfg = load_config(None, [f'--data.paths=["{write_chat_data(tmp_path, malformed=False)}"]', *SFT[1:3]]).data
    prepare_chat_store(cfg, tmp_path / "sft", say=lambda m: None)
    store = TokenStore(tmp_path / "sft")
    masked = PackedLoader(store, 64, 4, seed=3, loss_mask=True).next_step(4)[0]
    everything = PackedLoader(store, 64, 4, seed=3).next_step(4)[0]
    return store, masked, everything


def test_the_fine_tuning_loss_and_its_gradients_equal_a_masked_cross_entropy_by_hand(tmp_path):
    from liandan.model.spec import get as get_model_spec
    from liandan.train.causal_lm import model_args

    store, batch, everything = _sft_batch(tmp_path)
    kept = batch.targets >= 0
    assert torch.equal(batch.inputs, everything.inputs) and torch.equal(batch.targets[kept], everything.targets[kept])
    assert 0 < kept.sum() < kept.numel()
    cfg = tiny_config(tmp_path, tmp_path / "unused.jsonl")
    torch.manual_seed(0)
    model = get_model_spec("llama").build(model_args(cfg, store.vocab_size))
    params = [p for p in model.parameters() if p.requires_grad]

    loss = model(batch.inputs, batch.targets, doc_ids=batch.doc_ids)
    logits = model(batch.inputs, doc_ids=batch.doc_ids).float()
    log_probs = torch.log_softmax(logits, dim=-1).gather(-1, everything.targets[..., None]).squeeze(-1)
    by_hand = -(log_probs * kept).sum() / kept.sum()
    torch.testing.assert_close(loss, by_hand, rtol=0, atol=1e-6)
    for ours, theirs in zip(torch.autograd.grad(loss, params), torch.autograd.grad(by_hand, params)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)

    nothing = torch.full_like(batch.targets, -1)  # a window of prompts alone: loss 0, no nan
    assert model(batch.inputs, nothing, doc_ids=batch.doc_ids).item() == 0.0


def test_every_target_of_a_step_weighs_the_same_whichever_micro_batch_holds_it(tmp_path):
    """Gradient accumulation over micro-batches of unequal assistant shares gives the loss and gradients of the
    whole batch at once (the mean over its targets), not the mean of the micro-batches' means."""
    from liandan.data.tokens.loader import PackedLoader
    from liandan.train.components import build_environment, build_train_module

    store, _, _ = _sft_batch(tmp_path)
    cfg = tiny_config(tmp_path, tmp_path / "unused.jsonl", *SFT)
    module = build_train_module(cfg, build_environment(cfg, say=lambda m: None), store.tokenizer)
    params = list(module.model.parameters())
    found = {}
    for micro_batch in (4, 1):
        batches = PackedLoader(store, 64, 4, seed=3, loss_mask=True).next_step(micro_batch)
        for p in params:
            p.grad = None
        loss = module.train_batch(batches, lambda *args, **kwargs: None, 1)
        found[micro_batch] = loss, [p.grad.clone() for p in params], batches
    whole, parts = found[4], found[1]
    assert whole[2][0].loss_weight == 1.0 and len({b.loss_weight for b in parts[2]}) == 4
    torch.testing.assert_close(parts[0], whole[0], rtol=0, atol=1e-6)
    for ours, theirs in zip(parts[1], whole[1]):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-6)
    with torch.no_grad():  # what equal weights would have given
        means = [module.model(b.inputs, b.targets, doc_ids=b.doc_ids) for b in parts[2]]
    assert abs(sum(means) / 4 - whole[0]) > 1e-3


def test_a_fine_tuning_run_resumes_exactly_mid_epoch(tmp_path):
    import shutil

    from liandan.train import Trainer

    data = write_chat_data(tmp_path, n=6)
    common = [*SFT, f'--data.paths=["{data}"]', "--train.steps=8", "--checkpoint.every=3",
              "--checkpoint.async_save=false", "--model.max_seq_len=64"]  # fmt: skip
    trainer = Trainer(tiny_config(tmp_path, data, *common), say=lambda m: None)
    windows = len(trainer.parts.data.loader.streams[0].train_windows)
    assert 8 * 4 > windows > 6 * 4  # eight steps of 4 go past the first epoch; step 6 is inside it
    straight = trainer.train()
    assert all(np.isfinite(straight.losses))

    shutil.rmtree(trainer.run_dir / "checkpoints" / "step-00000008")
    resumed = Trainer(tiny_config(tmp_path, data, *common), say=lambda m: None)
    assert resumed.step == 6
    assert resumed.train().losses[-2:] == straight.losses[-2:]


def test_fine_tuning_refuses_attention_across_packed_conversations_and_can_learn_every_token(tmp_path):
    from liandan.train import Trainer

    data = write_chat_data(tmp_path, malformed=False)
    with pytest.raises(ConfigError, match="train.mask"):
        Trainer(tiny_config(tmp_path, data, *SFT, "--train.mask=causal"), say=lambda m: None)
    liandan_here("data", "chat", data, "--out", tmp_path / "store", "--bpe-vocab-size=320", check=True)
    said: list[str] = []
    every_token = [*SFT, f'--data.stores=["{tmp_path / "store"}"]', "--train.sft_targets=all", "--run.name=all"]
    trainer = Trainer(tiny_config(tmp_path, data, *every_token), say=said.append)
    batch = trainer.parts.data.loader.next_step(4)[0]
    assert bool((batch.targets >= 0).all()) and batch.loss_weight is None
    assert any("conversations are longer than train.seq_len = 64 tokens" in line for line in said), said


def test_the_assistant_mask_and_loss_equal_transformers_and_trl(tmp_path):
    """The built-in ChatML renders as the same template does in transformers; the turns found by rendering
    prefixes are the tokens transformers' {% generation %} mask picks; and on one conversation liandan's
    masked loss and its gradients equal TRL's SFTTrainer with assistant_only_loss, on the same weights (fp32)."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import SFTConfig, SFTTrainer

    from liandan.checkpoint.hf import hf_config, to_hf_tensors
    from liandan.data.tokens.tokenizer import HFTokenizer
    from liandan.model import ModelArgs, Transformer

    tokenizer_file = write_hf_chat_tokenizer(tmp_path / "model", CHATML_GENERATION_TEMPLATE)
    tokenizer, reference = HFTokenizer.load(tokenizer_file), AutoTokenizer.from_pretrained(str(tokenizer_file.parent))
    messages = chat_conversations(4)[3]  # a system turn and three exchanges
    rendered = ModelTemplate(tokenizer_file.parent).render(messages)
    assert rendered.text == ChatMLTemplate().render(messages).text
    ids, mask = encode_conversation(tokenizer, rendered)
    theirs = reference.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
    assert theirs["input_ids"] == ids and list(theirs["assistant_masks"]) == mask.tolist()

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=320, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=96, max_seq_len=256)
    model = Transformer(args)
    config = {k: v for k, v in hf_config(args).items() if k != "architectures"}
    hf_model = LlamaForCausalLM(LlamaConfig(**config, attn_implementation="eager"))
    hf_model.load_state_dict(to_hf_tensors(args, model.state_dict()))
    trl_args = SFTConfig(output_dir=str(tmp_path / "trl"), assistant_only_loss=True, report_to=[], max_length=None,
                         per_device_train_batch_size=1, use_cpu=True)  # fmt: skip
    trainer = SFTTrainer(model=hf_model, args=trl_args, train_dataset=Dataset.from_list([{"messages": messages}]),
                         processing_class=reference)  # fmt: skip
    batch = next(iter(trainer.get_train_dataloader()))
    assert batch["input_ids"][0].tolist() == ids
    trl_loss = trainer.compute_loss(hf_model, batch)

    tokens, kept = torch.tensor([ids]), torch.from_numpy(mask)[None].bool()
    loss = model(tokens[:, :-1], torch.where(kept[:, 1:], tokens[:, 1:], -1))
    torch.testing.assert_close(loss, trl_loss, rtol=0, atol=1e-5)
    loss.backward()
    trl_loss.backward()
    ours = to_hf_tensors(args, {name: p.grad for name, p in model.named_parameters()})
    for name, param in hf_model.named_parameters():
        torch.testing.assert_close(ours[name], param.grad, rtol=0, atol=1e-5)


@pytest.mark.slow  # two runs, one of two processes
def test_sft_on_two_fsdp_ranks_and_under_tensor_parallelism_equals_one_process(tmp_path):
    """The same fine-tuning run on one process, on two FSDP ranks and on two tensor-parallel ranks: every step's
    loss (the mean over the global batch's assistant tokens, whichever rank holds them) is the same to rounding."""
    from helpers import read_run, run_liandan

    data = write_chat_data(tmp_path, n=12, malformed=False)
    config = tmp_path / "sft.toml"
    config.write_text(tiny_config(tmp_path / "runs", data, *SFT, "--train.steps=4", "--run.name=",
                                  "--checkpoint.async_save=false").to_toml())  # fmt: skip
    losses = {}
    layouts = {"one": ["--nproc=1"], "fsdp": ["--nproc=2"], "tp": ["--nproc=2", "--parallel.tp=2"]}
    for name, layout in layouts.items():
        done = run_liandan("train", config, *layout, f"--run.name={name}", timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        run = read_run(tmp_path / "runs" / name)
        losses[name] = [r["loss"] for r in run.metrics]
        assert run.summary["world_size"] == int(layout[0].split("=")[1])
        [start] = run.of_kind("train_start")
        assert ("tp=2" in start["layout"]) == (name == "tp"), start["layout"]
    assert len(losses["one"]) == 4 and losses["one"][-1] < losses["one"][0]
    assert losses["fsdp"] == pytest.approx(losses["one"], rel=1e-5)
    assert losses["tp"] == pytest.approx(losses["one"], rel=1e-5)
