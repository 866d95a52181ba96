"""Run a documentation block as the script a user would save it as: ``python doc_block.py
BLOCK.py`` (or under torchrun), with torchvision's CUDA-only op registrations let fail
(third_party.py) for the blocks that import timm, smp or Lightning."""

import runpy
import sys

from third_party import quiet_torchvision_fakes

if __name__ == "__main__":
    with quiet_torchvision_fakes():
        runpy.run_path(sys.argv[1], run_name="__main__")
