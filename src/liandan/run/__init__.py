"""The run directory: its layout, the one atomic writer, tolerant readers of its JSON-lines files, and the
names of its step directories. Every other module reads and writes a run through this room."""

from liandan.run.errors import RunStopped
from liandan.run.files import (
    append_jsonl,
    atomic_write,
    atomic_write_json,
    dumps_json,
    fsync_path,
    naming,
    temporary,
)
from liandan.run.jsonl import JsonlTail, keep_jsonl, parse_line, read_json, read_jsonl
from liandan.run.layout import RunDir
from liandan.run.lock import RunDirInUse, RunLock, holds_progress, lock_run_dir
from liandan.run.steps import STEP_DIR, parse_step_dir, step_dir_name

__all__ = [
    "STEP_DIR",
    "JsonlTail",
    "RunDir",
    "RunDirInUse",
    "RunLock",
    "RunStopped",
    "append_jsonl",
    "atomic_write",
    "atomic_write_json",
    "dumps_json",
    "fsync_path",
    "holds_progress",
    "keep_jsonl",
    "lock_run_dir",
    "naming",
    "parse_line",
    "parse_step_dir",
    "read_json",
    "read_jsonl",
    "step_dir_name",
    "temporary",
]
