"""The run directory: its layout, the one atomic writer, tolerant readers of its JSON-lines files, and the
names of its step directories. Every other module reads and writes a run through this room."""

from liandan.run.errors import RunStopped
from liandan.run.files import (
    append_jsonl,
    atomic_file,
    atomic_write,
    atomic_write_json,
    check_output,
    dumps_json,
    fsync_path,
    naming,
    replacing,
    temporary,
    umask_mode,
)
from liandan.run.jsonl import JsonlTail, keep_jsonl, parse_line, read_json, read_jsonl
from liandan.run.layout import RunDir, project_store, rank_file, rank_files
from liandan.run.lock import RunDirInUse, RunLock, holder_running, holds_progress, lock_run_dir
from liandan.run.steps import (
    MANIFEST,
    META,
    STEP_DIR,
    complete_step_dirs,
    parse_partial_step_dir,
    parse_step_dir,
    partial_of,
    partial_step_dir_name,
    partial_step_dirs,
    step_dir_name,
    step_dirs,
)

__all__ = [
    "MANIFEST",
    "META",
    "STEP_DIR",
    "JsonlTail",
    "RunDir",
    "RunDirInUse",
    "RunLock",
    "RunStopped",
    "append_jsonl",
    "atomic_file",
    "atomic_write",
    "atomic_write_json",
    "check_output",
    "complete_step_dirs",
    "dumps_json",
    "fsync_path",
    "holder_running",
    "holds_progress",
    "keep_jsonl",
    "lock_run_dir",
    "naming",
    "parse_line",
    "parse_partial_step_dir",
    "parse_step_dir",
    "partial_of",
    "partial_step_dir_name",
    "partial_step_dirs",
    "project_store",
    "rank_file",
    "rank_files",
    "read_json",
    "read_jsonl",
    "replacing",
    "step_dir_name",
    "step_dirs",
    "temporary",
    "umask_mode",
]
