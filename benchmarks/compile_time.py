"""How long ``torch.compile`` takes to build a converted model's first training steps from an
empty compile cache (a new machine's, CI's), against the plain net's.

    python benchmarks/compile_time.py [--dtypes float32 float64] [--repeats 2]

A net of three conv (3x3, no bias) + ``nn.BatchNorm2d`` + ``nn.LeakyReLU(0.01)`` blocks of 16,
32 and 64 channels (three channel counts: three sets of kernels to build) and a 1x1 conv, on a
(4, 3, 16, 16) input: as it is ("plain"), converted by ``convert_sync_batchnorm`` ("sync") and
by ``convert_inplace_abn`` ("in-place ABN"), each under a plain ``torch.compile(model)``
(inductor, CPU). A measurement is the wall time of the first three training steps (forward,
backward), the compiles included (an in-place net compiles again after its first step, once
it has counted the channels it keeps aside), in a fresh process whose Inductor cache is a new,
empty folder. The variants take turns, ``--repeats`` rounds; the table gives each one's median
[min, max] seconds and its median ratio to the plain net's of the same round and dtype.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

from helpers import results
from helpers.timing import median_range

VARIANTS = ("plain", "sync", "in-place ABN")
STEPS = 3


def _child(variant: str, dtype_name: str) -> None:
    """One measurement, in this process: print the seconds of the first ``STEPS`` steps."""
    import torch
    from torch import nn

    from encoding_syncbn import convert_inplace_abn, convert_sync_batchnorm

    dtype = getattr(torch, dtype_name)
    torch.manual_seed(0)
    layers, channels = [], 3
    for width in (16, 32, 64):
        layers += [nn.Conv2d(channels, width, 3, padding=1, bias=False), nn.BatchNorm2d(width),
                   nn.LeakyReLU(0.01)]
        channels = width
    net = nn.Sequential(*layers, nn.Conv2d(channels, 4, 1)).to(dtype)
    convert = {"sync": convert_sync_batchnorm, "in-place ABN": convert_inplace_abn}.get(variant)
    model = torch.compile(convert(net) if convert else net)
    x = torch.randn(4, 3, 16, 16, dtype=dtype)
    start = time.perf_counter()
    for _ in range(STEPS):
        model(x).sum().backward()
    print(time.perf_counter() - start)


def measure(variant: str, dtype_name: str) -> float:
    """``_child`` in a fresh process with an empty Inductor cache."""
    with tempfile.TemporaryDirectory() as cache:
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache}
        done = subprocess.run([sys.executable, __file__, "--child", variant, dtype_name],
                              env=env, check=True, capture_output=True, text=True)
    return float(done.stdout.split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"],
                        choices=["float32", "float64"])
    parser.add_argument("--repeats", type=int, default=2,
                        help="rounds of every variant (default: %(default)s)")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    results.add_arguments(parser)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return
    seconds = {(dtype, variant): [] for dtype in args.dtypes for variant in VARIANTS}
    for _ in range(args.repeats):
        for dtype in args.dtypes:
            for variant in VARIANTS:
                seconds[dtype, variant].append(measure(variant, dtype))
                print(f"{dtype} {variant}: {seconds[dtype, variant][-1]:.1f} s", flush=True)
    rows = []
    for (dtype, variant), values in seconds.items():
        ratios = [s / plain for s, plain in zip(values, seconds[dtype, "plain"])]
        rows.append([dtype, variant, median_range(values, 1),
                     f"{statistics.median(ratios):.2f}"])
    table = results.markdown_table(
        ["dtype", "net", f"first {STEPS} steps, s", "of the plain net's"], rows)
    print(table)
    results.record(args, "compile_time.py (cpu)", table,
                   f"The first {STEPS} training steps under torch.compile (inductor), compiles "
                   f"included, each in a fresh process with an empty Inductor cache; "
                   f"{args.repeats} rounds, the variants taking turns.")


if __name__ == "__main__":
    main()
