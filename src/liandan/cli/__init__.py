"""The `liandan` command line."""

from liandan.cli.main import main

__all__ = ["main"]
