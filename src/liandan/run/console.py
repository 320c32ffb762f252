"""The rich console every command prints through. On a terminal rich fits its output to the window; into a
pipe, a log file or CI it would wrap at 80 columns and break paths and flags across lines, where neither a
reader nor a script can take them whole: there lines are not wrapped and tables get room."""

from __future__ import annotations

import sys
from typing import Any

WIDE = 200  # the width tables are laid out in when the output is no terminal


def make_console(stderr: bool = False, **options: Any):
    """A `rich.console.Console` on stdout (or stderr) with `options`; unwrapped when that is no terminal."""
    from rich.console import Console

    stream = sys.stderr if stderr else sys.stdout
    if not (hasattr(stream, "isatty") and stream.isatty()):
        options.setdefault("width", WIDE)
        options.setdefault("soft_wrap", True)
    return Console(stderr=stderr, **options)
