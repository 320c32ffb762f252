"""Placeholder: commands are added here."""

from __future__ import annotations


def add_commands(sub) -> None:
    return None
