"""The pipeline's stage protocol: the stage list, done markers, redoing a stage from a clean state, the plan,
and the one road to a store (a run's `[data] paths` through the same stages)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from helpers import write_corpus
from liandan.cli.main import main
from liandan.config import DataSection
from liandan.data.pipeline.layout import PipelineLayout
from liandan.data.pipeline.pipeline import pipeline_stages, plan_tasks, run_pipeline
from liandan.data.pipeline.pipeline_config import load_pipeline
from liandan.data.pipeline.stages import finished
from liandan.run.files import temporary


def small_pipeline(root: Path, *overrides: str):
    """Two sources of real prose, byte tokens, exact dedup only: every stage but the BPE in about a second."""
    corpus = write_corpus(root, n_docs=24)
    lines = corpus.read_text().splitlines()
    (root / "a.jsonl").write_text("\n".join(lines[:12] + lines[:2]) + "\n")  # two exact copies to remove
    (root / "b.jsonl").write_text("\n".join(lines[12:]) + "\n")
    (root / "pipeline.toml").write_text(
        '[pipeline]\noutput = "out"\nworkers = 1\ninspect = false\n'
        '[[inputs]]\nname = "a"\npaths = ["a.jsonl"]\n[[inputs]]\nname = "b"\npaths = ["b.jsonl"]\n'
        '[[steps]]\nname = "normalize"\n[dedup]\nnear = false\n[tokenizer]\nkind = "byte"\n'
    )
    return load_pipeline(root / "pipeline.toml", list(overrides))


def every_file(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_the_stage_list_follows_the_config(tmp_path):
    cfg = small_pipeline(tmp_path)
    assert [s.name for s in pipeline_stages(cfg)] == ["clean", "dedup", "tokenize", "manifest"]
    cfg = small_pipeline(tmp_path, "--tokenizer.kind=bpe", "--pipeline.inspect=true")
    assert [s.name for s in pipeline_stages(cfg)] == ["clean", "dedup", "tokenizer", "tokenize", "manifest", "inspect"]
    assert [s.per_task for s in pipeline_stages(cfg)] == [True, False, False, True, False, False]


def test_every_stage_and_task_leaves_a_done_marker_holding_its_result(tmp_path):
    cfg = small_pipeline(tmp_path)
    summary = run_pipeline(cfg, say=lambda m: None).summary
    layout, tasks = PipelineLayout(tmp_path / "out"), plan_tasks(cfg)
    assert summary["stages"] == ["clean", "dedup", "tokenize", "manifest"]
    for stage in pipeline_stages(cfg):
        for task in tasks if stage.per_task else [None]:
            assert finished(layout, stage, task) is not None, (stage.name, task)
    clean, dedup, _, manifest = pipeline_stages(cfg)
    assert [finished(layout, clean, t)["documents"] for t in tasks] == [14, 12]
    assert finished(layout, dedup)["removed"] == summary["dedup"]["removed"] == 2
    assert finished(layout, manifest)["stores"] == summary["stores"]
    # a marker names its task: one left by another input file under the same task name does not count
    marker = json.loads(layout.done("clean", tasks[1]).read_text())
    marker["task"]["path"] = str(tmp_path / "other.jsonl")
    layout.done("clean", tasks[1]).write_text(json.dumps(marker))
    assert finished(layout, clean, tasks[1]) is None and finished(layout, clean, tasks[0]) is not None


def test_a_stage_without_its_marker_is_redone_from_a_clean_state_and_so_is_every_later_one(tmp_path):
    cfg = small_pipeline(tmp_path)
    run_pipeline(cfg, say=lambda m: None)
    out = tmp_path / "out"
    layout, tasks = PipelineLayout(out), plan_tasks(cfg)
    reference = every_file(out)
    times = {p: p.stat().st_mtime_ns for p in out.rglob("*") if p.is_file()}
    # dedup half done: its marker gone, one of its outputs garbage, a writer's temporary left behind
    layout.done("dedup").unlink()
    layout.removals(tasks[1]).write_bytes(b"half a file")
    temporary(layout.clusters(tasks[0])).write_bytes(b"left by a killed writer")
    said = []
    run_pipeline(cfg, say=said.append)
    assert every_file(out) == reference
    assert not temporary(layout.clusters(tasks[0])).exists()
    unchanged = {p for p, t in times.items() if p.stat().st_mtime_ns == t}
    assert {layout.kept(t) for t in tasks} | {layout.done("clean", t) for t in tasks} <= unchanged
    redone = [layout.done("dedup"), layout.done("manifest"), *(layout.done("tokenize", t) for t in tasks)]
    assert not unchanged & set(redone)
    assert "stages: clean -> dedup -> tokenize -> manifest" in said


def test_the_dry_run_lists_the_stages_and_what_is_done_without_running_any(tmp_path, capsys):
    cfg = small_pipeline(tmp_path)
    assert main(["data", "run", str(tmp_path / "pipeline.toml"), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert not (tmp_path / "out").exists()
    assert lines[0] == f"2 input file(s) from 2 source(s) -> {tmp_path / 'out'}"
    stages = [line.split()[:2] for line in lines[1:] if line[0].isdigit()]
    assert stages == [["1.", "clean"], ["2.", "dedup"], ["3.", "tokenize"], ["4.", "manifest"]]
    assert "per input file (2 tasks)" in lines[1] and "to run" in lines[1]
    assert lines[2].split() == ["reads", str(tmp_path / "a.jsonl") + ",", str(tmp_path / "b.jsonl")]
    assert lines[3].split()[:3] == ["writes", "clean/00000-a.jsonl.zst,", "clean/00000-a.rejects.jsonl.zst,"]
    run_pipeline(cfg, say=lambda m: None)
    layout = PipelineLayout(tmp_path / "out")
    layout.done("tokenize", plan_tasks(cfg)[1]).unlink()
    assert main(["data", "run", str(tmp_path / "pipeline.toml"), "--dry-run"]) == 0
    states = {line.split()[1]: line for line in capsys.readouterr().out.splitlines()[1:] if line[0].isdigit()}
    assert " done " in states["clean"] and " done " in states["dedup"]
    assert "1 of 2 done" in states["tokenize"] and "to run" in states["manifest"]


# -- one road to a store -----------------------------------------------------------------------------------------
def old_road(cfg: DataSection, out: Path):
    """How a run made its store before it went through the stages: every document of every file, in order, into
    one shard, with a tokenizer trained on all of them."""
    from liandan.data.documents.corpus import ReadStats, python_docs_corpus
    from liandan.data.documents.readers import read_documents
    from liandan.data.tokens.store import TokenStore, shard_path, write_manifest, write_shard
    from liandan.data.tokens.tokenizer import make_tokenizer

    stats = ReadStats()
    docs = list(read_documents(cfg.paths, cfg.text_field, stats) if cfg.paths else python_docs_corpus(stats))
    tokenizer = make_tokenizer(cfg.tokenizer, (d.text for d in docs), cfg.bpe_vocab_size)
    write_manifest(out, [write_shard(docs, tokenizer, shard_path(out, 0))], tokenizer)
    return TokenStore(out)


def documents(store) -> list[tuple[tuple[str, str], list[int]]]:
    """Every document of a store in order: its provenance and its tokens."""
    return [
        (shard.provenance(i), shard.tokens[shard.doc_starts[i] : shard.doc_starts[i + 1]].tolist())
        for shard in store.shards
        for i in range(shard.num_documents)
    ]


def test_a_runs_data_paths_go_through_the_stages_into_the_same_tokens(tmp_path):
    from liandan.data.pipeline.prepare import data_pipeline, prepare_store

    corpus = write_corpus(tmp_path, n_docs=30)
    lines = corpus.read_text().splitlines()
    (tmp_path / "first.jsonl").write_text("\n".join(lines[:20]) + "\n{not json\n")
    (tmp_path / "second.txt").write_text(json.loads(lines[25])["text"])
    cfg = DataSection(paths=[str(tmp_path / "first.jsonl"), str(tmp_path / "second.txt")], bpe_vocab_size=400)
    store, tokenizer = prepare_store(cfg, tmp_path / "data", say=lambda m: None)
    reference = old_road(cfg, tmp_path / "old")
    assert tokenizer.fingerprint() == reference.fingerprint
    assert documents(store) == documents(reference) and store.num_documents == 21  # provenance included
    pipeline, layout = data_pipeline(cfg, tmp_path / "data")
    assert [s.name for s in pipeline_stages(pipeline)] == ["clean", "dedup", "tokenizer", "tokenize", "manifest"]
    assert layout.store("corpus") == tmp_path / "data" and (tmp_path / "data" / "manifest.json").is_file()
    assert not any(p.name.endswith(".zst") for p in (tmp_path / "data").rglob("*"))  # no [data] extra needed
    # a second call (a resumed run) finds every stage done
    shards = {p: p.stat().st_mtime_ns for p in (tmp_path / "data").glob("shard-*")}
    said = []
    prepare_store(cfg, tmp_path / "data", say=said.append)
    assert {p: p.stat().st_mtime_ns for p in shards} == shards
    assert said[-2].startswith(f"read {cfg.paths[0]}, {cfg.paths[1]}: 21 documents") and "1 malformed JSON" in said[-2]
    # another [data] starts over rather than refusing
    store, tokenizer = prepare_store(DataSection(paths=cfg.paths, tokenizer="byte"), tmp_path / "data", say=said.append)
    assert tokenizer.fingerprint() == "byte-v1" and store.num_documents == 21


@pytest.mark.slow  # reads the standard library's docstrings twice
def test_the_python_documentation_corpus_goes_through_the_stages_into_the_same_tokens(tmp_path):
    from liandan.data.pipeline.prepare import prepare_store

    cfg = DataSection(tokenizer="byte")
    store, _ = prepare_store(cfg, tmp_path / "data", say=lambda m: None)
    reference = old_road(cfg, tmp_path / "old")
    ours, theirs = documents(store), documents(reference)
    assert [tokens for _, tokens in ours] == [tokens for _, tokens in theirs]  # byte tokens: the very same texts
    assert [doc_id for (_, doc_id), _ in ours] == [doc_id for (_, doc_id), _ in theirs]
    assert np.array_equal(
        np.concatenate([s.tokens for s in store.shards]), np.concatenate([s.tokens for s in reference.shards])
    )
    assert os.path.basename(ours[0][0][0]) == "python-docs.jsonl"
