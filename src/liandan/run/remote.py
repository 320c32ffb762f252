"""Step directories on object storage and shared file systems (`checkpoint.dir = "s3://bucket/prefix"`).

`RemotePath` is the small part of `pathlib.Path` that checkpoint code uses (joining, names, listing, reading,
writing, sizes, removal), carried out through fsspec, so that listings, manifests and verification are one code
path for local and remote checkpoints. Object stores have no rename and no directories: a "directory" is a key
prefix, and a save writes straight into its step directory, whose manifest, written last in one put, is what
makes it complete (see `liandan.checkpoint.saving`).

The backend is fsspec's for the URL's protocol (s3fs for `s3://`, from the `s3` extra); credentials and the
endpoint come from the backend's usual environment (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
AWS_ENDPOINT_URL, ...). Listings are never served from fsspec's cache: another process (a rank, the
supervisor, the next attempt) may have written or removed objects since. A store that cannot be reached or
refuses the credentials is said in one line (`StoreUnreachable`), after a few seconds, not after the client's
minute of retries.
"""

from __future__ import annotations

import functools
import posixpath
import re
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from liandan.config import ConfigError

_URL = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://")


def is_url(location: object) -> bool:
    """Whether a location names a store by URL (`s3://...`, `gs://...`, `file://...`) rather than a local path."""
    return isinstance(location, RemotePath) or bool(_URL.match(str(location)))


def locate(location: Any) -> Any:
    """A `RemotePath` for a URL, a `pathlib.Path` for anything else; an existing `RemotePath` unchanged."""
    if isinstance(location, RemotePath):
        return location
    return RemotePath.of(str(location)) if is_url(location) else Path(location)


# An S3 client retries a refused connection for about 15 s by default, and each listing retries again: a
# wrong endpoint or a missing credential must be said within seconds. Transfers keep their own read timeout.
_S3_OPTIONS = {"config_kwargs": {"connect_timeout": 3, "retries": {"max_attempts": 1}}}


class StoreUnreachable(ConfigError):
    """A store that cannot be used as configured: no route to its endpoint, no or wrong credentials."""


_HINTS = {
    "NoCredentialsError": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE",
    "PartialCredentialsError": "set both AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY",
    "EndpointConnectionError": "check AWS_ENDPOINT_URL and the network",
    "ConnectTimeoutError": "check AWS_ENDPOINT_URL and the network",
    "NoRegionError": "set AWS_DEFAULT_REGION",
}


def _unreachable(location: object, err: BaseException) -> StoreUnreachable:
    lines = str(err).strip().splitlines()
    why = lines[-1].strip() if lines else type(err).__name__
    hint = next((h for name, h in _HINTS.items() if any(c.__name__ == name for c in type(err).__mro__)), None)
    return StoreUnreachable(f"{location}: cannot use the store: {why}" + (f" ({hint})" if hint else ""))


def _one_line_errors(method):
    """A store client's own exceptions (botocore's, aiohttp's) as one `StoreUnreachable` naming the location;
    the OS errors s3fs maps them to (FileNotFoundError, PermissionError) pass as they are."""

    @functools.wraps(method)
    def call(self, *args, **kwargs):
        try:
            return method(self, *args, **kwargs)
        except (OSError, ValueError, ConfigError):
            raise
        except Exception as err:  # a client fails in many ways, each said in one line
            raise _unreachable(self, err) from err

    return call


@functools.cache
def _filesystem(protocol: str, root: str):
    """One fsspec file system per store and process (its connections are reused)."""
    try:
        from fsspec.core import url_to_fs

        s3 = protocol in ("s3", "s3a")
        fs, _ = url_to_fs(f"{protocol}://{root}", **(_S3_OPTIONS if s3 else {}))
        if s3:
            fs.retries = 2  # s3fs's own loop around the client's, on top of it
    except (ImportError, ValueError) as err:  # a backend not installed, or a protocol fsspec does not know
        extra = "pip install 'liandan[s3]'" if protocol in ("s3", "s3a") else "install fsspec's backend for it"
        why = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{protocol}://{root}: {why} ({extra})") from None
    return fs


@dataclass(frozen=True)
class _Stat:
    st_size: int


@dataclass(frozen=True, order=True)
class RemotePath:
    """A key (or key prefix) in a store, addressed as `protocol://path`."""

    protocol: str
    path: str  # without the protocol, no trailing slash (bucket/prefix/step-00000100/meta.json)

    @classmethod
    def of(cls, url: str) -> RemotePath:
        protocol, _, rest = url.partition("://")
        return cls(protocol, rest.rstrip("/"))

    @property
    def fs(self):
        return _filesystem(self.protocol, self.path.split("/", 1)[0])

    def __str__(self) -> str:
        return f"{self.protocol}://{self.path}"

    def __truediv__(self, name: str) -> RemotePath:
        return RemotePath(self.protocol, posixpath.join(self.path, str(name)))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path)

    @property
    def parent(self) -> RemotePath:
        return RemotePath(self.protocol, posixpath.dirname(self.path))

    def with_name(self, name: str) -> RemotePath:
        return self.parent / name

    def relative_to(self, other: RemotePath) -> str:
        return posixpath.relpath(self.path, other.path)

    def resolve(self) -> RemotePath:
        return self

    # -- questions -----------------------------------------------------------------------------------------
    def _fresh(self) -> None:
        self.fs.invalidate_cache(self.path)

    @_one_line_errors
    def exists(self) -> bool:
        self._fresh()
        return self.fs.exists(self.path)

    @_one_line_errors
    def is_file(self) -> bool:
        self._fresh()
        try:  # not fs.isfile, which reads a store it cannot reach as a missing file
            return self.fs.info(self.path)["type"] == "file"
        except FileNotFoundError:
            return False

    @_one_line_errors
    def is_dir(self) -> bool:
        self._fresh()
        return self.fs.isdir(self.path)

    @_one_line_errors
    def stat(self) -> _Stat:
        self._fresh()
        return _Stat(int(self.fs.size(self.path)))

    @_one_line_errors
    def iterdir(self) -> list[RemotePath]:
        self._fresh()
        if not self.fs.isdir(self.path):
            return []
        return [RemotePath(self.protocol, p.rstrip("/")) for p in self.fs.ls(self.path, detail=False)
                if p.rstrip("/") != self.path]  # fmt: skip

    @_one_line_errors
    def rglob(self, pattern: str = "*") -> list[RemotePath]:
        """Every object under this prefix (only `*` is understood: checkpoint code lists whole directories)."""
        if pattern != "*":
            raise ValueError(f"RemotePath.rglob understands only '*', not {pattern!r}")
        self._fresh()
        return [RemotePath(self.protocol, p) for p in sorted(self.fs.find(self.path))]

    # -- reading and writing -------------------------------------------------------------------------------
    @_one_line_errors
    def open(self, mode: str = "rb") -> IO:
        if "w" in mode:
            self.fs.invalidate_cache(self.parent.path)
        return self.fs.open(self.path, mode)

    @_one_line_errors
    def read_bytes(self) -> bytes:
        try:
            return self.fs.cat_file(self.path)
        except FileNotFoundError:
            raise FileNotFoundError(f"no object {self}") from None

    def read_text(self) -> str:
        return self.read_bytes().decode()

    @_one_line_errors
    def write_bytes(self, data: bytes) -> None:
        """One put: on an object store the object appears whole or not at all."""
        self.fs.pipe_file(self.path, data)
        self.fs.invalidate_cache(self.parent.path)

    def write_text(self, text: str) -> None:
        self.write_bytes(text.encode())

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do on an object store: a prefix exists once an object is under it."""

    @_one_line_errors
    def unlink(self, missing_ok: bool = False) -> None:
        try:
            self.fs.rm_file(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise
        self.fs.invalidate_cache(self.parent.path)

    @_one_line_errors
    def remove_tree(self) -> None:
        """Remove everything under this prefix (what is already gone is no error)."""
        self._fresh()
        if self.fs.exists(self.path):
            self.fs.rm(self.path, recursive=True)
        self.fs.invalidate_cache(self.parent.path)


def remove_tree(path: Any) -> None:
    """Remove a step directory, local or remote; what is already gone is no error."""
    if isinstance(path, RemotePath):
        path.remove_tree()
    else:
        import shutil

        shutil.rmtree(path, ignore_errors=True)
