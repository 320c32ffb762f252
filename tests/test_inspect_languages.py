"""The inspection's language-share flags: languages outside a source's expected ones, expected ones missing."""

import json

import pytest

from helpers import liandan_here
from liandan.data.documents.corpus import Document
from liandan.data.inspect.inspection import Thresholds, inspect_sources
from liandan.data.pipeline.pipeline import read_jsonl_zst, run_pipeline
from liandan.data.pipeline.pipeline_config import InputSpec, PipelineConfig, PipelineSection, expected_languages
from liandan.data.steps.langid import Language

EN = (
    "The river town woke slowly in the grey light of the morning. Fishermen pulled their boats onto the shingle "
    "and spread the nets to dry, while the baker on the corner opened his shutters and set out the first loaves."
)
ZH = "清晨的小镇在薄雾中慢慢醒来。渔夫们把小船拖上岸边，把渔网摊开晾干。街角的面包店打开了窗户，摆出当天的第一批面包。"
FR = "Le village se réveillait lentement dans la lumière grise du matin, et les pêcheurs tiraient leurs barques."


def tagged(source, languages):
    """Documents whose text is irrelevant: only their language tag counts."""
    return [
        Document(source, f"{source}-{i}", f"document {i} of {source}", {"language": lang})
        for i, lang in enumerate(languages)
    ]


def language_flags(report):
    return [f for f in report.flags if f.kind in ("unexpected_language", "expected_language_short")]


def test_an_unexpected_language_above_the_threshold_is_flagged(tmp_path):
    sources = {
        "web-en": tagged("web-en", ["en"] * 80 + ["zh"] * 20),
        "books-en": tagged("books-en", ["en"] * 96 + ["fr"] * 4),  # 4%: below the 5% threshold
    }
    expected = {"web-en": ["en"], "books-en": ["en"]}
    report = inspect_sources(sources, tmp_path, expected_languages=expected)
    flag, short = language_flags(report)
    assert (flag.source, flag.kind, flag.value, flag.expected) == ("web-en", "unexpected_language", 0.2, (0.0, 0.05))
    assert flag.message == "20% of documents are in zh, which is not among the expected (en)"
    assert (short.source, short.kind, short.value) == ("web-en", "expected_language_short", 0.8)  # below 90%
    # and in every output: the JSON a later run compares with, and the readable reports
    data = json.loads((tmp_path / "report.json").read_text(encoding="utf-8"))
    assert [(f["source"], f["kind"]) for f in data["flags"]] == [
        ("web-en", "unexpected_language"),
        ("web-en", "expected_language_short"),
    ]
    assert data["sources"]["web-en"]["languages"] == {"en": 0.8, "zh": 0.2}
    assert data["sources"]["web-en"]["languages_expected"] == ["en"]
    markdown = (tmp_path / "report.md").read_text(encoding="utf-8")
    assert "| zh language share | 20% | ≤ 5% |" in markdown and "| zh | 20% | no |" in markdown
    assert '<tr class="flagged"><td>zh</td>' in (tmp_path / "report.html").read_text(encoding="utf-8")
    stricter = inspect_sources(
        sources, tmp_path / "strict", expected_languages=expected, thresholds=Thresholds(unexpected_language_share=0.03)
    )
    assert sorted(f.source for f in language_flags(stricter)) == ["books-en", "web-en", "web-en"]


def test_expected_languages_falling_short_are_flagged(tmp_path):
    sources = {
        "bilingual": tagged("bilingual", ["en"] * 99 + ["zh"]),  # 1 in 100 Chinese: not the source it claims to be
        "zh": tagged("zh", ["zh"] * 85 + ["und"] * 15),  # numbers and symbols: short, never "unexpected"
        "unchecked": tagged("unchecked", ["ru"] * 100),  # no expectation, no flag
    }
    expected = {"bilingual": ["en", "zh", "ja"], "zh": ["zh"]}
    flags = language_flags(inspect_sources(sources, tmp_path, expected_languages=expected))
    assert [(f.source, f.kind, f.statistic, f.value) for f in flags] == [
        ("bilingual", "expected_language_short", "ja language share", 0.0),
        ("zh", "expected_language_short", "zh language share", 0.85),
    ]
    assert flags[1].message == "the expected language (zh) holds only 85% of documents"
    assert flags[1].expected == (0.9, None)


def test_untagged_documents_are_identified_only_when_languages_are_expected(tmp_path):
    texts = [EN] * 6 + [ZH] * 3 + [FR]
    docs = [Document("mixed", str(i), t) for i, t in enumerate(texts)]
    plain = inspect_sources({"mixed": docs}, tmp_path / "plain")
    assert plain.data["sources"]["mixed"]["languages"] == {} and not language_flags(plain)
    report = inspect_sources({"mixed": docs}, tmp_path / "expected", expected_languages={"mixed": ["EN"]})
    assert report.data["sources"]["mixed"]["languages"] == {"en": 0.6, "zh": 0.3, "fr": 0.1}
    assert [(f.kind, f.statistic) for f in language_flags(report)] == [
        ("unexpected_language", "zh language share"),
        ("unexpected_language", "fr language share"),
        ("expected_language_short", "en language share"),
    ]
    assert all("language" not in d.meta for d in docs)  # the caller's documents are not changed


def test_pipeline_expects_each_input_s_languages_or_the_language_step_s():
    cfg = PipelineConfig(
        inputs=[InputSpec(name="en", paths=["x"], languages=["en"]), InputSpec(name="mixed", paths=["y"])],
        steps=[{"name": "normalize"}, {"name": "language", "languages": ["en", "zh"]}],
    )
    assert expected_languages(cfg) == {"en": ["en"], "mixed": ["en", "zh"]}
    cfg.steps = [Language(languages=["zh", "en"])]
    assert expected_languages(cfg) == {"en": ["en"], "mixed": ["en", "zh"]}
    cfg.steps = []
    assert expected_languages(cfg) == {"en": ["en"]}
    assert "languages" not in cfg.to_dict()["inputs"][1]  # unset: the resolved config reads as before


def test_pipeline_report_flags_a_source_in_the_wrong_language(tmp_path):
    (tmp_path / "en.jsonl").write_text(
        "".join(json.dumps({"text": f"{EN} Paragraph {i}. Call +44 20 7946 0958."}) + "\n" for i in range(8))
        + "".join(json.dumps({"text": f"{ZH}第{i}段。"}, ensure_ascii=False) + "\n" for i in range(4))
        + json.dumps({"text": f"{EN} They frobnicate."})
        + "\n",
        encoding="utf-8",
    )
    cfg = PipelineConfig(
        pipeline=PipelineSection(output=str(tmp_path / "out"), workers=1),
        inputs=[InputSpec(name="en", paths=[str(tmp_path / "en.jsonl")], languages=["en"])],
        steps=[
            {"name": "pii"},
            {"name": "language", "languages": ["en", "zh"]},
            {"name": "bad_words", "languages": [], "extra_words": ["frobnicate"]},
        ],
    )
    cfg.tokenizer.kind = "byte"
    cfg.dedup.exact = cfg.dedup.near = False
    cfg.check()
    summary = run_pipeline(cfg, say=lambda m: None).summary
    assert summary["steps"][0]["changed"] == {"phone_number": 8, "phone_number replacements": 8}
    assert summary["steps"][2]["dropped"] == {"bad_words:extra": 1}
    (rejected,) = read_jsonl_zst(tmp_path / "out" / "clean" / "00000-en.rejects.jsonl.zst")
    assert (rejected["step"], rejected["reason"], rejected["meta"]["bad_word"]) == (
        "bad_words",
        "bad_words:extra",
        "frobnicate",
    )
    assert any(f.startswith("en: ") and "in zh, which is not among the expected (en)" in f
               for f in summary["report"]["flags"])  # fmt: skip
    data = json.loads((tmp_path / "out" / "report" / "report.json").read_text(encoding="utf-8"))
    assert data["sources"]["en"]["languages"] == pytest.approx({"en": 2 / 3, "zh": 1 / 3}, abs=1e-5)


def test_inspect_command_takes_the_expected_languages(tmp_path):
    path = tmp_path / "web.jsonl"
    texts = [EN] * 7 + [ZH] * 3
    path.write_text("".join(json.dumps({"text": t}, ensure_ascii=False) + "\n" for t in texts), encoding="utf-8")
    done = liandan_here("data", "inspect", path, "--out", tmp_path / "report", "--languages", "en")
    assert done.returncode == 0, done.stderr
    assert "flag: web: 30% of documents are in zh, which is not among the expected (en)" in done.stdout
    data = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    assert data["sources"]["web"]["languages"] == {"en": 0.7, "zh": 0.3}
    done = liandan_here("data", "inspect", path, "--out", tmp_path / "other", "--languages", "en,english")
    assert done.returncode == 2 and not (tmp_path / "other").exists()
    expected = ("liandan: error: --languages = ['en', 'english']: 'english' is not a language code of fastText"
                " lid.176; use ISO 639 codes such as 'en', 'zh', 'de', 'fr', 'ja' ('und': no language found)")  # fmt: skip
    assert done.stderr.strip().splitlines() == [expected]
