"""`liandan tokenizer report`: bytes, characters and words per token of any tokenizer, per source and language."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from liandan.cli.main import main
from liandan.data.inspect.fertility import WORD, by_language, fertility

ENGLISH = ["The cat sat on the mat, and the dog sat on the log. " * 20, "Rivers run to the sea in every season. " * 20]
CHINESE = ["天地玄黄，宇宙洪荒。日月盈昃，辰宿列张。" * 20, "学而时习之，不亦说乎？有朋自远方来，不亦乐乎？" * 20]


def write_sources(tmp_path):
    en, zh = tmp_path / "english.jsonl", tmp_path / "chinese.jsonl"
    en.write_text("".join(json.dumps({"text": t}) + "\n" for t in ENGLISH))
    zh.write_text("".join(json.dumps({"text": t}) + "\n" for t in CHINESE))
    return en, zh


def test_words_are_letter_runs_and_each_ideograph():
    assert WORD.findall("Hello, world 42! 你好，世界") == ["Hello", "world", "42", "你", "好", "世", "界"]


def test_bytes_characters_and_words_per_token_by_hand():
    docs = [("a", "hello world"), ("a", "你好世界"), ("b", "hi")]
    byte = lambda texts: [list(t.encode()) for t in texts]
    language = lambda text: "zh" if "你" in text else "en"
    rows = fertility(docs, byte, language)
    assert [(r.source, r.language, r.documents, r.tokens, r.characters, r.words) for r in rows] == [
        ("a", "en", 1, 11, 11, 2), ("a", "zh", 1, 12, 4, 4), ("b", "en", 1, 2, 2, 1)]  # fmt: skip
    [zh] = [r for r in rows if r.language == "zh"]
    assert zh.per_token("bytes") == 1.0 and zh.per_token("characters") == pytest.approx(1 / 3)
    english = by_language(rows)[0]
    assert (english.language, english.documents, english.tokens, english.words) == ("en", 2, 13, 3)


@pytest.mark.parametrize("kind", ["bpe", "sentencepiece"])
def test_a_tokenizer_trained_on_english_spends_more_tokens_on_chinese(tmp_path, capsys, kind):
    """A tokenizer trained on English alone against one trained on both, read from a liandan BPE's
    tokenizer.json and from a SentencePiece .model: Chinese characters per token rise with Chinese in training."""
    en, zh = write_sources(tmp_path)
    paths = {}
    for name, texts in (("english", ENGLISH), ("both", ENGLISH + CHINESE)):
        if kind == "bpe":
            from liandan.data.tokens.tokenizer import train_bpe

            paths[name] = tmp_path / f"{name}.json"
            train_bpe(texts, 400).save(paths[name])
        else:
            sentencepiece = pytest.importorskip("sentencepiece")
            sentencepiece.SentencePieceTrainer.train(sentence_iterator=iter(t[:400] for t in texts * 5),
                                                     model_prefix=str(tmp_path / name), vocab_size=400, hard_vocab_limit=False,
                                                     character_coverage=1.0, byte_fallback=True)  # fmt: skip
            paths[name] = tmp_path / f"{name}.model"
    per_token = {}
    for name, path in paths.items():
        out = tmp_path / f"{name}-report.json"
        assert main(["tokenizer", "report", str(path), str(en), str(zh), "--json", str(out)]) == 0
        report = json.loads(out.read_text())
        per_token[name] = {r["language"]: r["characters_per_token"] for r in report["languages"]}
    shown = capsys.readouterr().out
    assert "source" in shown and "chinese" in shown and "(all)" in shown
    assert per_token["both"]["zh"] > 1.5 * per_token["english"]["zh"], per_token
    assert per_token["english"]["en"] > per_token["english"]["zh"], per_token


@pytest.mark.parametrize(
    "argv, words",
    [
        (["no-such.json", "{en}"], "no-such.json: no such tokenizer file"),
        (["{bad}", "{en}"], "not a tokenizer.json"),
        (["byte", "missing.jsonl"], "missing.jsonl: no such file or directory"),
        (["byte", "{en}", "--max-docs", "-1"], "--max-docs = -1 must be 0 (all) or more"),
        (["{dir}", "{en}"], "holds neither tokenizer.json nor tokenizer.model"),
        (["byte", "{en}", "--json", "{bad}/x.json"], "bad.json is not a directory"),
    ],
)
def test_bad_inputs_end_in_one_line(tmp_path, capsys, argv, words):
    en, _ = write_sources(tmp_path)
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "empty-dir").mkdir()
    names = {"en": en, "bad": tmp_path / "bad.json", "dir": tmp_path / "empty-dir"}
    assert main(["tokenizer", "report", *(a.format(**names) for a in argv)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and words in err[0], err


def test_records_the_readers_skip_are_counted_not_silently_left_out(tmp_path, capsys):
    good = [json.dumps({"text": f"Record {i} is plain English text."}) for i in range(5)]
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_bytes(("\n".join(good) + "\n{not json\n[1, 2]\n").encode() + b'{"text": "bad \xff byte"}\n')
    assert main(["tokenizer", "report", "byte", str(mixed)]) == 0
    shown = capsys.readouterr().out
    assert "over 5 document(s)" in shown
    assert "mixed: 3 record(s) skipped: " in shown and "malformed JSON" in shown and "invalid UTF-8" in shown


def test_an_extension_path_that_cannot_be_written_is_one_line_before_the_work(tmp_path, capsys):
    en, _ = write_sources(tmp_path)
    (tmp_path / "t.toml").write_text("")
    (tmp_path / "tokenizer.json").write_text("{}")  # never read: the paths out are checked first
    for flag in ("--out", "--weights-out"):
        paths = {"--out": tmp_path / "out.json", "--weights-out": tmp_path / "w.safetensors"}
        paths[flag] = tmp_path / "t.toml" / "x"
        argv = ["tokenizer", "extend", tmp_path / "tokenizer.json", en, "--add", "5"]
        argv += ["--out", paths["--out"], "--checkpoint", tmp_path, "--weights-out", paths["--weights-out"]]
        assert main([str(a) for a in argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"liandan: error: cannot write {tmp_path}/t.toml/x: {tmp_path}/t.toml is not a directory"]


# -- extending a tokenizer ----------------------------------------------------------------------------------
def english_tokenizer(tmp_path):
    from liandan.data.tokens.tokenizer import train_bpe

    path = tmp_path / "english.json"
    train_bpe(ENGLISH * 3, 400).save(path)
    return path


def test_extension_keeps_every_id_and_cuts_english_as_before(tmp_path):
    from tokenizers import Tokenizer

    from liandan.data.tokens.extend import extend_tokenizer

    path = english_tokenizer(tmp_path)
    before = path.read_text()
    extension = extend_tokenizer(before, CHINESE * 5, 60)
    old, new = Tokenizer.from_str(before), Tokenizer.from_str(extension.tokenizer_json)
    assert old.get_vocab().items() <= new.get_vocab().items()  # every token keeps its id
    assert sorted(extension.sources) == list(range(extension.old_size, extension.old_size + 60))
    for text in ENGLISH:
        assert new.encode(text).ids == old.encode(text).ids
    for text in CHINESE:
        assert new.decode(new.encode(text).ids) == text
        assert len(new.encode(text).ids) * 2 < len(old.encode(text).ids)
    for new_id, ids in extension.sources.items():  # the old cut of each new token's bytes
        assert "".join(old.id_to_token(i) for i in ids) == new.id_to_token(new_id)


def test_a_grown_model_starts_new_rows_from_their_old_tokens():
    import torch

    from liandan.model.llama import ModelArgs, Transformer
    from liandan.model.vocab import grow_vocabulary

    torch.manual_seed(0)
    model = Transformer(ModelArgs(vocab_size=64, dim=32, n_layers=1, n_heads=2))
    embedding, head = model.tok_embeddings.weight.clone(), model.output.weight.clone()
    grow_vocabulary(model, 128, {64: [3, 5], 65: [7]})
    assert model.args.vocab_size == 128 and model.tok_embeddings.weight.shape == (128, 32)
    assert torch.equal(model.tok_embeddings.weight[:64], embedding) and torch.equal(model.output.weight[:64], head)
    assert torch.allclose(model.tok_embeddings.weight[64], embedding[[3, 5]].mean(0))
    assert torch.allclose(model.output.weight[65], head[7]) and torch.allclose(model.output.weight[100], head.mean(0))
    assert model(torch.tensor([[1, 64, 65]])).shape == (1, 3, 128)
    with pytest.raises(ValueError, match="not all among the 128 old rows"):
        grow_vocabulary(model, 192, {130: [500]})


@pytest.mark.slow
def test_extend_a_runs_tokenizer_grow_its_checkpoint_and_warm_start(tmp_path, capsys):
    """An English run with its own BPE; its tokenizer extended on Chinese, its last checkpoint grown, and a run on
    Chinese warm-started from it with the extended tokenizer: it starts from the English run's weights (both runs
    in this process, as `liandan train` runs them in its worker)."""
    from helpers import tiny_config
    from liandan.checkpoint.hf import load_consolidated
    from liandan.checkpoint.loading import load_model
    from liandan.run import RunDir
    from liandan.train import Trainer

    en, zh = write_sources(tmp_path)
    cfg = tiny_config(tmp_path / "runs", en, "--run.name=en", "--data.tokenizer=bpe", "--data.bpe_vocab_size=320",
                      "--train.steps=4", "--checkpoint.every=4")  # fmt: skip
    trainer = Trainer(cfg, say=lambda message: None)
    trainer.train()
    trainer.close()
    room = RunDir(tmp_path / "runs" / "en")
    store_tokenizer = room.path / "data" / "tokenizer.json"  # the tokenizer the run trained with
    extended, grown = tmp_path / "extended.json", tmp_path / "grown.safetensors"
    assert main(["tokenizer", "extend", str(store_tokenizer), str(zh), "--add", "100", "--out", str(extended),
                 "--checkpoint", str(room.checkpoints), "--weights-out", str(grown)]) == 0  # fmt: skip
    said = capsys.readouterr().out
    assert "every earlier id kept" in said and "grew step 4 of" in said and "vocabulary rows" in said
    # The text it was trained on holds nothing new; a checkpoint that fails to load leaves nothing half-written.
    nothing, half, half_weights = tmp_path / "nothing.json", tmp_path / "half.json", tmp_path / "half.safetensors"
    assert main(["tokenizer", "extend", str(store_tokenizer), str(en), "--add", "5", "--out", str(nothing)]) == 2
    assert "no new token to add" in capsys.readouterr().err and not nothing.exists()
    damaged = tmp_path / "damaged"
    shutil.copytree(room.checkpoints / "step-00000004", damaged)
    shard = min(damaged.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[::-1])
    assert main(["tokenizer", "extend", str(store_tokenizer), str(zh), "--add", "100", "--out", str(half),
                 "--checkpoint", str(damaged), "--weights-out", str(half_weights)]) == 2  # fmt: skip
    assert "fails its checksum" in capsys.readouterr().err
    assert not half.exists() and not half_weights.exists()
    english, _ = load_model(room.checkpoints / "step-00000004")
    weights, args = load_consolidated(grown)
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(store_tokenizer)).get_vocab_size()  # the padding rows past them take new ids
    assert args.vocab_size > english.tok_embeddings.num_embeddings
    assert torch.equal(weights["tok_embeddings.weight"][:ids], english.tok_embeddings.weight[:ids])
    assert torch.equal(weights["output.weight"][:ids], english.output.weight[:ids])
    warm = tiny_config(tmp_path / "runs", zh, "--run.name=zh", f"--data.tokenizer={extended}", "--train.steps=2",
                       f"--checkpoint.init_from={grown}")  # fmt: skip
    told: list[str] = []
    trainer = Trainer(warm, say=told.append)
    start = trainer.module.model.tok_embeddings.weight.detach().clone()
    trainer.train()
    trainer.close()
    assert any(line.startswith("initialised model weights from") for line in told), told
    assert torch.equal(start, weights["tok_embeddings.weight"])  # the grown rows, new ones included
