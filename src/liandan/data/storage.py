"""Data in object storage (`s3://`, `gs://`, any fsspec URL) and on shared file systems: inputs read by
streaming, token stores and reports published from a local work directory, and the local cache of the stores a
run trains on.

Publishing. An object store has no rename, so a store cannot be written under a temporary name and moved into
place. A directory is therefore published file by file with its completion marker (a store's manifest.json, a
report's report.json) put last, in one put: a reader that finds the marker finds every file it lists. Before the
first file goes up, a `.publishing` object naming the marker to come is written (and any older marker removed),
so a publisher that dies midway leaves a destination that no reader takes as complete and that the next publish
of the same content resumes, putting only the files still missing or of the wrong size.

The shard cache. Training memory-maps its shards, which needs local files. A store named by URL is copied into
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
from typing import IO, Any

import xxhash

from liandan.config import ConfigError
from liandan.data.corpus import DataError
from liandan.faults import maybe_inject
from liandan.run import atomic_write
from liandan.run.remote import RemotePath, is_url, locate
from liandan.run.worker_env import CACHE_DIR

PENDING = ".publishing"
REPORT_MARKER = "report.json"
PARTIAL_SUFFIX = ".partial"
CHUNK_BYTES = 8 << 20  # one ranged read of a download, and how often a killed download loses its tail


# -- errors ------------------------------------------------------------------------------------------------------
def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


@contextlib.contextmanager
def storage_errors(location: object, doing: str = "read") -> Iterator[None]:
    """A backend's failure (a missing object, no or bad credentials, an unknown bucket) as one `DataError` line
    naming the location, instead of a botocore traceback."""
    try:
        yield
    except (DataError, ConfigError):
        raise
    except FileNotFoundError:
        raise DataError(f"not found: {location}") from None
    except PermissionError as err:
        raise DataError(f"cannot {doing} {location}: access denied ({_first_line(err)}); check the credentials"
                        " the store's backend reads (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,"
                        " AWS_PROFILE)") from None  # fmt: skip
    except Exception as err:
        if "credential" in type(err).__name__.lower():  # botocore's NoCredentialsError and its kin
            raise DataError(f"cannot {doing} {location}: {_first_line(err)}; set the credentials the store's"
                            " backend reads (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE)") from None  # fmt: skip
        if isinstance(err, OSError) or is_url(location):
            raise DataError(f"cannot {doing} {location}: {_first_line(err)}") from None
        raise


# -- inputs ------------------------------------------------------------------------------------------------------
def is_file(location: Path | RemotePath) -> bool:
    if not isinstance(location, RemotePath):
        return location.is_file()
    with storage_errors(location):
        location.fs.invalidate_cache(location.path)
        try:  # not fs.isfile: it answers False for every failure, a refused credential too
            return location.fs.info(location.path)["type"] == "file"
        except FileNotFoundError:
            return False


def open_binary(location: Path | RemotePath) -> IO[bytes]:
    """The file's bytes as a stream; an object is read by ranged requests as the stream is consumed."""
    if isinstance(location, RemotePath):
        with storage_errors(location):
            return location.fs.open(location.path, "rb", block_size=CHUNK_BYTES)
    return open(location, "rb")  # the caller closes it


def glob_url(pattern: str) -> list[str]:
    """The objects matching a URL pattern (`*`, `?`, `[...]`, `**`), sorted, as URLs."""
    where = RemotePath.of(pattern)
    with storage_errors(pattern, "list"):
        where.fs.invalidate_cache()
        found = where.fs.glob(where.path, detail=True)
    return sorted(f"{where.protocol}://{p}" for p, info in found.items() if info.get("type") != "directory")


# -- publishing --------------------------------------------------------------------------------------------------
def _sizes(dest: Path | RemotePath) -> dict[str, int]:
    """Size of every file under `dest`, by its path relative to it."""
    if isinstance(dest, RemotePath):
        with storage_errors(dest, "list"):
            dest.fs.invalidate_cache(dest.path)
            if not dest.fs.isdir(dest.path):
                return {}
            found = dest.fs.find(dest.path, detail=True)
        return {p[len(dest.path) + 1 :]: int(info["size"]) for p, info in found.items()}
    return {str(p.relative_to(dest)): p.stat().st_size for p in dest.rglob("*") if p.is_file()}


def _put(source: Path, target: Path | RemotePath) -> None:
    if isinstance(target, RemotePath):
        with storage_errors(target, "write"):
            target.fs.put_file(str(source), target.path)  # a multipart upload appears only once complete
        return
    from liandan.run import atomic_file

    target.parent.mkdir(parents=True, exist_ok=True)
    with open(source, "rb") as inp, atomic_file(target, "wb", durable=False) as out:
        while block := inp.read(CHUNK_BYTES):
            out.write(block)


def _write(target: Path | RemotePath, data: bytes) -> None:
    if isinstance(target, RemotePath):
        with storage_errors(target, "write"):
            target.write_bytes(data)
    else:
        target.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(target, data, durable=False)


def _remove(target: Path | RemotePath) -> None:
    with storage_errors(target, "write"):
        target.unlink(missing_ok=True)


def publish(local: Path, url: str, marker: str) -> int:
    """Copy the finished directory `local` to `url`, its `marker` file last; returns the files put (0 when `url`
    already holds the same marker and files of the same sizes)."""
    dest = locate(url)
    files = sorted(p.relative_to(local).as_posix() for p in local.rglob("*")
                   if p.is_file() and not p.name.startswith("."))  # fmt: skip
    if marker not in files:
        raise DataError(f"{local} has no {marker}: it is not finished, so it is not published")
    files.remove(marker)
    ours = (local / marker).read_bytes()
    token = xxhash.xxh3_64_hexdigest(ours)
    there = _sizes(dest)
    wanted = [f for f in files if there.get(f) != (local / f).stat().st_size]
    complete = there.get(marker) == len(ours) and _read(dest / marker) == ours
    if complete and not wanted:
        if PENDING in there:  # a publisher stopped between its marker and this note's removal
            _remove(dest / PENDING)
        return 0
    if not (PENDING in there and _read(dest / PENDING) == token.encode()):
        _remove(dest / marker)  # first: from here on the destination is incomplete, never half-replaced
        _write(dest / PENDING, token.encode())
        wanted = files  # what is there was put by another publish: same sizes do not make the same files
    elif complete:
        _remove(dest / marker)
    for done, name in enumerate(wanted):
        _put(local / name, dest / name)
        maybe_inject("publish", done)
    _write(dest / marker, ours)
    _remove(dest / PENDING)
    return len(wanted) + 1


def publish_outputs(
    url: str, stores: dict[str, Path], report: Path | None, say: Callable[[str], None] | None = None
) -> dict[str, Any]:
    """Publish each finished store (by source name) to `<url>/stores/<name>` and the report to `<url>/report`;
    returns where they went, as the pipeline's summary records it."""
    from liandan.data.store import MANIFEST

    published: dict[str, Any] = {"stores": {}}
    for name, local in stores.items():
        target = join(url, "stores", name)
        put = publish(local, target, MANIFEST)
        published["stores"][name] = target
        if say is not None:
            say(f"store {name} -> {target}" + (f" ({put} file(s) put)" if put else " (already there)"))
    if report is not None:
        published["report"] = join(url, "report")
        publish(report, published["report"], REPORT_MARKER)
    return published


def _read(target: Path | RemotePath) -> bytes | None:
    with storage_errors(target):
        try:
            return target.read_bytes()
        except FileNotFoundError:
            return None


def join(url: str, *names: str) -> str:
    """`url` with path components added, for URLs and local paths alike."""
    return "/".join([url.rstrip("/"), *names]) if is_url(url) else str(Path(url, *names))


# -- the shard cache ---------------------------------------------------------------------------------------------
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
    from liandan.data.store import FORMAT, MANIFEST, TOKENIZER_FILE

    raw = _read(source / MANIFEST)
    if raw is None:
        raise DataError(f"no token store at {source} ({MANIFEST} missing: not published, or its publishing was"
                        " interrupted; publishing again completes it)")  # fmt: skip
    try:
        manifest = json.loads(raw)
        expected = {TOKENIZER_FILE: manifest["tokenizer_file"]}
        for shard in manifest["shards"]:
            expected.update(shard["files"])
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{source / MANIFEST} is not a token store manifest ({_first_line(err)})") from None
    if manifest.get("format") != FORMAT:
        raise DataError(f"{source / MANIFEST} does not describe a {FORMAT}")
    return raw, manifest, expected


def store_manifest(url: str) -> dict[str, Any]:
    """The manifest of the store at `url`, read without fetching the store."""
    return _manifest_of(locate(url))[1]


def fetch_store(url: str, cache: Path, say: Callable[[str], None] | None = None) -> Fetched:
    """The store at `url` as a local directory in the cache `cache`, downloading what the cache lacks."""
    from liandan.data.store import MANIFEST

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
    from liandan.data.store import TOKENIZER_FILE

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
    from liandan.data.store import file_checksum

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
    with storage_errors(source), source.fs.open(source.path, "rb", block_size=CHUNK_BYTES) as inp:
        inp.seek(start)
        with open(partial, "ab") as out:
            while block := inp.read(min(CHUNK_BYTES, size - start - moved)):
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
