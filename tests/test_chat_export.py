"""A model fine-tuned on chats exported to transformers with its chat template: `apply_chat_template` gives the
token ids liandan trained on (ChatML built in, and a model's own template), generation stops at the end of a
turn as liandan's does, and a pretrained model's export carries no template."""

import json

import pytest
import torch

from helpers import (
    SFT_OVERRIDES,
    chat_conversations,
    liandan_here,
    tiny_config,
    write_chat_data,
    write_hf_chat_tokenizer,
)
from liandan.data.tokens.chat import IM_END, IM_START, ChatMLTemplate, ModelTemplate, encode_conversation
from liandan.data.tokens.tokenizer import HFTokenizer

transformers = pytest.importorskip("transformers")


def _fine_tuned_export(directory, *overrides):
    """A two-step fine-tuning run on chats, exported with `liandan export --hf`: (run directory, export)."""
    from liandan.train import Trainer

    data = write_chat_data(directory, n=6, malformed=False)
    cfg = tiny_config(directory, data, *SFT_OVERRIDES, f'--data.paths=["{data}"]', "--train.steps=2",
                      "--checkpoint.every=2", "--checkpoint.async_save=false", *overrides)  # fmt: skip
    trainer = Trainer(cfg, say=lambda m: None)
    trainer.train()
    run_dir = trainer.run_dir
    said = liandan_here("export", run_dir, directory / "hf", "--hf", check=True).stdout
    assert "with its chat template" in said
    return run_dir, directory / "hf"


@pytest.fixture(scope="module")
def chatml_export(tmp_path_factory):
    return _fine_tuned_export(tmp_path_factory.mktemp("chatml"))


def _liandan_ids(tokenizer, text: str) -> list[int]:
    return tokenizer.encode_with_offsets(text)[0]


def test_a_chatml_fine_tune_renders_in_transformers_as_it_trained(chatml_export):
    from liandan.evaluate.loading import load_for_eval

    run_dir, out = chatml_export
    _, tokenizer, _ = load_for_eval(run_dir)
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    template = ChatMLTemplate()
    for messages in chat_conversations(4):  # one to three exchanges, with and without a system turn
        ids, mask = encode_conversation(tokenizer, template.render(messages))
        assert theirs.apply_chat_template(messages, tokenize=True, return_dict=False) == ids
        marked = theirs.apply_chat_template(messages, return_assistant_tokens_mask=True, return_dict=True)
        assert list(marked["assistant_masks"]) == mask.tolist()  # what liandan's loss learned
        asking = messages[:-1]  # up to the last user turn, then the opening of the assistant's
        prompt = theirs.apply_chat_template(asking, tokenize=True, add_generation_prompt=True, return_dict=False)
        assert prompt == _liandan_ids(tokenizer, template.generation_prompt(asking))
        assert prompt[-3:] == _liandan_ids(tokenizer, f"{IM_START}assistant\n")

    im_start, im_end = tokenizer.token_id(IM_START), tokenizer.token_id(IM_END)
    assert {im_start, im_end} <= set(theirs.all_special_ids)  # registered: dropped by skip_special_tokens
    assert theirs.convert_tokens_to_ids([IM_START, IM_END]) == [im_start, im_end]
    assert theirs.eos_token == IM_END and theirs.pad_token_id == tokenizer.eos_id
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [im_end, tokenizer.eos_id]  # a turn's end, and a document's
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == [im_end, tokenizer.eos_id]


def test_generation_in_transformers_stops_at_the_end_of_a_turn_as_liandans_does(chatml_export):
    """Greedy generation from a chat prompt gives liandan's tokens and stops at <|im_end|>. The two-step model
    rarely writes it by itself, so both models are given the same output row for it: the row of the token
    liandan writes third, plus what raises its logit there by 1, which makes <|im_end|> the greedy choice by
    then."""
    from liandan.evaluate.loading import load_for_eval
    from liandan.evaluate.scoring import generate

    run_dir, out = chatml_export
    model, tokenizer, _ = load_for_eval(run_dir)
    im_end = tokenizer.token_id(IM_END)
    messages = [{"role": "user", "content": "What does pass do?"}]
    prompt = _liandan_ids(tokenizer, ChatMLTemplate().generation_prompt(messages))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager")
    assert im_end in hf_model.generation_config.eos_token_id

    free = generate(model, [prompt], max_new_tokens=8)[0]
    states = []
    hook = model.output.register_forward_hook(lambda module, inputs, output: states.append(inputs[0][0, -1]))
    with torch.no_grad():
        model(torch.tensor([prompt + free[:2]]))
        hook.remove()
        state = states[0]
        row = model.output.weight[free[2]] + state / state.dot(state)
        model.output.weight[im_end] = row
        hf_model.get_output_embeddings().weight[im_end] = row
    ours = generate(model, [prompt], max_new_tokens=8, eos_id=im_end)
    assert len(ours[0]) < 8  # it stopped
    theirs = hf_model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)[0, len(prompt) :]
    assert theirs.tolist() == [*ours[0], im_end]


def test_a_models_own_template_is_exported_as_it_rendered_the_data(tmp_path):
    tokenizer_file = write_hf_chat_tokenizer(tmp_path / "model")  # Zephyr's style, turns ending in </s>
    run_dir, out = _fine_tuned_export(tmp_path, f"--data.tokenizer={tokenizer_file}", "--data.chat_template=tokenizer")
    theirs = transformers.AutoTokenizer.from_pretrained(str(out))
    source = ModelTemplate(tokenizer_file.parent)
    assert theirs.chat_template == source.template
    tokenizer = HFTokenizer.load(tokenizer_file)
    for messages in chat_conversations(3):
        ids, _ = encode_conversation(tokenizer, source.render(messages))
        assert theirs.apply_chat_template(messages, tokenize=True, return_dict=False) == ids
        prompt = theirs.apply_chat_template(messages[:-1], add_generation_prompt=True, return_dict=False)
        assert prompt == _liandan_ids(tokenizer, source.generation_prompt(messages[:-1]))
    end = tokenizer.token_id("</s>")
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [end, tokenizer.eos_id]

    (tmp_path / "model").rename(tmp_path / "moved")  # the run's store keeps the model's tokenizer_config.json
    liandan_here("export", run_dir, tmp_path / "kept", "--hf", check=True)
    kept = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "kept"))
    assert kept.chat_template == source.template and kept.eos_token == "</s>"
    (run_dir / "data" / "tokenizer_config.json").unlink()  # now nowhere: said, and left out
    said = liandan_here("export", run_dir, tmp_path / "again", "--hf", check=True).stdout
    assert "was not found" in said and "the export has no chat_template" in said
    assert "chat_template" not in json.loads((tmp_path / "again" / "tokenizer_config.json").read_text())


def test_a_pretrained_model_exports_without_a_chat_template(tmp_path):
    from helpers import write_corpus
    from liandan.train import Trainer

    corpus = write_corpus(tmp_path, 6)
    cfg = tiny_config(tmp_path, corpus, "--data.tokenizer=bpe", "--data.bpe_vocab_size=300", "--train.steps=2",
                      "--checkpoint.every=2", "--checkpoint.async_save=false", "--data.val_fraction=0")  # fmt: skip
    trainer = Trainer(cfg, say=lambda m: None)
    trainer.train()
    said = liandan_here("export", trainer.run_dir, tmp_path / "hf", "--hf", check=True).stdout
    assert "chat template" not in said
    config = json.loads((tmp_path / "hf" / "tokenizer_config.json").read_text())
    assert "chat_template" not in config and config["eos_token"] == "<|endoftext|>"
    assert not (tmp_path / "hf" / "generation_config.json").exists()


def test_fine_tuning_a_hugging_face_model_on_its_own_template_exports_back_to_transformers(tmp_path):
    """The way a user takes a downloaded model: its directory (weights, tokenizer, chat template) starts a
    fine-tuning run that renders the chats with that template, and the export loads in transformers with the
    same template and gives liandan's logits on a chat it renders itself."""
    from liandan.checkpoint.loading import load_model
    from liandan.train import Trainer

    tokenizer_file = write_hf_chat_tokenizer(tmp_path / "model")
    vocab = 64 * -(-HFTokenizer.load(tokenizer_file).vocab_size // 64)
    torch.manual_seed(0)
    start = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-5, rope_theta=10000.0,
        tie_word_embeddings=False,
    ))  # fmt: skip
    start.save_pretrained(tmp_path / "model")
    data = write_chat_data(tmp_path, n=6, malformed=False)
    cfg = tiny_config(tmp_path, data, *SFT_OVERRIDES, f'--data.paths=["{data}"]', f"--data.tokenizer={tokenizer_file}",
                      "--data.chat_template=tokenizer", f"--checkpoint.init_from={tmp_path / 'model'}",
                      "--model.ffn_dim=96", "--train.steps=2", "--checkpoint.every=2",
                      "--checkpoint.async_save=false")  # fmt: skip
    trainer = Trainer(cfg, say=lambda m: None)
    trainer.train()
    said = liandan_here("export", trainer.run_dir, tmp_path / "tuned", "--hf", check=True).stdout
    assert "with its chat template" in said

    theirs = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tuned"))
    assert theirs.chat_template == ModelTemplate(tokenizer_file.parent).template
    tuned = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "tuned")).eval()
    ours, _ = load_model(trainer.run_dir / "checkpoints" / "step-00000002")
    rendered = theirs.apply_chat_template(chat_conversations(1)[0], tokenize=True, return_dict=False)
    ids = torch.tensor([rendered[:64]])  # the model's longest sequence
    with torch.no_grad():
        assert (tuned(ids).logits - ours.eval()(ids)).abs().max().item() < 1e-4
        # trained from the downloaded weights, and moved by the fine-tuning
        moved = (tuned.model.embed_tokens.weight - start.model.embed_tokens.weight).abs()
        assert 0 < moved.max().item() < 0.01  # two steps of AdamW move each weight by about lr at most
