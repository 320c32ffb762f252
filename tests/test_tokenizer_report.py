"""`liandan tokenizer report`: bytes, characters and words per token of any tokenizer, per source and language."""

from __future__ import annotations

import json

import pytest

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
