"""The contract between the supervisor and its workers, as environment variables."""

from __future__ import annotations

import os
import socket

NODE_NAME = "LIANDAN_NODE_NAME"


def node_name() -> str:
    """This node's name: $LIANDAN_NODE_NAME, else Slurm's name for it, else the host name."""
    return os.environ.get(NODE_NAME) or os.environ.get("SLURMD_NODENAME") or socket.gethostname()
