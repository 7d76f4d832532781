import os
import sys

from qkv.cli import main

code = main()
if int(os.environ.get("WORLD_SIZE", "1")) > 1:
    # One rank of a torchrun launch whose run is complete (its process group already destroyed): leave
    # without the interpreter's teardown, where gloo's background threads can still abort the process
    # ("terminate called without an active exception") after a successful run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
sys.exit(code)
