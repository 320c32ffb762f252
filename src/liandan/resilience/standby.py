"""A standby worker: import what every worker imports, then wait on stdin for one line of orders,
{"module", "args", "env"}, and run `python -m module args...` in that environment. End of input (the
supervisor no longer needs it, or is gone) ends it quietly.

    python -m liandan.resilience.standby [MODULE]

MODULE is the worker's entry module (`liandan.cli` for `liandan train`), imported ahead of need with the
trainer: the supervisor names it from the worker command it was given, so this module knows no entry point.

While it prepares, a standby runs at idle CPU priority where it can return to normal priority later (as
root, or with RLIMIT_NICE allowing it), so that it never slows the attempt that is running."""

import contextlib
import importlib
import json
import os
import resource
import runpy
import sys


def _set_policy(policy: int) -> None:
    for tid in os.listdir("/proc/self/task"):  # every thread: the policy is per thread on Linux
        try:
            os.sched_setscheduler(int(tid), policy, os.sched_param(0))
        except OSError:
            pass


def main() -> None:
    idle = hasattr(os, "SCHED_IDLE") and (os.geteuid() == 0 or resource.getrlimit(resource.RLIMIT_NICE)[0] >= 20)
    if idle:
        _set_policy(os.SCHED_IDLE)
    # The seconds a worker spends before its first line of work. A failing import is left to the real start,
    # which raises it again with its message where it belongs.
    with contextlib.suppress(Exception):
        import liandan.train.trainer  # noqa: F401 - torch, the model and the loop: what every worker runs

        for module in sys.argv[1:]:  # the worker's entry module, named by the supervisor
            importlib.import_module(module)
    with contextlib.suppress(Exception):
        import torch._dynamo  # noqa: F401 - FSDP2 imports it on first use: most of a second
    line = sys.stdin.readline()
    if not line.strip():
        return
    orders = json.loads(line)
    if idle:
        _set_policy(os.SCHED_OTHER)
    os.environ.clear()
    os.environ.update(orders["env"])
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)  # let go of the supervisor's pipe
    os.close(devnull)
    sys.argv = [orders["module"], *orders["args"]]
    runpy.run_module(orders["module"], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
