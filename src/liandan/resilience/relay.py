"""The workers' output, relayed by the supervisor: every line into the attempt's log, the last lines and
every traceback kept for the incident, and the console shown what a person needs.

When one rank dies, its peers fail in their next collective and each prints a long traceback that says only
that a peer went away (gloo: "Connection reset by peer"). On the console such a traceback becomes one line
that names the rank, the error and where the whole of it is; the rank that failed first keeps its
traceback on the console, as it tells what went wrong. A plain line that says a peer went away (gloo's own
log of a closed connection, printed before the traceback it leads to) is held back and goes only to the log
when a peer had ended: the console then shows the peer's error, not the noise of its going.
"""

from __future__ import annotations

import collections
import contextlib
import re
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

from liandan.resilience.nodes import PEER_LOST, lost_a_peer

TRACEBACK = "Traceback (most recent call last):"
CHAINED = ("During handling of the above exception", "The above exception was the direct cause")
KEPT_TRACEBACK_CHARS = 20000
_SOURCE = re.compile(r"\[[^\]\s]*\.(?:cc|cpp|cu|h|hpp):\d+\] ")  # gloo's "[.../pair.cc:537] "


def brief(error: str) -> str:
    """A lost peer's error as the console shows it: without the C++ source location and the advice after it
    (gloo's "... Connection reset by peer. This is typically caused by ... GLHF! 🏖️"); the log keeps it whole."""
    error = _SOURCE.sub("", error)
    for marker in PEER_LOST:
        at = error.find(marker)
        if at >= 0:
            return error[: at + len(marker)]
    return error


class Relay:
    """One attempt's output. `follow` runs in a thread per stream; `peer_ended(label)` says whether a
    process of the attempt other than `label`'s has ended (a traceback that `label` prints then is a
    consequence)."""

    def __init__(self, log_path: Path, peer_ended: Callable[[str], bool]):
        self.log_path = log_path
        self.log = open(log_path, "w")  # noqa: SIM115 - closed by close() when the attempt ends
        self.peer_ended = peer_ended
        self.lock = threading.Lock()
        self.last_lines: collections.deque = collections.deque(maxlen=30)
        self.tracebacks: dict[str, list[str]] = {}  # label -> every traceback it printed, in full
        self.threads: list[threading.Thread] = []

    def start(self, label: str, stream: IO[str], sink: IO[str]) -> None:
        thread = threading.Thread(target=self.follow, args=(label, stream, sink), daemon=True)
        thread.start()
        self.threads.append(thread)

    def follow(self, label: str, stream: IO[str], sink: IO[str]) -> None:
        held: list[str] = []  # a traceback being printed, held back until it is complete
        state = None  # None, or where in a traceback: "frames", "done" (its error line seen), "gap" (blank after)
        # Whether another process had ended when the error line came: decided then, as this process's own
        # end (and the supervisor's ending the others) follows its traceback within moments.
        after_peer = False
        lost: list[str] = []  # plain lines saying a peer went away, held until it is known whether one ended
        for line in stream:
            with self.lock:
                self.last_lines.append(line.rstrip("\n"))
                self._log(line)
            text = line.rstrip("\n")
            opens = text.startswith((TRACEBACK, *CHAINED))
            if state == "frames":
                held.append(line)
                if text.strip() and not text[:1].isspace() and not opens:
                    after_peer = after_peer or self.peer_ended(label)
                    state = "done"
                continue
            if state in ("done", "gap"):
                if opens or not text.strip():
                    held.append(line)
                    state = "frames" if opens else "gap"
                    continue
                self._show(label, lost + held, sink, after_peer)
                held, state, after_peer, lost = [], None, False, []
            if text.startswith(TRACEBACK):
                held, state = [line], "frames"
                continue
            if lost_a_peer(text):
                lost.append(line)
                continue
            if lost and not self.peer_ended(label):
                sink.writelines(lost)
            lost = []
            sink.write(line)
            sink.flush()
        if held:  # cut short when the supervisor ended this process: a consequence if a peer ended first
            self._show(label, lost + held, sink, after_peer or (state == "frames" and self.peer_ended(label)))
        elif lost and not self.peer_ended(label):
            sink.writelines(lost)
            sink.flush()

    def _log(self, line: str) -> None:
        """Keep `line` in the attempt's log. A log that cannot be written (a full disk) is given up, said once,
        and the output still relayed: a relay that stopped reading would leave the workers blocked on a full
        pipe."""
        if self.log.closed:
            return
        try:
            self.log.write(line)
            self.log.flush()
        except OSError as err:
            with contextlib.suppress(OSError):
                self.log.close()
            print(
                f"supervisor: warning: cannot write {self.log_path}: {type(err).__name__}: {err.strerror or err};"
                " the workers' output goes on here but is no longer logged",
                file=sys.stderr,
                flush=True,
            )

    def _show(self, label: str, lines: list[str], sink: IO[str], after_peer: bool) -> None:
        """Show a complete traceback (after any held lost-peer lines that led to it), or as a consequence one
        line that stands for both."""
        start = next(i for i, line in enumerate(lines) if line.startswith(TRACEBACK))
        text = "".join(lines[start:])
        with self.lock:
            self.tracebacks.setdefault(label, []).append(text[-KEPT_TRACEBACK_CHARS:])
        error = next((line.strip() for line in reversed(lines) if line.strip()), "")
        if after_peer or lost_a_peer(error):
            sink.write(f"{label}: {brief(error)} (a consequence of another process ending; traceback in"
                       f" {self.log_path})\n")  # fmt: skip
        else:
            sink.write("".join(lines))
        sink.flush()

    def close(self) -> None:
        for thread in self.threads:
            thread.join(timeout=2)  # every writer is gone: the pipes are at their end
        with contextlib.suppress(OSError):  # a log the disk had no room for was reported when it failed
            self.log.close()
