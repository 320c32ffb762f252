"""`inspect_sources` on the real shared corpora: clean text stays quiet, injected corruption is flagged."""

from __future__ import annotations

import json
import re
import warnings
from dataclasses import asdict

import numpy as np
import pytest

from helpers import SHARED_DATA, liandan_here
from liandan.config import ConfigError
from liandan.data.documents.corpus import DataError, Document
from liandan.data.documents.readers import read_documents
from liandan.data.inspect.inspection import InspectionReport, Thresholds, inspect_sources
from liandan.data.steps.base import StepStats
from liandan.data.tokens.tokenizer import ByteTokenizer

CORPUS = SHARED_DATA / "corpus"
CLASS_KINDS = {"char_class", "char_class_vs_sources"}
# Ends a paragraph in 30% of wikitext articles: long enough (16 words) to be caught as a repeated 13-gram.
LICENCE = "This article is licensed under the Creative Commons Attribution ShareAlike License and may be reused freely"
# "Compiled by the poetry site; credit the source when reposting": a line of its own in 30% of the poems.
BOILERPLATE = "本文由古诗文网整理，转载请注明出处。"


def load_corpora() -> dict[str, list[Document]]:
    if not CORPUS.is_dir():
        pytest.skip(f"shared data not found at {CORPUS}")
    text = (CORPUS / "en-shakespeare.txt").read_text(encoding="utf-8")
    paragraphs = [p for p in re.split(r"\n\s*\n", text) if p.strip()]
    return {
        "wikitext": list(read_documents([str(CORPUS / "en-wikitext2.jsonl")])),
        "zh-classics": list(read_documents([str(CORPUS / "zh-classics.jsonl")])),
        "shakespeare": [Document("shakespeare", f"paragraph-{i}", p) for i, p in enumerate(paragraphs)],
    }


def replaced(doc: Document, text: str) -> Document:
    return Document(doc.source, doc.doc_id, text, dict(doc.meta))


def corrupt(corpora: dict[str, list[Document]]) -> dict[str, list[Document]]:
    """Three faults, one per source: every 20th Shakespeare paragraph escaped twice on export (literal \\n and
    \\" where newlines and quotes were, the OPT-175B bug), a licence sentence appended to 30% of the wikitext
    articles and a boilerplate line added to 30% of the Chinese poems."""
    return {
        "shakespeare": [
            replaced(d, json.dumps(d.text, ensure_ascii=False)[1:-1]) if i % 20 == 0 else d
            for i, d in enumerate(corpora["shakespeare"])
        ],
        "wikitext": [
            replaced(d, d.text + " " + LICENCE + " .") if i % 10 < 3 else d for i, d in enumerate(corpora["wikitext"])
        ],
        "zh-classics": [
            replaced(d, d.text + "\n" + BOILERPLATE) if i % 10 < 3 else d for i, d in enumerate(corpora["zh-classics"])
        ],
    }


@pytest.fixture(scope="module")
def corpora() -> dict[str, list[Document]]:
    return load_corpora()


@pytest.fixture(scope="module")
def clean(corpora, tmp_path_factory) -> InspectionReport:
    return inspect_sources(corpora, tmp_path_factory.mktemp("clean"))


@pytest.fixture(scope="module")
def corrupted(corpora, clean, tmp_path_factory) -> InspectionReport:
    return inspect_sources(corrupt(corpora), tmp_path_factory.mktemp("corrupted"), baseline=clean.paths["json"])


def test_clean_corpora_flag_only_the_wikitext_artefacts(clean):
    """Shakespeare and the Chinese classics raise no flag at all. Wikitext raises exactly two, on purpose:
    its preprocessing replaced rare words with '<unk>' (2% of all characters are its angle brackets) and
    split hyphens and numbers into ' @-@ ', ' @,@ ', ' @.@ '. A model trained on it learns to write both;
    a report that called this corpus clean would be wrong."""
    assert {(f.source, f.kind, f.statistic) for f in clean.flags} == {
        ("wikitext", "char_class", "markup share"),
        ("wikitext", "char_class", "rare_symbols share"),
    }
    markup, symbols = sorted(clean.flags, key=lambda f: f.statistic)
    assert "'<unk>' x26936" in markup.message and markup.value > markup.expected[1]
    assert "'@' x11070" in symbols.message and "@-@" in symbols.example
    shares = clean.data["sources"]["shakespeare"]["char_classes"]
    assert shares["backslash"]["count"] == 0 and shares["uppercase"]["share"] > 0.05  # speaker names, not flagged


def test_each_injected_fault_is_flagged_on_its_source_and_nothing_else(corrupted):
    flags = {(f.source, f.kind, f.statistic) for f in corrupted.flags}
    assert flags == {
        ("wikitext", "char_class", "markup share"),
        ("wikitext", "char_class", "rare_symbols share"),
        ("shakespeare", "char_class", "backslash share"),
        ("wikitext", "repeated_ngram", "documents with 13-gram"),
        ("zh-classics", "boilerplate_line", "documents with line"),
        ("shakespeare", "baseline_shift", "backslash share"),
    }


def test_stray_backslashes_are_flagged_with_their_escape_sequences(corrupted):
    (flag,) = [f for f in corrupted.flags if f.kind == "char_class" and f.statistic == "backslash share"]
    assert flag.source == "shakespeare"
    assert flag.value > 10 * Thresholds().usual("backslash") and flag.value > flag.expected[1]
    assert "most frequent: '\\n' x" in flag.message  # the two characters backslash and n, as written
    assert int(flag.example.split(":")[0].removeprefix("paragraph-")) % 20 == 0  # the example is a corrupted one
    assert "\\n" in flag.example and "\\\\" not in flag.example  # shown with single backslashes, not repr'd


def test_boilerplate_line_and_repeated_ngram_name_the_text(corrupted):
    by_kind = {f.kind: f for f in corrupted.flags}
    line = by_kind["boilerplate_line"]
    assert line.example == BOILERPLATE and line.value == pytest.approx(0.3, abs=0.01)
    ngram = by_kind["repeated_ngram"]
    assert ngram.source == "wikitext" and ngram.example in LICENCE.lower()
    assert ngram.value == pytest.approx(0.3, abs=0.02) and ngram.expected == (0.0, Thresholds().boilerplate_doc_share)


def test_baseline_shift_names_old_and_new_values(corrupted, clean):
    (shift,) = [f for f in corrupted.flags if f.kind == "baseline_shift"]
    old = clean.data["sources"]["shakespeare"]["char_classes"]["backslash"]["share"]
    assert old == 0 and shift.value > 0 and not shift.expected[0] <= shift.value <= shift.expected[1]
    assert f"from 0% to {shift.value * 100:.3g}%" in shift.message


def test_reports_are_self_contained_and_lead_with_the_flags(corrupted):
    paths = corrupted.paths
    html = paths["html"].read_text(encoding="utf-8")
    markdown = paths["markdown"].read_text(encoding="utf-8")
    assert html.count("data:image/png;base64,") == 1 + 3  # class shares, and lengths per source
    assert not re.search(r"(src|href)=['\"]?(https?:|//|file:)", html)
    assert html.index("Flags (6)") < html.index("<h2>shakespeare</h2>")
    assert markdown.startswith("# Data inspection\n\n## Flags (6)")
    for flag in corrupted.flags:
        assert flag.statistic in html[: html.index("<h2>Sources")]
        assert f"| {flag.source} | {flag.statistic} |" in markdown.split("## Sources")[0]
    data = json.loads(paths["json"].read_text(encoding="utf-8"))
    assert data["flags"] == json.loads(json.dumps([asdict(f) for f in corrupted.flags]))
    assert data["sources"]["zh-classics"]["documents"] == 5406


def test_math_answers_stand_out_against_prose(corpora, tmp_path):
    """GSM8K answers next to prose: their 16% digits are within what a table-heavy text may hold (30%) but
    far above every other source, so the comparison with the other sources flags them; the calculator
    annotations '<<48/2=24>>' count as markup and the '#### 18' answer markers as rare symbols. The
    questions, ordinary prose with a few numbers, raise nothing."""
    gsm8k = SHARED_DATA / "eval" / "gsm8k-test.jsonl"
    if not gsm8k.is_file():
        pytest.skip(f"shared data not found at {gsm8k}")
    sources = {
        "shakespeare": corpora["shakespeare"],
        "zh-classics": corpora["zh-classics"],
        "gsm8k-answers": list(read_documents([str(gsm8k)], text_field="answer")),
        "gsm8k-questions": list(read_documents([str(gsm8k)], text_field="question")),
    }
    report = inspect_sources(sources, tmp_path)
    assert {(f.source, f.kind, f.statistic) for f in report.flags} == {
        ("gsm8k-answers", "char_class", "markup share"),
        ("gsm8k-answers", "char_class", "rare_symbols share"),
        ("gsm8k-answers", "char_class_vs_sources", "digits share"),
    }
    digits = next(f for f in report.flags if f.statistic == "digits share")
    assert Thresholds().usual("digits") < digits.value < Thresholds().class_limit("digits")
    markup = next(f for f in report.flags if f.statistic == "markup share")
    assert "'<' x" in markup.message and "<<" in markup.example


def test_a_short_line_repeated_everywhere_is_flagged_by_its_share_of_lines(corpora, tmp_path):
    """'广告' ("advertisement") after every line of 30% of the poems: too short for the boilerplate rule
    (headings and speaker names repeat legitimately), but one line in six of the whole source."""
    docs = [
        replaced(d, d.text.replace("\n", "\n广告\n") + "\n广告") if i % 10 < 3 else d
        for i, d in enumerate(corpora["zh-classics"])
    ]
    report = inspect_sources({"zh-classics": docs}, tmp_path)
    (flag,) = report.flags
    assert (flag.kind, flag.example) == ("repeated_line", "广告")
    assert 0.1 < flag.value < 0.25 and flag.expected == (0.0, Thresholds().line_share)


def test_wrong_codec_shows_up_as_mojibake(corpora, tmp_path):
    """Every 20th poem read as cp1252 instead of UTF-8: its full-width quotes become 'â€œ' and bytes cp1252
    leaves undefined become U+FFFD."""
    docs = [
        replaced(d, d.text.encode("utf-8").decode("cp1252", errors="replace")) if i % 20 == 0 else d
        for i, d in enumerate(corpora["zh-classics"])
    ]
    report = inspect_sources({"zh-classics": docs}, tmp_path)
    assert {f.statistic for f in report.flags if f.kind in CLASS_KINDS} == {"mojibake share", "replacement share"}


def test_a_few_backslashes_are_not_a_flood(corpora, tmp_path):
    """One paragraph quoting a LaTeX formula stays below the floor: code and formulas exist in real text."""
    docs = list(corpora["shakespeare"])
    docs[7] = replaced(docs[7], docs[7].text + " $\\alpha + \\beta = \\gamma$")
    report = inspect_sources({"shakespeare": docs}, tmp_path)
    assert report.data["sources"]["shakespeare"]["char_classes"]["backslash"]["count"] == 3
    assert report.flags == []


def test_fragments_empty_and_duplicated_documents(corpora, tmp_path):
    """Speaker names alone as documents (what a bad paragraph splitter yields), plus a few empty ones."""
    names = [Document("names", f"n{i}", d.text.splitlines()[0]) for i, d in enumerate(corpora["shakespeare"])]
    names += [Document("names", f"e{i}", " \n") for i in range(200)]
    report = inspect_sources({"names": names}, tmp_path)
    kinds = {f.kind: f for f in report.flags}
    assert {"short_documents", "empty_documents", "duplicates"} <= set(kinds)
    assert kinds["short_documents"].value > 0.99  # a handful of paragraphs open with a line of verse
    assert kinds["empty_documents"].value == pytest.approx(200 / len(names), rel=1e-4)
    assert kinds["duplicates"].value > 0.9  # a thousand-odd speakers over seven thousand speeches


def test_sampling_is_deterministic_and_seeded(corpora, tmp_path):
    docs = corpora["zh-classics"]
    first = inspect_sources({"zh": docs}, tmp_path / "a", max_docs_per_source=800, seed=1)
    again = inspect_sources({"zh": iter(docs)}, tmp_path / "b", max_docs_per_source=800, seed=1)
    other = inspect_sources({"zh": docs}, tmp_path / "c", max_docs_per_source=800, seed=2)
    assert first.data["sources"]["zh"]["documents"] == len(docs)
    assert first.data["sources"]["zh"]["sampled"] == 800
    for kind in ("json", "markdown", "html"):
        assert first.paths[kind].read_bytes() == again.paths[kind].read_bytes()
    assert first.data["sources"]["zh"]["lengths"] != other.data["sources"]["zh"]["lengths"]


def test_token_lengths_step_and_dedup_tables(corpora, tmp_path):
    docs = [
        Document(d.source, d.doc_id, d.text, {"language": "zh"} if i % 10 else {})
        for i, d in enumerate(corpora["zh-classics"][:1000])
    ]
    step = StepStats("gopher_quality", 1200, 1000)
    step.dropped.update({"fewer than 50 words": 150, "symbol-to-word ratio": 50})
    dedup = {"documents": 1000, "exact_duplicates": 3, "near_duplicates": 12, "clusters": 9}
    report = inspect_sources(
        {"zh": docs}, tmp_path, tokenizer=ByteTokenizer(), step_stats=[step.to_dict()], dedup_stats=dedup
    )
    tokens = report.data["sources"]["zh"]["lengths"]["tokens"]
    assert tokens["p50"] == np.percentile([len(d.text.encode("utf-8")) for d in docs], 50)
    markdown = report.paths["markdown"].read_text(encoding="utf-8")
    assert "## Pipeline steps\n\n### Step gopher_quality: 1200 in, 1000 out" in markdown
    assert "| fewer than 50 words | 150 | 12.5% |" in markdown
    assert "| near_duplicates | 12 |" in markdown
    assert "| zh | 90% |\n| unknown | 10% |" in markdown
    html = report.paths["html"].read_text(encoding="utf-8")
    assert "symbol-to-word ratio" in html and "tokens per document" not in html  # plots are images, not text


def test_user_mistakes_are_one_line_errors(tmp_path):
    docs = {"s": [Document("s", "1", "Some text to look at.")]}
    with pytest.raises(DataError, match="no sources"):
        inspect_sources({}, tmp_path)
    with pytest.raises(DataError, match="baseline report not found"):
        inspect_sources(docs, tmp_path, baseline=tmp_path / "missing.json")
    (tmp_path / "other.json").write_text('{"loss": 1.0}')
    with pytest.raises(DataError, match="not a report.json"):
        inspect_sources(docs, tmp_path, baseline=tmp_path / "other.json")
    with pytest.raises(DataError, match="step statistics"):
        inspect_sources(docs, tmp_path, step_stats=[{"name": "x"}])
    with pytest.raises(DataError, match="expected documents"):
        inspect_sources({"s": ["plain string"]}, tmp_path)
    with pytest.raises(ConfigError, match="max_docs_per_source"):
        inspect_sources(docs, tmp_path, max_docs_per_source=0)
    with pytest.raises(ConfigError, match="no character class 'html'"):
        Thresholds(reference={"html": 0.1})
    (tmp_path / "file").write_text("")
    with pytest.raises(DataError, match="not a directory"):
        inspect_sources(docs, tmp_path / "file")


def test_control_characters_and_lone_surrogates_are_reported(tmp_path):
    """A text from JSON may hold a lone surrogate, which UTF-8 cannot encode: it is counted as a control
    character and written escaped, so report.json still loads."""
    docs = [Document("s", str(i), f"Line {i} of a log\x00with NUL bytes\udc80 and a BOM\ufeff.") for i in range(20)]
    report = inspect_sources({"s": docs}, tmp_path, tokenizer=ByteTokenizer())
    assert report.data["sources"]["s"]["lengths"]["tokens"]["min"] == len(docs[0].text) + 2 + 2  # U+FFFD, U+FEFF
    (flag,) = [f for f in report.flags if f.kind == "char_class"]
    assert flag.statistic == "control share" and report.data["sources"]["s"]["char_classes"]["control"]["count"] == 60
    data = json.loads(report.paths["json"].read_text(encoding="utf-8"))
    assert "\udc80" in data["sources"]["s"]["char_classes"]["control"]["example"]["snippet"]


def test_malformed_records_are_counted_and_reported(tmp_path):
    """`liandan data inspect` reads with the pipeline's readers; what they cannot read is named in the output
    and the report, not silently left out of the statistics."""
    good = [json.dumps({"text": f"Document number {i} says something plain."}) for i in range(12)]
    path = tmp_path / "mixed.jsonl"
    path.write_bytes(
        ("\n".join(good[:6]) + "\n{not json\n" + json.dumps({"body": "no text"}) + "\n").encode()
        + b'{"text": "bad \xff byte"}\n'
        + ("\n".join(good[6:]) + "\n").encode()
    )
    (tmp_path / "t.toml").write_text("")
    refused = liandan_here("data", "inspect", path, "--out", tmp_path / "t.toml" / "report")
    assert refused.returncode == 2 and refused.stdout == "", refused.stdout  # refused before any source is read
    assert f"cannot write {tmp_path}/t.toml/report: {tmp_path}/t.toml is not a directory" in refused.stderr
    done = liandan_here("data", "inspect", path, "--out", tmp_path / "report")
    assert done.returncode == 0, done.stderr
    assert "mixed: 3 record(s) skipped" in done.stdout
    assert "1 malformed JSON" in done.stdout and "1 invalid UTF-8" in done.stdout and "no string field" in done.stdout
    data = json.loads((tmp_path / "report" / "report.json").read_text(encoding="utf-8"))
    source = data["sources"]["mixed"]
    assert source["documents"] == 12 and sum(source["records_skipped"].values()) == 3
    assert "could not be read" in (tmp_path / "report" / "report.md").read_text(encoding="utf-8")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no plotting library's warning about a chart with nothing in it
        done = liandan_here("data", "inspect", empty, "--out", tmp_path / "empty-report")
    assert done.returncode == 0 and "empty: 1 record(s) skipped: 1 empty file" in done.stdout, done.stderr
