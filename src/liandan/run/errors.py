"""Errors about a run as a whole that the command line reports as one line."""

DEVICE_FAULT_EXIT = 4  # a worker's exit code when the run stopped on a device that computes wrong


class RunStopped(RuntimeError):
    """The run stopped itself by one of its own rules (the loss-spike guard's limit on rollbacks): not a bug,
    and not something a restart would fix."""

    exit_code = 2


class DeviceFault(RunStopped):
    """Silent-data-corruption detection found a device that keeps computing wrong (it failed its golden test):
    the run stopped after rolling back, and restarting on that device would only corrupt it again. The
    supervisor marks the rank's node (`liandan.resilience.nodes.ExclusionList`)."""

    exit_code = DEVICE_FAULT_EXIT

    def __init__(self, message: str, rank: int, host: str):
        super().__init__(message)
        self.rank, self.host = rank, host
