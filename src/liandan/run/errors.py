"""Errors about a run as a whole that the command line reports as one line."""


class RunStopped(RuntimeError):
    """The run stopped itself by one of its own rules (the loss-spike guard's limit on rollbacks): not a bug,
    and not something a restart would fix."""
