"""The local cache of the token stores a run trains on, copied from object storage or a shared file system.

Training memory-maps its shards, which needs local files. A store named by URL is copied into
`<cache>/<key>/<store name>/`, the key hashing the URL and the manifest's bytes, so a republished store gets a
fresh copy. Each file is downloaded to `<name>.partial`, appended to from where it stopped when a download
was interrupted, checked against the size and xxh3-64 checksum that the manifest records, and only then renamed
to its name: a file under its own name in the cache is a checked one. A partial file that fails its checksum is
fetched again from the start once. The local manifest is written last, as in the store. An `fcntl` lock per cached
store lets the ranks of one host share one download.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import xxhash

from liandan.data.documents import storage
from liandan.data.documents.corpus import DataError
from liandan.data.documents.storage import first_line, read_if_present, storage_errors
from liandan.data.tokens.store import FORMAT, MANIFEST, TOKENIZER_FILE, file_checksum
from liandan.faults import maybe_inject
from liandan.run import atomic_write
from liandan.run.remote import RemotePath, is_url, locate
from liandan.run.worker_env import CACHE_DIR

PARTIAL_SUFFIX = ".partial"


def cache_root(configured: str = "") -> Path:
    """`configured`, else $LIANDAN_CACHE_DIR/stores, else $XDG_CACHE_HOME/liandan/stores, else
    ~/.cache/liandan/stores."""
    if configured:
        return Path(configured).expanduser()
    if os.environ.get(CACHE_DIR):
        return Path(os.environ[CACHE_DIR]) / "stores"
    base = Path(os.environ["XDG_CACHE_HOME"]) if os.environ.get("XDG_CACHE_HOME") else Path.home() / ".cache"
    return base / "liandan" / "stores"


@dataclass
class Fetched:
    """What `fetch_store` did: the local copy, and the bytes it moved (0 when the cache held everything)."""

    path: Path
    downloaded: int = 0
    files: int = 0
    resumed: int = 0  # files whose download continued a partial one


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)  # released by the kernel however the holder ends
        yield


def _manifest_of(source: Any) -> tuple[bytes, dict[str, Any], dict[str, dict]]:
    """A store's manifest: its bytes, its contents, and the size and checksum of each file it lists."""
    raw = read_if_present(source / MANIFEST)
    if raw is None:
        raise DataError(f"no token store at {source} ({MANIFEST} missing: not published, or its publishing was"
                        " interrupted; publishing again completes it)")  # fmt: skip
    try:
        manifest = json.loads(raw)
        expected = {TOKENIZER_FILE: manifest["tokenizer_file"]}
        for shard in manifest["shards"]:
            expected.update(shard["files"])
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{source / MANIFEST} is not a token store manifest ({first_line(err)})") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{source / MANIFEST} does not describe a {FORMAT}")
    return raw, manifest, expected


def store_manifest(url: str) -> dict[str, Any]:
    """The manifest of the store at `url`, read without fetching the store."""
    return _manifest_of(locate(url))[1]


def fetch_store(url: str, cache: Path, say: Callable[[str], None] | None = None) -> Fetched:
    """The store at `url` as a local directory in the cache `cache`, downloading what the cache lacks."""
    source = locate(url)
    raw, _, expected = _manifest_of(source)
    local = _copy_of(source, raw, cache)
    fetched = Fetched(local)
    with _locked(local.parent / ".lock"):
        local.mkdir(parents=True, exist_ok=True)
        for name, info in expected.items():  # a complete copy costs a stat per file: one removed is fetched again
            _fetch_file(source / name, local / name, int(info["bytes"]), info["xxh3_64"], fetched)
        if not ((local / MANIFEST).is_file() and (local / MANIFEST).read_bytes() == raw):
            atomic_write(local / MANIFEST, raw, durable=False)  # last: the copy is complete
    if say is not None and fetched.files:
        resumed = f", {fetched.resumed} resumed" if fetched.resumed else ""
        say(f"fetched {fetched.files} file(s) of {url} ({fetched.downloaded:,} bytes{resumed}) into {local}")
    return fetched


def _copy_of(source: RemotePath, manifest: bytes, cache: Path) -> Path:
    """Where the cache keeps its copy of this store (the manifest in the key: a republished store is another)."""
    key = xxhash.xxh3_64_hexdigest(str(source).encode() + b"\0" + manifest)
    return cache / key / (source.name or "store")


def store_tokenizer(location: str, cache_dir: str = "") -> Path:
    """A store's tokenizer.json: beside a local store's manifest; for a store URL, fetched alone (checked against
    the manifest) into the store's place in the cache, without its shards."""
    if not is_url(location) or location.startswith("file://"):
        return local_store(location) / TOKENIZER_FILE
    source = locate(location)
    raw, _, expected = _manifest_of(source)
    local = _copy_of(source, raw, cache_root(cache_dir))
    with _locked(local.parent / ".lock"):
        local.mkdir(parents=True, exist_ok=True)
        info = expected[TOKENIZER_FILE]
        _fetch_file(
            source / TOKENIZER_FILE, local / TOKENIZER_FILE, int(info["bytes"]), info["xxh3_64"], Fetched(local)
        )
    return local / TOKENIZER_FILE


def _fetch_file(source: RemotePath, target: Path, size: int, checksum: str, fetched: Fetched) -> None:
    if target.is_file() and target.stat().st_size == size:
        return  # only a checked file is ever renamed to its name
    with storage_errors(source):
        found = source.stat().st_size
    if found != size:
        raise DataError(f"{source} holds {found} bytes, its store's manifest says {size} (a truncated or"
                        " replaced object: publish the store again)")  # fmt: skip
    partial = target.with_name(target.name + PARTIAL_SUFFIX)
    for fresh in (False, True):
        have = partial.stat().st_size if partial.is_file() else 0
        if fresh or have > size:
            partial.unlink(missing_ok=True)
            have = 0
        fetched.resumed += bool(have)
        fetched.downloaded += _download(source, partial, have, size)
        if file_checksum(partial) == checksum:
            os.replace(partial, target)
            fetched.files += 1
            return
    partial.unlink(missing_ok=True)
    raise DataError(f"{source} does not match the checksum its store's manifest records (xxh3-64 {checksum});"
                    " the object is corrupt: publish the store again")  # fmt: skip


def _download(source: RemotePath, partial: Path, start: int, size: int) -> int:
    """Append bytes [start, size) of `source` to `partial`; returns how many."""
    if start >= size:
        return 0
    moved = chunks = 0
    with storage_errors(source), source.fs.open(source.path, "rb", block_size=storage.CHUNK_BYTES) as inp:
        inp.seek(start)
        with open(partial, "ab") as out:
            while block := inp.read(min(storage.CHUNK_BYTES, size - start - moved)):
                out.write(block)
                out.flush()  # what a killed downloader leaves is what the next one resumes from
                moved += len(block)
                maybe_inject("fetch", chunks)
                chunks += 1
    return moved


def local_store(location: str, cache_dir: str = "", say: Callable[[str], None] | None = None) -> Path:
    """A store's directory to open: a local path as it is, a URL through the shard cache."""
    if not is_url(location) or location.startswith("file://"):
        return Path(location.removeprefix("file://"))
    return fetch_store(location, cache_root(cache_dir), say).path
