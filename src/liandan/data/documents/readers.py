"""Reading raw documents from .txt, .jsonl and .parquet files, each optionally compressed (.gz, .zst).

Everything streams: jsonl and txt are read line by line and parquet in record batches, so memory stays bounded
by the largest single document. A malformed record never stops the run and never vanishes: it is counted in
`ReadStats.skipped` under a stable reason and handed to `on_reject` with where it was and what it looked like.
A file that cannot be read at all (missing, unsupported type, corrupt compression, unreadable parquet) raises
a one-line `DataError` naming the file.

    docs = read_file("wiki.jsonl.zst", source="en-wiki", stats=stats, on_reject=rejects.append)

Line numbers count from 1 (as editors show them); parquet rows count from 0 (as arrow indexes them).
"""

from __future__ import annotations

import codecs
import contextlib
import gzip
import io
import json
import re
import shutil
import tempfile
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, BinaryIO

from liandan.config import ConfigError
from liandan.data.documents.corpus import DataError, Document, ReadStats
from liandan.data.documents.storage import is_file, open_binary, storage_errors
from liandan.run.remote import RemotePath, locate

RejectHandler = Callable[[dict[str, Any]], None]

FORMAT_SUFFIXES = {".txt": "txt", ".text": "txt", ".md": "txt", "": "txt", ".jsonl": "jsonl", ".parquet": "parquet"}
COMPRESSION_SUFFIXES = {".gz": "gzip", ".zst": "zstd"}
SUPPORTED_SUFFIXES = tuple(
    s + c for s in FORMAT_SUFFIXES if s for c in ("", *COMPRESSION_SUFFIXES)
)  # ".txt", ".txt.gz", ".jsonl.zst", ...
TXT_MODES = ("file", "line", "paragraph")
DIRECTORY_HOLDS = ".txt, .jsonl or .parquet files (optionally .gz or .zst)"  # what `files_in_directory` takes

RAW_PREVIEW_CHARS = 500  # how much of a rejected record the reject log keeps
META_MAX_CHARS = 256  # longer string fields stay out of doc.meta: it travels with every document
PARQUET_BATCH_ROWS = 1024
_CHUNK_BYTES = 1 << 20
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def files_in_directory(directory: Path, named: str) -> list[Path]:
    """The data files directly in `directory` (`DIRECTORY_HOLDS`), sorted by name: what a directory stands for
    wherever data files are named (`liandan demo --data`, `[[inputs]] paths`, `[data] paths`, `liandan data
    inspect`). DataError, in one line starting with `named`, when it holds none."""
    found = sorted(p for p in Path(directory).iterdir() if p.is_file() and p.name.lower().endswith(SUPPORTED_SUFFIXES))
    if not found:
        raise DataError(f"{named}: the directory holds no {DIRECTORY_HOLDS}")
    return found


def file_format(path: Path | RemotePath) -> tuple[str, str | None]:
    """(format, compression) from the file name: "x.jsonl.zst" -> ("jsonl", "zstd")."""
    name = path.name.lower()
    compression = None
    for suffix, kind in COMPRESSION_SUFFIXES.items():
        if name.endswith(suffix):
            name, compression = name[: -len(suffix)], kind
    inner = Path(name).suffix
    if inner not in FORMAT_SUFFIXES:
        suffixes = Path(path.name).suffixes
        shown = "".join(suffixes[-2:] if compression else suffixes[-1:])
        raise DataError(
            f"unsupported data file type '{shown}' for {path}; use .txt, .jsonl or .parquet (optionally .gz or .zst)"
        )
    return FORMAT_SUFFIXES[inner], compression


def read_file(
    path: str | Path | RemotePath,
    source: str | None = None,
    text_field: str = "text",
    txt_mode: str = "file",
    stats: ReadStats | None = None,
    on_reject: RejectHandler | None = None,
) -> Iterator[Document]:
    """Documents of one file, streamed. The file's type is checked now; reading happens as documents are taken.

    txt_mode says what a document is in a text file: the whole "file", each non-empty "line", or each
    blank-line separated "paragraph". jsonl and parquet take the text from `text_field`, the id from an "id"
    field when there is one, and short scalar fields (title, url, ...) into doc.meta.

    `path` may be a URL (s3://bucket/raw/wiki.jsonl.zst, any fsspec protocol): the object is streamed by ranged
    reads, never downloaded whole first."""
    path = locate(path)
    if txt_mode not in TXT_MODES:
        raise ConfigError(f"txt_mode must be one of {', '.join(TXT_MODES)}, got {txt_mode!r}")
    if not is_file(path):
        raise DataError(f"data file not found: {path}")
    kind, compression = file_format(path)
    reader = RecordReader(path, source if source is not None else str(path), text_field, stats, on_reject)
    if kind == "jsonl":
        return reader.jsonl(compression)
    if kind == "parquet":
        return reader.parquet(compression)
    return reader.txt(compression, txt_mode)


class RecordReader:
    """One file's records as documents (or, through `json_objects`, as JSON objects for other readers), with
    the counts and rejects of the read."""

    def __init__(
        self,
        path: Path | RemotePath,
        source: str,
        text_field: str,
        stats: ReadStats | None,
        on_reject: RejectHandler | None,
    ):
        self.path = path
        self.source = source
        self.text_field = text_field
        self.stats = stats if stats is not None else ReadStats()
        self.on_reject = on_reject
        name = path.name
        if name.lower().endswith(tuple(COMPRESSION_SUFFIXES)):
            name = name.rsplit(".", 1)[0]
        self.stem = Path(name).stem  # "wiki.jsonl.zst" -> "wiki"

    def document(self, doc_id: str, text: str, meta: dict[str, Any] | None = None) -> Document:
        self.stats.documents += 1
        self.stats.characters += len(text)
        return Document(self.source, doc_id, text, meta or {})

    def reject(self, record: int | None, reason: str, raw: bytes | str, **detail: Any) -> None:
        """Count a record that could not become a document, and hand it to the reject log."""
        self.stats.skipped[reason] += 1
        if self.on_reject is not None:
            preview = raw[:RAW_PREVIEW_CHARS]
            if isinstance(preview, bytes):
                preview = preview.decode("utf-8", errors="replace")
            self.on_reject({"file": str(self.path), "record": record, "reason": reason, "raw": preview, **detail})

    # --- formats -------------------------------------------------------------------------------------------

    def json_objects(self, compression: str | None) -> Iterator[tuple[int, bytes, dict[str, Any]]]:
        """(line number, line, object) of each line of a .jsonl that holds a JSON object; blank lines are
        skipped, the others rejected (invalid UTF-8, malformed JSON, not an object), as is a file of none."""
        saw_record = False
        with _open_stream(self.path, compression) as stream:
            for number, raw in enumerate(stream, 1):
                if number == 1 and raw.startswith(codecs.BOM_UTF8):  # as some Windows tools write
                    raw = raw[len(codecs.BOM_UTF8) :]
                if not raw.strip():
                    continue
                saw_record = True
                try:
                    record = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError:
                    self.reject(number, "invalid UTF-8", raw)
                    continue
                except json.JSONDecodeError:
                    self.reject(number, "malformed JSON", raw)
                    continue
                if not isinstance(record, dict):
                    self.reject(number, "not a JSON object", raw)
                    continue
                yield number, raw, record
        if not saw_record:
            self.reject(None, "empty file", b"")

    def jsonl(self, compression: str | None) -> Iterator[Document]:
        field = self.text_field
        for number, raw, record in self.json_objects(compression):
            text = record.get(field)
            if not isinstance(text, str):
                self.reject(number, f"no string field '{field}'", raw)
            elif not text.strip():
                self.reject(number, "empty document", raw)
            elif LONE_SURROGATE.search(text):  # JSON escapes can spell text that no file can hold
                self.reject(number, "invalid Unicode (lone surrogate)", raw)
            else:
                yield self.document(record_id(record.get("id"), self.stem, number), text, _meta(record, field))

    def txt(self, compression: str | None, mode: str) -> Iterator[Document]:
        with _open_stream(self.path, compression) as stream:
            if mode == "file":
                yield from self._whole_file(stream.read())
                return
            blocks = _numbered_lines(stream) if mode == "line" else _paragraphs(stream)
            saw_record = False
            for number, raw in blocks:
                saw_record = True
                try:
                    text = raw.decode("utf-8")
                except UnicodeDecodeError as err:
                    self.reject(number, "invalid UTF-8", raw, byte=err.start)
                    continue
                yield self.document(f"{self.stem}:{number}", text)
            if not saw_record:
                self.reject(None, "empty file", b"")

    def _whole_file(self, raw: bytes) -> Iterator[Document]:
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as err:
            self.reject(None, "invalid UTF-8", raw, byte=err.start)
            return
        if not text.strip():
            self.reject(None, "empty file", raw)
            return
        yield self.document(self.stem, text)

    def parquet(self, compression: str | None) -> Iterator[Document]:
        import pyarrow as pa
        import pyarrow.parquet as pq

        with _parquet_source(self.path, compression) as (handle, size):
            if size == 0:
                self.reject(None, "empty file", b"")
                return
            try:
                parquet_file = pq.ParquetFile(handle)
            except (pa.ArrowException, OSError) as err:
                raise DataError(f"cannot read parquet file {self.path}: {_first_line(err)}") from None
            schema = parquet_file.schema_arrow
            field = self.text_field
            if field not in schema.names:
                self.reject(None, f"no column '{field}'", "columns: " + ", ".join(schema.names))
                return
            if not _is_text(pa, schema.field(field).type):
                self.reject(None, f"column '{field}' is not text", f"{field}: {schema.field(field).type}")
                return
            if parquet_file.metadata.num_rows == 0:
                self.reject(None, "empty file", b"")
                return
            scalar = [f.name for f in schema if f.name != field and (_is_text(pa, f.type) or _is_number(pa, f.type))]
            row = 0
            try:
                for batch in parquet_file.iter_batches(batch_size=PARQUET_BATCH_ROWS, columns=[field, *scalar]):
                    columns = {name: batch.column(name).to_pylist() for name in scalar}
                    for i, text in enumerate(batch.column(field).to_pylist()):
                        record = {name: values[i] for name, values in columns.items()}
                        if not isinstance(text, str):
                            self.reject(row, f"no string field '{field}'", json.dumps(record, default=str))
                        elif not text.strip():
                            self.reject(row, "empty document", text)
                        else:
                            yield self.document(record_id(record.get("id"), self.stem, row), text, _meta(record, field))
                        row += 1
            except (pa.ArrowException, OSError) as err:
                raise DataError(f"cannot read parquet file {self.path} at row {row}: {_first_line(err)}") from None


# --- helpers -----------------------------------------------------------------------------------------------


def record_id(value: Any, stem: str, number: int) -> str:
    if isinstance(value, (str, int)) and not isinstance(value, bool) and str(value):
        return str(value)
    return f"{stem}:{number}"


def _meta(record: dict[str, Any], text_field: str) -> dict[str, Any]:
    return {
        key: value
        for key, value in record.items()
        if key not in (text_field, "id")
        and (isinstance(value, (int, float, bool)) or (isinstance(value, str) and len(value) <= META_MAX_CHARS))
    }


def _is_text(pa: Any, dtype: Any) -> bool:
    return pa.types.is_string(dtype) or pa.types.is_large_string(dtype) or pa.types.is_string_view(dtype)


def _is_number(pa: Any, dtype: Any) -> bool:
    return pa.types.is_integer(dtype) or pa.types.is_floating(dtype) or pa.types.is_boolean(dtype)


def _first_line(err: BaseException) -> str:
    return (str(err).strip().splitlines() or [type(err).__name__])[0]


def _numbered_lines(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    for number, raw in enumerate(stream, 1):
        line = raw.rstrip(b"\r\n")
        if line.strip():
            yield number, line


def _paragraphs(stream: BinaryIO) -> Iterator[tuple[int, bytes]]:
    """Blank-line separated blocks, each with the number of its first line."""
    block: list[bytes] = []
    first = 0
    for number, raw in enumerate(stream, 1):
        if raw.strip():
            if not block:
                first = number
            block.append(raw)
        elif block:
            yield first, b"".join(block).rstrip(b"\r\n")
            block = []
    if block:
        yield first, b"".join(block).rstrip(b"\r\n")


@contextlib.contextmanager
def _open_stream(path: Path | RemotePath, compression: str | None) -> Iterator[BinaryIO]:
    """The file's bytes, decompressed; a decompression failure becomes a DataError naming the file."""
    try:
        raw = open_binary(path)
    except OSError as err:
        raise DataError(f"cannot open {path}: {err.strerror}") from None
    with raw:
        if compression is None:
            yield raw
            return
        if compression == "gzip":
            stream: BinaryIO = gzip.GzipFile(fileobj=raw)
        else:
            stream = io.BufferedReader(_ChunkStream(_zstd_chunks(raw, path)), _CHUNK_BYTES)
        try:
            with stream:
                yield stream
        except Exception as err:
            if not _is_decompression_error(err):
                raise
            raise DataError(
                f"cannot read {path}: corrupt or truncated {compression} data ({_first_line(err)})"
            ) from None


def _is_decompression_error(err: BaseException) -> bool:
    if isinstance(err, (EOFError, zlib.error, gzip.BadGzipFile)):
        return True
    try:
        import zstandard
    except ImportError:
        return False
    return isinstance(err, zstandard.ZstdError)


def _zstd_chunks(raw: BinaryIO, path: Path | RemotePath) -> Iterator[bytes]:
    """Decompressed chunks of a (possibly multi-frame) zstd file; a file cut off inside a frame is an error,
    where a plain stream reader would end quietly and lose the tail."""
    try:
        import zstandard
    except ImportError:
        raise DataError(f"reading {path} needs the zstandard package (pip install zstandard)") from None
    decompressor = zstandard.ZstdDecompressor()
    frame = None
    while chunk := raw.read(_CHUNK_BYTES):
        while chunk:
            if frame is None:
                frame = decompressor.decompressobj()
            out = frame.decompress(chunk)
            if out:
                yield out
            if frame.eof:
                chunk, frame = frame.unused_data, None
            else:
                chunk = b""
    if frame is not None:
        raise EOFError("the file ends inside a zstd frame")


class _ChunkStream(io.RawIOBase):
    """A readable stream over an iterator of byte chunks, so decompressed data can be read line by line."""

    def __init__(self, chunks: Iterator[bytes]):
        self._chunks = chunks
        self._pending = memoryview(b"")

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            chunk = next(self._chunks, None)
            if chunk is None:
                return 0
            self._pending = memoryview(chunk)
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


@contextlib.contextmanager
def _parquet_source(path: Path | RemotePath, compression: str | None) -> Iterator[tuple[BinaryIO, int]]:
    """A seekable handle on the parquet bytes, and their size. Compressed parquet is first inflated into a
    temporary file (parquet needs random access), never into memory."""
    if compression is None:
        with storage_errors(path):
            size = path.stat().st_size
        with _open_stream(path, None) as handle:
            yield handle, size
        return
    with tempfile.TemporaryFile() as handle:
        with _open_stream(path, compression) as stream:
            shutil.copyfileobj(stream, handle, _CHUNK_BYTES)
        size = handle.tell()
        handle.seek(0)
        yield handle, size


def read_documents(paths: list[str], text_field: str = "text", stats: ReadStats | None = None) -> Iterator[Document]:
    """Documents from the given files in order: a .txt is one document, a .jsonl one per line (see
    `read_file` for parquet, compression and the other text modes)."""
    stats = stats if stats is not None else ReadStats()

    def name_bad_text_file(reject: dict[str, Any]) -> None:
        # A whole text file skipped for one bad byte is worth naming in the summary, as it always was.
        if reject["reason"] == "invalid UTF-8" and reject["record"] is None:
            stats.skipped["invalid UTF-8"] -= 1
            if not stats.skipped["invalid UTF-8"]:
                del stats.skipped["invalid UTF-8"]
            stats.skipped[f"invalid UTF-8 in {Path(reject['file']).name} at byte {reject['byte']}"] += 1

    for name in paths:
        yield from read_file(name, source=str(name), text_field=text_field, stats=stats, on_reject=name_bad_text_file)
