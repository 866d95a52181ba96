"""Run a documentation block as the script a user would save it as: ``python doc_block.py
BLOCK.py`` (or under torchrun), with torchvision's CUDA-only op registrations let fail
(third_party.py) for the blocks that import timm, smp or Lightning.

Under torchrun a rank that has run its block to the end leaves without the interpreter's
teardown. torch's DistributedDataParallel keeps its gloo process group, and with it gloo's
threads, alive past ``destroy_process_group()`` and the model's deletion (plain torch, no
layer of ours), and those threads now and then abort the process ("terminate called without
an active exception") after the main thread has left Python: a crash of torch's teardown,
after every line of the block has run. A block that raises still exits through it, non-zero.
"""

import os
import runpy
import sys

from third_party import quiet_torchvision_fakes

if __name__ == "__main__":
    with quiet_torchvision_fakes():
        runpy.run_path(sys.argv[1], run_name="__main__")
    if "LOCAL_RANK" in os.environ:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
