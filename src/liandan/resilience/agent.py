"""One node's torchrun elastic agent, started by that node's supervisor in a multi-node run:

    python -m liandan.resilience.agent --nproc=N TORCHRUN_RENDEZVOUS_OPTIONS... -- python -m MODULE ARGS...

It runs the workers through torchrun in this process (see `launch_local`), which leaves the rank that failed
first in $LIANDAN_FAILURE_FILE, and prints a worker's user error once."""

import sys

from liandan.run.errors import DEVICE_FAULT_EXIT


def main(argv: list[str]) -> int:
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    nproc = int(options[0].removeprefix("--nproc="))
    if command[1:2] != ["-m"]:
        raise SystemExit(f"liandan.resilience.agent: the worker command must be 'python -m MODULE ...', not {command}")
    from liandan.train.distributed import launch_local

    code, message = launch_local(nproc, command[2], command[3:], rendezvous=options[1:])
    if message:
        print(f"liandan: error: {message}", file=sys.stderr)
    return 0 if code == 0 else (code if code in (2, DEVICE_FAULT_EXIT) else 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
