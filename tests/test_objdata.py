"""Data in an object store, against a real S3-compatible server on loopback (conftest's `s3`): inputs streamed
from it, token stores and reports published to it marker last, training from a store URL through the local shard
cache, and transfers broken midway (a publisher stopped, a downloader killed, an object truncated) then resumed."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from helpers import MICRO_MODEL, S3_BUCKET, environment_without, faults_planned, read_metrics, run_liandan, tiny_config
from liandan.data.documents.corpus import DataError, ReadStats
from liandan.data.documents.readers import read_file
from liandan.data.pipeline.pipeline import run_pipeline
from liandan.data.pipeline.pipeline_config import InputSpec, PipelineConfig, PipelineSection, expand_paths
from liandan.data.pipeline.prepare import open_stores
from liandan.data.pipeline.publish import PENDING, publish
from liandan.data.tokens.cache import fetch_store
from liandan.data.tokens.loader import PackedLoader
from liandan.data.tokens.store import MANIFEST, TokenStore, verify_store
from liandan.run.remote import locate

pytest.importorskip("s3fs")
pytest.importorskip("moto.server")
pytest.importorskip("zstandard")

BUCKET = f"s3://{S3_BUCKET}"


def _topics(first: int, count: int) -> list[tuple[str, str]]:
    from pydoc_data.topics import topics

    return [(name, topics[name]) for name in sorted(topics) if len(topics[name].split()) > 80][first : first + count]


def _write_inputs(root: Path) -> dict[str, Path]:
    """The same kinds of input files as on disk: jsonl plain and zstd-compressed, gzipped text, parquet."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import zstandard

    records = [{"id": name, "text": text, "title": name.upper()} for name, text in _topics(0, 30)]
    lines = "".join(json.dumps(r) + "\n" for r in records).encode()
    files = {"docs.jsonl": lines, "docs.jsonl.zst": zstandard.ZstdCompressor().compress(lines),
             "more.txt.gz": gzip.compress("\n\n".join(t.replace("\n\n", "\n") for _, t in _topics(30, 20)).encode())}  # fmt: skip
    for name, data in files.items():
        (root / name).write_bytes(data)
    pq.write_table(pa.Table.from_pylist(records[:12]), root / "table.parquet")
    return {name: root / name for name in [*files, "table.parquet"]}


def _upload(files: dict[str, Path], prefix: str) -> dict[str, str]:
    urls = {name: f"{prefix}/{name}" for name in files}
    for name, path in files.items():
        locate(urls[name]).write_bytes(path.read_bytes())
    return urls


def _docs(location, **options) -> tuple[list[tuple], ReadStats]:
    stats = ReadStats()
    docs = [(d.doc_id, d.text, d.meta) for d in read_file(location, source="s", stats=stats, **options)]
    return docs, stats


def test_inputs_stream_from_the_store_as_from_disk(s3, tmp_path):
    files = _write_inputs(tmp_path)
    urls = _upload(files, f"{BUCKET}/inputs")
    for name, path in files.items():
        mode = {"txt_mode": "paragraph"} if name.endswith(".txt.gz") else {}
        remote, remote_stats = _docs(urls[name], **mode)
        local, local_stats = _docs(path, **mode)
        assert remote == local and len(remote) >= 12, name
        assert remote_stats == local_stats
    spec = InputSpec(name="docs", paths=[f"{BUCKET}/inputs/docs.*", urls["more.txt.gz"]])
    assert expand_paths(spec) == [urls["docs.jsonl"], urls["docs.jsonl.zst"], urls["more.txt.gz"]]


def test_a_run_config_and_a_pipeline_file_take_urls_as_they_are(s3, tmp_path):
    from liandan.config import DataSection
    from liandan.data.pipeline.pipeline_config import load_pipeline
    from liandan.data.pipeline.prepare import prepare_store

    files = _write_inputs(tmp_path)
    urls = _upload(files, f"{BUCKET}/run-inputs")
    store, _ = prepare_store(DataSection(paths=[urls["docs.jsonl"]], tokenizer="byte"), tmp_path / "data", say=str)
    assert store.num_documents == 30 and store.provenance(0, 0) == (urls["docs.jsonl"], _topics(0, 1)[0][0])
    toml = tmp_path / "sub" / "pipeline.toml"
    toml.parent.mkdir()
    toml.write_text(
        f'[pipeline]\npublish = "{BUCKET}/out"\n[[inputs]]\nname = "a"\npaths = ["{BUCKET}/run-inputs/*.jsonl"]\n'
    )
    cfg = load_pipeline(toml)  # relative paths are taken from the file's folder; URLs are left alone
    assert (cfg.pipeline.publish, cfg.inputs[0].paths) == (f"{BUCKET}/out", [f"{BUCKET}/run-inputs/*.jsonl"])


def test_a_missing_object_or_bucket_is_one_line(s3):
    with pytest.raises(DataError, match=rf"^data file not found: {BUCKET}/inputs/nothing\.jsonl$"):
        read_file(f"{BUCKET}/inputs/nothing.jsonl")
    with pytest.raises(DataError, match=rf"^input 'x': no object matches {BUCKET}/nowhere/\*\.jsonl$"):
        expand_paths(InputSpec(name="x", paths=[f"{BUCKET}/nowhere/*.jsonl"]))
    with pytest.raises(DataError, match=r"^data file not found: s3://no-such-bucket-here/a\.jsonl$"):
        read_file("s3://no-such-bucket-here/a.jsonl")


def test_without_credentials_the_command_fails_in_one_line(s3, tmp_path, monkeypatch, capsys):
    import s3fs

    from liandan.cli.main import main
    from liandan.run import remote

    url = f"{BUCKET}/creds/a.jsonl"
    locate(url).write_bytes(json.dumps({"text": "some text"}).encode() + b"\n")
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    for key in ("AWS_SHARED_CREDENTIALS_FILE", "AWS_CONFIG_FILE"):
        monkeypatch.setenv(key, str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    try:
        remote._filesystem.cache_clear()  # a file system made now, without the credentials
        s3fs.S3FileSystem.clear_instance_cache()
        assert main(["data", "inspect", url, "--out", str(tmp_path / "report")]) == 2
    finally:
        remote._filesystem.cache_clear()  # the next test's file system has them again
        s3fs.S3FileSystem.clear_instance_cache()
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"liandan: error: cannot read {url}: Unable to locate credentials; set the"), line


# -- a pipeline whose inputs are in the store and whose stores and report are published there ----------------------
@pytest.fixture(scope="module")
def published(s3, tmp_path_factory):
    root = tmp_path_factory.mktemp("objdata")
    urls = _upload(_write_inputs(root), f"{BUCKET}/raw")
    cfg = PipelineConfig(
        pipeline=PipelineSection(output=str(root / "out"), workers=1, publish=f"{BUCKET}/corpus"),
        inputs=[
            InputSpec(name="docs", paths=[urls["docs.jsonl.zst"]]),
            InputSpec(name="more", paths=[urls["more.txt.gz"]], txt_mode="paragraph"),
        ],
        steps=[{"name": "normalize"}],
    )
    cfg.tokenizer.kind = "byte"
    cfg.check()
    return root / "out", run_pipeline(cfg, say=lambda m: None).summary


def _objects(url: str) -> dict[str, bytes]:
    root = locate(url)
    return {p.relative_to(root): p.read_bytes() for p in root.rglob()}


def _files(path: Path) -> dict[str, bytes]:
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_pipeline_reads_the_store_and_publishes_stores_and_report(published):
    out, summary = published
    assert summary["read"]["documents"] > 40 and summary["stores"]["docs"]["documents"] == 30
    stores = summary["published"]["stores"]
    assert stores == {name: f"{BUCKET}/corpus/stores/{name}" for name in ("docs", "more")}
    for name, url in stores.items():
        assert _objects(url) == _files(out / "stores" / name)  # PENDING gone, every file whole
    assert summary["published"]["report"] == f"{BUCKET}/corpus/report"
    assert json.loads(locate(f"{BUCKET}/corpus/report/report.json").read_bytes())["sources"].keys() == {"docs", "more"}
    assert publish(out / "stores" / "docs", stores["docs"], MANIFEST) == 0  # a re-run puts nothing


def test_training_from_a_store_url_gives_the_local_store_batches(published, tmp_path):
    out, summary = published
    urls = list(summary["published"]["stores"].values())
    remote, _ = open_stores(urls, str(tmp_path / "cache"))
    local, _ = open_stores([str(out / "stores" / "docs"), str(out / "stores" / "more")])
    assert [s.name for s in remote] == ["docs", "more"]
    assert all(tmp_path / "cache" in s.path.parents for s in remote)
    assert [s.checksum for s in remote] == [s.checksum for s in local]  # a loader state fits either

    def loader(stores):
        return PackedLoader(stores, seq_len=32, global_batch=8, seed=5, val_fraction=0.1, weights=[2, 1])

    from_url, from_disk = loader(remote), loader(local)
    for _ in range(3):
        for a, b in zip(from_url.next_step(4), from_disk.next_step(4)):
            assert torch.equal(a.inputs, b.inputs) and torch.equal(a.doc_ids, b.doc_ids)
    resumed = loader(open_stores(urls, str(tmp_path / "cache"))[0])  # a second open downloads nothing
    resumed.load_state_dict(from_url.state_dict())
    for a, b in zip(resumed.next_step(4), from_disk.next_step(4)):
        assert torch.equal(a.inputs, b.inputs) and torch.equal(a.targets, b.targets)
    assert fetch_store(urls[0], tmp_path / "cache").downloaded == 0


def test_a_store_published_to_a_directory_and_a_report_to_a_url(published, tmp_path, capsys):
    from liandan.cli.main import main

    out, summary = published
    assert publish(out / "stores" / "more", str(tmp_path / "shared" / "more"), MANIFEST) == len(
        _files(out / "stores" / "more")
    )
    assert _files(tmp_path / "shared" / "more") == _files(out / "stores" / "more")
    assert main(["data", "info", summary["published"]["stores"]["more"], "--verify"]) == 0
    assert "verified: every checksum matches" in capsys.readouterr().out
    raw = f"{BUCKET}/raw/docs.jsonl"
    assert main(["data", "inspect", raw, "--out", f"{BUCKET}/reports/docs"]) == 0
    assert capsys.readouterr().out.startswith(f"report: {BUCKET}/reports/docs/report.html")
    report = json.loads(locate(f"{BUCKET}/reports/docs/report.json").read_bytes())
    assert report["sources"]["docs"]["documents"] == 30


def test_a_store_urls_tokenizer_is_fetched_alone(published, tmp_path):
    from liandan.data.tokens.cache import store_tokenizer

    out, summary = published
    path = store_tokenizer(summary["published"]["stores"]["docs"], str(tmp_path / "cache"))
    assert path.read_bytes() == (out / "stores" / "docs" / "tokenizer.json").read_bytes()
    assert sorted(p.name for p in path.parent.iterdir()) == ["tokenizer.json"]  # no shard came with it
    assert store_tokenizer(str(out / "stores" / "docs")) == out / "stores" / "docs" / "tokenizer.json"


def test_a_half_published_store_is_refused_and_publishing_again_completes_it(published, tmp_path):
    out, _ = published
    local, url = out / "stores" / "docs", f"{BUCKET}/half/docs"
    files = _files(local)
    with faults_planned("raise@publish:1"), pytest.raises(RuntimeError, match="injected fault at publish 1"):
        publish(local, url, MANIFEST)  # stopped after two files were put
    assert len(_objects(url)) == 3 and PENDING in _objects(url) and MANIFEST not in _objects(url)
    with pytest.raises(DataError, match=rf"^no token store at {url} \(manifest.json missing: not published"):
        fetch_store(url, tmp_path / "cache")
    assert publish(local, url, MANIFEST) == len(files) - 2  # the rest, the marker last
    assert _objects(url) == files
    assert verify_store(fetch_store(url, tmp_path / "cache").path) == []


def test_a_truncated_object_is_refused_and_republished(published, tmp_path):
    out, _ = published
    local, url = out / "stores" / "more", f"{BUCKET}/truncated/more"
    publish(local, url, MANIFEST)
    shard = locate(url) / "shard-00001.bin"
    whole = shard.read_bytes()
    shard.write_bytes(whole[: len(whole) // 2])
    with pytest.raises(DataError, match=rf"^{shard} holds {len(whole) // 2} bytes, its store's manifest says"):
        fetch_store(url, tmp_path / "cache")
    assert publish(local, url, MANIFEST) == len(_files(local))  # the marker withdrawn, everything put again
    assert verify_store(fetch_store(url, tmp_path / "cache").path) == []


def test_a_partial_download_is_resumed_and_a_corrupt_one_fetched_again(published, tmp_path):
    url = published[1]["published"]["stores"]["docs"]
    fetched = fetch_store(url, tmp_path / "cache")
    shard = fetched.path / "shard-00000.bin"
    whole = shard.read_bytes()
    (fetched.path / MANIFEST).unlink()
    partial = shard.with_name(shard.name + ".partial")
    shard.rename(partial)
    with open(partial, "r+b") as handle:
        handle.truncate(len(whole) // 3)  # where a killed download stopped
    again = fetch_store(url, tmp_path / "cache")
    assert (again.resumed, again.files, again.downloaded) == (1, 1, len(whole) - len(whole) // 3)
    assert shard.read_bytes() == whole and not partial.exists()

    (fetched.path / MANIFEST).unlink()
    shard.unlink()
    partial.write_bytes(b"\xff" * (len(whole) // 2))  # not what the object holds
    again = fetch_store(url, tmp_path / "cache")
    assert (again.resumed, again.files, again.downloaded) == (1, 1, len(whole) - len(whole) // 2 + len(whole))
    assert verify_store(again.path) == [] and TokenStore(again.path).num_documents == 30


def test_a_killed_downloader_leaves_a_partial_file_the_next_one_resumes(published, s3, tmp_path):
    """A real process, SIGKILLed after the third chunk of a shard's download; the next fetch continues it."""
    url, cache = published[1]["published"]["stores"]["docs"], tmp_path / "cache"
    script = ("import sys; from pathlib import Path; from liandan.data.documents import storage;"
              " from liandan.data.tokens.cache import fetch_store; storage.CHUNK_BYTES = 4096;"
              " fetch_store(sys.argv[1], Path(sys.argv[2]))")  # fmt: skip
    env = environment_without(**s3, LIANDAN_FAULTS="kill@fetch:2")
    command = [sys.executable, "-c", script, url, str(cache)]
    done = subprocess.run(command, env=env, capture_output=True, timeout=120, check=False)
    assert done.returncode == -9, done.stderr[-2000:]
    [partial] = cache.rglob("*.partial")
    assert partial.stat().st_size == 3 * 4096 and not list(cache.rglob(MANIFEST))
    fetched = fetch_store(url, cache)
    assert fetched.resumed == 1 and verify_store(fetched.path) == []
    assert not list(cache.rglob("*.partial"))


@pytest.mark.slow
def test_a_run_trains_from_a_store_url_as_from_its_local_copy(published, s3, tmp_path):
    out, summary = published
    env = environment_without(**s3)
    losses = {}
    for name, store in (("url", summary["published"]["stores"]["docs"]), ("disk", out / "stores" / "docs")):
        config = tmp_path / f"{name}.toml"
        config.write_text(tiny_config(tmp_path / "runs", out / "summary.json", *MICRO_MODEL, "--train.steps=3",
                                      f"--run.name={name}", f'--data.stores=["{store}"]',
                                      f"--data.cache_dir={tmp_path / 'cache'}", "--doctor.preflight=false",
                                      "--resilience.supervise=false").to_toml())  # fmt: skip
        done = run_liandan("train", config, "--nproc=1", env=env, timeout=300)  # nothing fails: no supervisor
        assert done.returncode == 0, done.stderr[-3000:]
        losses[name] = [r["loss"] for r in read_metrics(tmp_path / "runs" / name) if "loss" in r]
    assert len(losses["url"]) == 3 and losses["url"] == losses["disk"]


@pytest.mark.slow
def test_a_pipeline_killed_while_publishing_completes_the_store_when_run_again(s3, tmp_path):
    """`liandan data run` SIGKILLed after the second file of the first store went up: the store is refused until
    the same command runs again, which puts the rest and the manifest, leaving what the local stores hold."""
    urls = _upload(_write_inputs(tmp_path), f"{BUCKET}/killed/raw")
    toml = tmp_path / "pipeline.toml"
    toml.write_text(f"""
[pipeline]
output = "out"
workers = 1
inspect = false
publish = "{BUCKET}/killed/corpus"
[[inputs]]
name = "docs"
paths = ["{urls["docs.jsonl.zst"]}"]
[[inputs]]
name = "table"
paths = ["{urls["table.parquet"]}"]
[tokenizer]
kind = "byte"
""")
    env = environment_without(**s3)
    first = run_liandan("data", "run", toml, env={**env, "LIANDAN_FAULTS": "kill@publish:1"}, timeout=300)
    assert first.returncode == -9, first.stderr[-2000:]
    docs = f"{BUCKET}/killed/corpus/stores/docs"
    assert PENDING in _objects(docs) and MANIFEST not in _objects(docs)
    with pytest.raises(DataError, match="manifest.json missing"):
        fetch_store(docs, tmp_path / "cache")
    second = run_liandan("data", "run", toml, env=env, timeout=300)
    assert second.returncode == 0, second.stderr[-2000:]
    assert f'--data.stores=\'["{docs}", ' in second.stdout
    for name in ("docs", "table"):
        assert _objects(f"{BUCKET}/killed/corpus/stores/{name}") == _files(tmp_path / "out" / "stores" / name)
