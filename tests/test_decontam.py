"""Decontamination against the real GSM8K test set: planted questions are caught, clean text is kept."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from helpers import SHARED_DATA
from liandan.config import ConfigError
from liandan.data.documents.corpus import DataError, Document
from liandan.data.steps.base import build_step
from liandan.data.steps.decontam import Decontaminate

GSM8K = SHARED_DATA / "eval" / "gsm8k-test.jsonl"
CORPUS = SHARED_DATA / "corpus"


@pytest.fixture(scope="module")
def gsm8k() -> list[dict[str, str]]:
    if not GSM8K.is_file() or not (CORPUS / "en-wikitext2.jsonl").is_file():
        pytest.skip(f"shared data not found at {SHARED_DATA}")
    with GSM8K.open() as handle:
        return [json.loads(line) for line in handle]


@pytest.fixture(scope="module")
def step(gsm8k) -> Decontaminate:
    return Decontaminate(eval_files=[str(GSM8K)])


def _read(name: str) -> list[dict]:
    with (CORPUS / name).open() as handle:
        return [json.loads(line) for line in handle]


def _shared_corpus() -> list[Document]:
    docs = [Document("wiki", r["id"], r["text"]) for r in _read("en-wikitext2.jsonl")]
    docs += [Document("zh", r["id"], r["text"]) for r in _read("zh-classics.jsonl")]
    plays = (CORPUS / "en-shakespeare.txt").read_text().split("\n\n")
    return docs + [Document("shakespeare", str(i), t) for i, t in enumerate(plays)]


def _planted(host: str, item: str) -> str:
    middle = host.find(" ", len(host) // 2)
    return host[:middle] + " " + item + " " + host[middle:]


def _fresh(step: Decontaminate) -> Decontaminate:
    step.stats.dropped.clear()
    step.stats.changed.clear()
    step.stats.documents_in = step.stats.documents_out = 0
    return step


def test_planted_gsm8k_questions_are_dropped_and_clean_text_is_kept(step, gsm8k):
    step = _fresh(step)
    clean = _shared_corpus()
    wiki = [d for d in clean if d.source == "wiki"]
    rng = random.Random(0)
    lines = rng.sample(range(len(gsm8k)), 40)
    planted = [
        Document("planted", str(line), _planted(rng.choice(wiki).text, gsm8k[line]["question"])) for line in lines
    ]
    # shuffled among the clean documents, whose order and identity must survive
    docs = clean + planted
    rng.shuffle(docs)
    kept = list(step(docs))
    assert [d for d in docs if d.source != "planted"] == kept  # no false positive on any shared corpus
    assert step.stats.dropped == {"decontaminate:gsm8k-test": len(planted)}
    assert step.stats.documents_in == len(docs) and step.stats.documents_out == len(clean)
    # which items were hit: the GSM8K line of each planted question (1-based), and the odd GSM8K question that
    # shares a 13-gram with another one (lines 419 and 559 do)
    hit = set(step.stats.changed)
    assert {f"gsm8k-test:{line + 1}" for line in lines} <= hit and len(hit) <= len(lines) + 3


def test_matching_ignores_case_punctuation_and_spacing(step, gsm8k):
    step = _fresh(step)
    host = _read("en-wikitext2.jsonl")[3]["text"]
    question = gsm8k[100]["question"]
    disguised = question.upper().replace(" ", "  \n").replace(".", ";")
    assert step.check(Document("x", "1", _planted(host, disguised))) == "decontaminate:gsm8k-test"
    # the answer field is eval text too
    answer = gsm8k[200]["answer"]
    assert step.check(Document("x", "2", _planted(host, answer))) == "decontaminate:gsm8k-test"
    # a 12-word run from a question is below the 13-gram window: kept
    fragment = " ".join(question.split()[:12])
    assert step.check(Document("x", "3", _planted(host, fragment))) is None
    assert step.check(Document("x", "4", host)) is None
    assert dict(step.stats.changed) == {"gsm8k-test:101": 1, "gsm8k-test:201": 1}


def test_fields_option_limits_the_eval_text(gsm8k):
    questions_only = Decontaminate(eval_files=[str(GSM8K)], fields=["question"])
    host = "Some unrelated text about lobsters and the sea. " * 5
    answer = gsm8k[5]["answer"]
    assert questions_only.check(Document("x", "1", _planted(host, answer))) is None
    assert questions_only.check(Document("x", "2", _planted(host, gsm8k[5]["question"]))) is not None


def test_short_items_match_as_a_whole_and_very_short_ones_are_ignored(tmp_path):
    items = tmp_path / "capitals.txt"
    items.write_text("Which river flows through the ancient city of Kyoto\n\nyes\n子曰学而时习之不亦说乎\n")
    step = Decontaminate(eval_files=[str(items)])
    host = "A travel guide. " * 10
    assert step.check(Document("x", "1", host + "which river flows through the ancient city of kyoto?")) == (
        "decontaminate:capitals"
    )
    assert step.check(Document("x", "2", host + "which river flows through the ancient city of Osaka")) is None
    assert step.check(Document("x", "3", host + "yes, yes and yes")) is None  # one word: ignored
    assert step.check(Document("x", "4", "论语：子曰：“学而时习之，不亦说乎？”有朋自远方来")) is not None
    assert step.index.items_too_short == 1
    assert dict(step.stats.changed) == {"capitals:1": 1, "capitals:4": 1}


def test_build_from_pipeline_config_and_bad_options(tmp_path, gsm8k):
    built = build_step({"name": "decontaminate", "eval_files": [str(GSM8K)], "ngram": 8})
    assert isinstance(built, Decontaminate) and built.index.ngram == 8
    with pytest.raises(ConfigError, match="no option 'evals'"):
        build_step({"name": "decontaminate", "evals": [str(GSM8K)]})
    with pytest.raises(ConfigError, match="eval_files"):
        build_step({"name": "decontaminate", "eval_files": str(GSM8K)})


@pytest.mark.parametrize(
    "content,suffix,message",
    [
        (None, ".jsonl", "eval file not found"),
        ('{"question": "fine"}\n{broken\n', ".jsonl", r"bad\.jsonl:2: malformed JSON"),
        ("[1, 2]\n", ".jsonl", "expected a JSON object"),
        ('{"id": 3}\n', ".jsonl", "no record has string fields"),
        ("a b\n", ".txt", "no eval item has 8 or more words"),
        ("anything\n", ".csv", "unsupported eval file type"),
    ],
)
def test_unusable_eval_files_are_data_errors(tmp_path: Path, content, suffix, message):
    path = tmp_path / f"bad{suffix}"
    if content is not None:
        path.write_text(content)
    with pytest.raises(DataError, match=message):
        Decontaminate(eval_files=[str(path)])
