"""A training run in a process of its own, as `liandan sweep` trials and `liandan mix` proxies are: how it is
stopped and what its log says went wrong."""

from __future__ import annotations

import subprocess
from pathlib import Path


def stop_process(process: subprocess.Popen) -> None:
    """End a run's process: SIGTERM, then SIGKILL if it has not ended within 30 s."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def last_error(log: Path) -> str:
    """The last `liandan: error:` line of a run's log, else its last line (300 characters at most)."""
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("liandan: error:")]
    return (errors or lines or ["no output"])[-1][:300]
