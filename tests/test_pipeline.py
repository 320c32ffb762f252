"""The data pipeline end to end: stages, rejects, dedup, stores, resume after a real kill, local vs Ray."""

from __future__ import annotations

import gzip
import json
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import liandan_here, run_liandan
from liandan.config import ConfigError
from liandan.data.documents.corpus import DataError
from liandan.data.pipeline.pipeline import read_jsonl_zst, run_pipeline
from liandan.data.pipeline.pipeline_config import InputSpec, PipelineConfig, PipelineSection, load_pipeline

PLANTED_COPIES = 6  # exact copies planted in the English input
PLANTED_NEAR = 4  # near copies (a few words changed)
MALFORMED = 3


def _topics() -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(name, topics[name]) for name in sorted(topics) if len(topics[name].split()) > 80]


def write_inputs(root: Path) -> Path:
    """English topics (with planted exact and near duplicates and malformed records) as jsonl, and a second
    source as gzipped paragraphs of text; returns the pipeline TOML."""
    topics = _topics()[:45]
    lines = [json.dumps({"id": name, "text": text}) for name, text in topics]
    for i in range(PLANTED_COPIES):
        name, text = topics[i]
        lines.append(json.dumps({"id": f"copy-{name}", "text": text}))
    for i in range(PLANTED_NEAR):
        name, text = topics[10 + i]
        words = text.split()
        words[len(words) // 2] = "changed"
        lines.append(json.dumps({"id": f"near-{name}", "text": " ".join(words)}))
    lines += ["{not json", json.dumps({"id": "x", "body": "no text field"}), json.dumps({"id": "y", "text": "  "})]
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    paragraphs = [re.sub(r"\n\s*\n", "\n", text) for _, text in _topics()[45:]]
    with gzip.open(root / "more.txt.gz", "wt") as handle:
        handle.write("\n\n".join(paragraphs))
    toml = root / "pipeline.toml"
    toml.write_text(
        """
[pipeline]
output = "out"
workers = 2

[[inputs]]
name = "docs"
paths = ["docs.jsonl"]

[[inputs]]
name = "more"
paths = ["more.txt.gz"]
txt_mode = "paragraph"

[[steps]]
name = "normalize"

[[steps]]
name = "gopher_repetition"

[dedup]
threshold = 0.8

[tokenizer]
vocab_size = 600
special_tokens = ["<|user|>", "<|assistant|>"]
"""
    )
    return toml


def store_bytes(out: Path) -> dict[str, bytes]:
    """Every output file's bytes, but for the two that name input paths (which differ between test folders)."""
    return {
        str(p.relative_to(out)): p.read_bytes()
        for sub in ("stores", "clean", "dedup", "tokenizer")
        for p in sorted((out / sub).rglob("*"))
        if p.is_file() and not p.name.endswith((".stats.json", ".rejects.jsonl.zst"))
    }


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> tuple[Path, dict]:
    root = tmp_path_factory.mktemp("pipeline")
    cfg = load_pipeline(write_inputs(root))
    result = run_pipeline(cfg, say=lambda m: None)
    return root / "out", result.summary


def test_every_stage_leaves_its_output(finished):
    out, summary = finished
    assert (out / "pipeline.toml").is_file()
    assert set(summary["stores"]) == {"docs", "more"}
    for name in ("docs", "more"):
        assert (out / "stores" / name / "manifest.json").is_file()
    assert (out / "report" / "report.html").is_file()
    from liandan.data.tokens.tokenizer import HFTokenizer

    tokenizer = HFTokenizer.load(out / "tokenizer" / "tokenizer.json")
    assert tokenizer.vocab_size == 600
    ids = tokenizer.encode_batch(["<|user|>hi<|assistant|>"])[0]
    assert ids[0] == tokenizer._tok.token_to_id("<|user|>") and tokenizer._tok.token_to_id("<|assistant|>") in ids
    assert json.loads((out / "summary.json").read_text()) == summary


def test_malformed_records_are_rejected_with_reasons_not_lost(finished):
    out, summary = finished
    assert sum(summary["read"]["skipped"].values()) == MALFORMED
    rejects = [r for f in sorted((out / "clean").glob("*.rejects.jsonl.zst")) for r in read_jsonl_zst(f)]
    read_rejects = [r for r in rejects if r["step"] == "read"]
    assert len(read_rejects) == MALFORMED
    assert all(r["reason"] for r in read_rejects)
    # every document read is accounted for: kept by the steps or written to a rejects file with its step
    first, last = summary["steps"][0], summary["steps"][-1]
    assert first["documents_in"] == summary["read"]["documents"]
    dropped = sum(sum(s["dropped"].values()) for s in summary["steps"])
    assert first["documents_in"] - last["documents_out"] == dropped == len(rejects) - len(read_rejects)


def test_planted_duplicates_are_removed_and_nothing_else(finished):
    from liandan.data.dedup.dedup import MinHasher, NearDedupParams

    out, summary = finished
    docs = list(read_jsonl_zst(out / "clean" / "00000-docs.jsonl.zst")) + list(
        read_jsonl_zst(out / "clean" / "00001-more.jsonl.zst")
    )
    remove = np.concatenate([np.load(out / "dedup" / f"0000{i}.remove.npy") for i in (0, 1)])
    cluster = np.concatenate([np.load(out / "dedup" / f"0000{i}.cluster.npy") for i in (0, 1)])
    assert len(remove) == len(docs) == len(cluster)
    planted = {i for i, d in enumerate(docs) if d["id"].startswith(("copy-", "near-"))}
    assert len(planted) >= PLANTED_COPIES + PLANTED_NEAR - 2  # a planted copy goes only if its original was filtered
    removed = set(np.flatnonzero(remove).tolist())
    assert planted <= removed
    # anything else removed really is a near duplicate of the document its cluster keeps (pydoc topics repeat
    # each other in places), judged by exact Jaccard of the shingle sets
    hasher = MinHasher(NearDedupParams())
    for i in removed - planted:
        keeper = min(np.flatnonzero(cluster == cluster[i]))
        a, b = hasher.shingles(docs[i]["text"]), hasher.shingles(docs[keeper]["text"])
        assert len(np.intersect1d(a, b)) / len(np.union1d(a, b)) > 0.6, docs[i]["id"]
    assert summary["dedup"]["removed"] == len(removed)
    kept_docs = sum(1 for i, d in enumerate(docs) if d["source"] == "docs" and i not in removed)
    assert summary["stores"]["docs"]["documents"] == kept_docs


def test_stores_feed_the_training_loader(finished):
    from liandan.data.tokens.store import TokenStore

    out, summary = finished
    store = TokenStore(out / "stores" / "docs", expect_tokenizer=summary["tokenizer"]["fingerprint"])
    assert store.num_documents == summary["stores"]["docs"]["documents"]
    assert store.num_tokens == summary["stores"]["docs"]["tokens"] > 10_000
    with pytest.raises(DataError):
        TokenStore(out / "stores" / "docs", expect_tokenizer="another-tokenizer")


@pytest.mark.slow
@pytest.mark.parametrize(
    "fault, done_before",
    [
        ("clean-midway:1", [("clean", 0)]),  # task 1 killed with its files half written
        ("dedup:0", [("clean", 0), ("clean", 1)]),  # a whole stage's outputs written, its marker not yet
        ("tokenize:1", [("clean", 0), ("clean", 1), ("dedup", None), ("tokenizer", None), ("tokenize", 0)]),
    ],
)
def test_resume_after_a_real_kill_redoes_nothing_finished(finished, tmp_path, fault, done_before):
    from liandan.data.pipeline.layout import PipelineLayout
    from liandan.data.pipeline.pipeline import pipeline_stages, plan_tasks
    from liandan.data.pipeline.stages import StageContext

    reference, _ = finished
    toml = write_inputs(tmp_path)
    out = tmp_path / "out"
    command = ["data", "run", toml, "--workers=1", "--pipeline.inspect=false"]
    first = run_liandan(*command, env={**os.environ, "LIANDAN_FAULTS": f"kill@{fault}"}, timeout=300)
    assert first.returncode == -9, first.stderr[-2000:]
    cfg = load_pipeline(toml)
    ctx = StageContext(cfg, PipelineLayout(out), plan_tasks(cfg))
    stages = {s.name: s for s in pipeline_stages(cfg)}
    markers = [p.name for p in (out / "state").glob("*.json")]
    units = [(stages[name], None if index is None else ctx.tasks[index]) for name, index in done_before]
    assert sorted(markers) == sorted(ctx.layout.done(s.name, t).name for s, t in units)
    kept = [ctx.layout.done(s.name, t) for s, t in units] + [p for s, t in units for p in s.outputs(ctx, t)]
    kept_times = {p: p.stat().st_mtime_ns for p in kept if p.is_file()}
    if fault.startswith("clean-midway"):
        assert (out / "clean" / ".00001-more.jsonl.zst.tmp").is_file()  # killed while writing
    second = run_liandan(*command, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert {p: p.stat().st_mtime_ns for p in kept_times} == kept_times
    assert not [p for p in out.rglob("*.tmp")]
    assert store_bytes(out) == store_bytes(reference)


@pytest.mark.slow
def test_ray_executor_writes_the_same_bytes(finished, tmp_path):
    pytest.importorskip("ray", reason="the ray executor needs ray installed")
    reference, _ = finished
    toml = write_inputs(tmp_path)
    # its own process: a Ray driver keeps threads and memory that would disturb later tests in this one
    done = run_liandan("data", "run", toml, "--executor=ray", "--pipeline.inspect=false", timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "(ray)" in done.stdout
    assert store_bytes(tmp_path / "out") == store_bytes(reference)


def test_another_config_does_not_resume_into_old_output(finished, tmp_path):
    toml = write_inputs(tmp_path)
    cfg = load_pipeline(toml, ["--pipeline.inspect=false", "--dedup.near=false", "--tokenizer.kind=byte"])
    run_pipeline(cfg, say=lambda m: None)
    with pytest.raises(DataError, match="another pipeline config.*dedup"):
        run_pipeline(load_pipeline(toml, ["--pipeline.inspect=false", "--tokenizer.kind=byte"]), say=lambda m: None)
    # changing only where the work runs is fine
    run_pipeline(
        load_pipeline(
            toml, ["--pipeline.inspect=false", "--dedup.near=false", "--tokenizer.kind=byte", "--pipeline.workers=1"]
        ),
        say=lambda m: None,
    )


def test_pipeline_built_in_python(tmp_path):
    from liandan.data.steps.normalize import Normalize

    (tmp_path / "a.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for _, t in _topics()[:20]))
    cfg = PipelineConfig(
        pipeline=PipelineSection(output=str(tmp_path / "out"), workers=1, inspect=False),
        inputs=[InputSpec(name="a", paths=[str(tmp_path / "a.jsonl")])],
        steps=[Normalize()],
    )
    cfg.tokenizer.kind = "byte"
    cfg.check()
    summary = run_pipeline(cfg, say=lambda m: None).summary
    assert summary["stores"]["a"]["documents"] == 20
    assert summary["steps"][0]["name"] == "normalize"


@pytest.mark.parametrize(
    "body, message",
    [
        ('[[inputs]]\nname = "a"\npaths = ["missing.jsonl"]\n', "data file not found"),
        (
            '[[inputs]]\nname = "a"\npaths = ["x.jsonl"]\n[[steps]]\nname = "no_such_step"\n',
            "steps.name = 'no_such_step' is not a known data step; known: normalize, ",
        ),
        (
            '[[inputs]]\nname = "a"\npaths = ["x.jsonl"]\n[[steps]]\nname = "normalize"\nbogus = 1\n',
            "step 'normalize' has no option 'bogus'",
        ),
        ('[[inputs]]\nname = "a"\npaths = ["x.jsonl"]\n[dedup]\nthreshold = 2\n', "dedup.threshold = 2"),
        ("[pipeline]\nworkers = 1\n", "no \\[\\[inputs\\]\\]"),
    ],
)
def test_bad_pipeline_files_end_in_one_line(tmp_path, body, message):
    import re

    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    toml = tmp_path / "p.toml"
    toml.write_text(body)
    run = run_liandan("data", "run", toml, timeout=120)
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and re.search(message, lines[0]), run.stderr
    assert "Traceback" not in run.stderr


def test_config_errors_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="only \\[pipeline\\]"):
        load_pipeline(None, ["--model.dim=3"])


def test_step_options_of_a_wrong_type_end_in_one_line_naming_step_and_option(tmp_path):
    (tmp_path / "x.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    head = '[[inputs]]\nname = "a"\npaths = ["x.jsonl"]\n'
    for body, message in [
        ('[[steps]]\nname = "normalize"\nhtml = "false"\n', "step 'normalize': html = 'false' must be true or false"),
        ('[[steps]]\nname = "language"\nlanguages = "en"\n', "step 'language': languages = 'en' must be a list of"),
        ('[[steps]]\nname = "language"\nmin_score = 7\n', "step 'language': min_score = 7 is too large"),
        ('languages = ["english"]\n', "input 'a': inputs.languages = ['english']: 'english' is not a language code"),
    ]:
        toml = tmp_path / "p.toml"
        toml.write_text(head + body)
        done = liandan_here("data", "run", toml)
        assert done.returncode == 2 and done.stderr.strip().startswith("liandan: error: " + message), done.stderr
        assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "data").exists()


def test_a_run_that_keeps_nothing_names_the_reasons_and_the_rejects(tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    records = [{"id": f"b{i}", "body": "no text field"} for i in range(3)]
    records += [{"id": f"s{i}", "text": "Too short to keep."} for i in range(2)]
    (tmp_path / "docs.jsonl").write_bytes(
        "".join(json.dumps(r) + "\n" for r in records).encode() + b'{"id": "u", "text": "bad \xff"}\n'
    )
    toml = tmp_path / "p.toml"
    toml.write_text(
        '[pipeline]\noutput = "out"\nworkers = 1\ninspect = false\n[tokenizer]\nkind = "byte"\n'
        '[[inputs]]\nname = "a"\npaths = ["empty.jsonl", "docs.jsonl"]\n[[steps]]\nname = "gopher_quality"\n'
    )
    done = liandan_here("data", "run", toml)
    assert done.returncode == 2 and len(done.stderr.strip().splitlines()) == 1, done.stderr
    rejects = tmp_path / "out" / "clean" / "*.rejects.jsonl.zst"
    assert done.stderr.strip() == (
        "liandan: error: no document survived cleaning and deduplication (dropped: 3 no string field 'text', 2"
        " gopher_quality:too_few_words, 1 empty file and 1 more (1 other reason)); every dropped record is in"
        f" {rejects}"
    )
    reasons = [r["reason"] for path in sorted(rejects.parent.glob(rejects.name)) for r in read_jsonl_zst(path)]
    assert sorted(reasons).count("invalid UTF-8") == 1 and len(reasons) == 7


def test_a_second_run_into_the_same_output_is_refused_in_one_line(tmp_path):
    """The first `data run` hangs after writing its first cleaned shard, holding the output; a second one
    into the same output is refused, naming the first, and runs once the first is gone."""
    from helpers import start_liandan

    toml = write_inputs(tmp_path)
    command = ["data", "run", toml, "--workers=1", "--pipeline.inspect=false", "--tokenizer.kind=byte"]
    first = start_liandan(*command, env={**os.environ, "LIANDAN_FAULTS": "hang@clean:0"}, quiet=True)
    try:
        shard = tmp_path / "out" / "clean" / "00000-docs.jsonl.zst"
        deadline = time.monotonic() + 120
        while not shard.is_file() and first.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)  # polling the first run's progress, not waiting for a guess
        assert shard.is_file() and first.poll() is None
        second = run_liandan(*command, timeout=120)
        assert second.returncode == 2 and second.stderr.count("\n") == 1, second.stderr
        assert second.stderr.startswith(f"liandan: error: {tmp_path / 'out'} is in use by another liandan data run"
                                        f" (pid {first.pid} on "), second.stderr  # fmt: skip
        assert second.stderr.rstrip().endswith("or choose another pipeline.output")
    finally:
        first.kill()
        first.wait()
    third = run_liandan(*command, timeout=300)
    assert third.returncode == 0, third.stderr[-2000:]


def test_the_summary_keeps_long_paths_whole_when_not_a_terminal(finished, capsys):
    from liandan.cli.data_cmd import print_summary

    _, summary = finished
    deep = {name: {**store, "path": f"{store['path']}/{'a-long-directory-name/' * 6}{name}"}
            for name, store in summary["stores"].items()}  # fmt: skip
    print_summary({**summary, "stores": deep})
    lines = capsys.readouterr().out.splitlines()
    for name, store in deep.items():
        assert any(line.startswith(f"store {name}: ") and line.endswith(f"-> {store['path']}") for line in lines)
    [hint] = [line for line in lines if line.startswith("train on it: ")]
    assert hint.endswith("]'")


def test_the_summary_tells_drops_per_source_and_a_hint_that_works_from_anywhere(finished, tmp_path, monkeypatch,
                                                                                  capsys):  # fmt: skip
    from liandan.cli.data_cmd import print_summary

    out, summary = finished
    by_source = {row["source"]: row for row in summary["drops_by_source"]}
    assert set(by_source) == {"docs", "more"}
    steps = {s["name"]: s for s in summary["steps"]}
    for step, stats in steps.items():  # the per-source rows add up to the totals
        for reason, count in stats["dropped"].items():
            assert sum(row["dropped"].get(f"{step}: {reason}", 0) for row in by_source.values()) == count
    assert [row["path"].rsplit("/", 1)[-1] for row in summary["drops_by_file"]] == ["docs.jsonl", "more.txt.gz"]
    assert sorted(p.name for p in (out / "clean").glob("*.jsonl.zst") if ".rejects" not in p.name) == [
        "00000-docs.jsonl.zst", "00001-more.jsonl.zst"]  # fmt: skip

    monkeypatch.chdir(tmp_path)  # a store path relative to where `data run` ran is no use from elsewhere
    relative = {name: {**store, "path": f"out/stores/{name}"} for name, store in summary["stores"].items()}
    print_summary({**summary, "stores": relative})
    printed = capsys.readouterr().out
    assert "dropped per source" in printed and "dropped per input file" not in printed  # one file per source
    [hint] = [line for line in printed.splitlines() if line.startswith("train on it: ")]
    stores = json.loads(hint.split("--data.stores='", 1)[1].rstrip("'"))
    assert stores == [str(tmp_path / "out" / "stores" / name) for name in relative]


def test_a_directory_stands_for_its_data_files_in_every_command(tmp_path):
    """`[[inputs]] paths`, `[data] paths` and `liandan data inspect` take a directory as `liandan demo --data`
    does: the .txt/.jsonl/.parquet files directly in it, sorted by name (nothing below it, nothing else)."""
    from liandan.data.pipeline.pipeline_config import expand_paths

    docs = tmp_path / "docs"
    (docs / "nested").mkdir(parents=True)
    topics = _topics()
    (docs / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for _, t in topics[:5]))
    (docs / "a.txt").write_text(topics[5][1])
    (docs / "notes.csv").write_text("not, data\n")
    (docs / "nested" / "c.txt").write_text(topics[6][1])
    assert expand_paths(InputSpec(name="a", paths=[str(docs)])) == [docs / "a.txt", docs / "b.jsonl"]
    cfg = PipelineConfig(pipeline=PipelineSection(output=str(tmp_path / "out"), workers=1, inspect=False),
                         inputs=[InputSpec(name="a", paths=[str(docs)])])  # fmt: skip
    cfg.tokenizer.kind = "byte"
    cfg.check()
    assert run_pipeline(cfg, say=lambda m: None).summary["stores"]["a"]["documents"] == 6
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match=f"input 'a': {tmp_path / 'empty'}: the directory holds no .txt, .jsonl"):
        expand_paths(InputSpec(name="a", paths=[str(tmp_path / "empty")]))
    inspected = liandan_here("data", "inspect", docs, "--out", tmp_path / "report")
    assert inspected.returncode == 0, inspected.stderr[-2000:]
