"""Command-line commands (registered by liandan.cli.main)."""


def add_commands(sub) -> None:
    """Register this module's subcommands on the `liandan` subparsers object."""
