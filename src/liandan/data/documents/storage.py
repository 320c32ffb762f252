"""Data in object storage (`s3://`, `gs://`, any fsspec URL) and on shared file systems, as the readers meet
it: inputs read by streaming and listed by pattern, and a backend's failure as one line that names the location.

What is written there lives with what writes it: publishing a finished store or report in
`liandan.data.pipeline.publish`, the local cache of the stores a run trains on in `liandan.data.tokens.cache`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from liandan.config import ConfigError
from liandan.data.documents.corpus import DataError
from liandan.run.remote import RemotePath, is_url

CHUNK_BYTES = 8 << 20  # one ranged read of a download, and how often a killed download loses its tail


# -- errors ------------------------------------------------------------------------------------------------------
def first_line(err: BaseException) -> str:
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
        raise DataError(f"cannot {doing} {location}: access denied ({first_line(err)}); check the credentials"
                        " the store's backend reads (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,"
                        " AWS_PROFILE)") from None  # fmt: skip
    except Exception as err:
        if "credential" in type(err).__name__.lower():  # botocore's NoCredentialsError and its kin
            raise DataError(f"cannot {doing} {location}: {first_line(err)}; set the credentials the store's"
                            " backend reads (for S3: AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_PROFILE)") from None  # fmt: skip
        if isinstance(err, OSError) or is_url(location):
            raise DataError(f"cannot {doing} {location}: {first_line(err)}") from None
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


def read_if_present(target: Path | RemotePath) -> bytes | None:
    """The object's bytes, or None where there is none."""
    with storage_errors(target):
        try:
            return target.read_bytes()
        except FileNotFoundError:
            return None
