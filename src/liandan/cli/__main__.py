import os
import sys

from liandan.run.worker_env import end_with_launcher

end_with_launcher()  # first, before the imports: a launcher stopped while starting this worker takes it along

from liandan.cli.main import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # A worker of a multi-process run has left its process group and closed its files by now. The
    # interpreter's finalization would only destroy what is left of the communication library, whose C++
    # threads can still abort the process there ("terminate called without an active exception",
    # pytorch/pytorch#179291) and turn a finished run into a failed one.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
