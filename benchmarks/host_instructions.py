"""Instructions per layer call of the Triton path's host work, counted under valgrind: a
measure of the host path that does not drift from run to run as time does.

    python benchmarks/host_instructions.py [--steps 1000] [--layers ours bare floor]

Runs ``host_overhead.py``'s harness for one layer ((8, 256, 128, 128) float16, planned for a
132-SM GPU, every launch through Triton's launcher down to ``stub_driver.py``'s stand-in
driver) under ``valgrind --tool=cachegrind --cache-sim=no`` twice, for 40 steps and for 40 +
``--steps``, and prints the difference per step: the instructions of one forward+backward, all
the host does (Python, torch's dispatch and autograd, the allocator, Triton's launcher) but the
driver's inside of each launch. Each harness first runs once without valgrind (the kernels
compiled for sm_90, or found in Triton's cache). Both counted runs fix ``PYTHONHASHSEED`` and
run OpenBLAS single-threaded (its idle threads spin a varying number of instructions) with the
garbage collector off: the same code then counts the same to within a few thousand instructions
a step, where timed runs scatter by 1-2 us. An import or an environment variable more moves the
count by up to ~4k (memory layout); compare counts made alike. 'ours' is the layer, 'bare' and
'floor' host_overhead.py's harnesses of the backend's ops alone and of an empty in-place
Function. Needs valgrind on PATH. Prints the figures (``--record``: into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys

from helpers import results

SHAPE = (8, 256, 128, 128)
WARM_STEPS = 40
LAYERS = ("ours", "bare", "floor")


def _child(layer: str, steps: int) -> None:
    """Under valgrind: ``WARM_STEPS`` steps, then ``steps`` more, of one layer."""
    import gc

    import host_overhead as harness
    import torch
    from helpers import stub_driver

    import encoding_syncbn

    harness._cache_freed_memory()
    stub_driver.activate()
    from encoding_syncbn.kernels.triton import ops as triton_ops

    torch.set_num_threads(1)
    encoding_syncbn.set_backend("triton")
    harness.StubLaunches(triton_ops)
    channels = SHAPE[1]
    module = {"ours": lambda: encoding_syncbn.SyncBatchNorm(channels, activation="leaky_relu"),
              "bare": lambda: harness._BareLayer(channels, triton_ops.EAGER),
              "floor": lambda: harness._FloorLayer(channels)}[layer]()
    like = torch.empty(SHAPE, dtype=torch.float16, requires_grad=True)
    dy = torch.empty(SHAPE, dtype=torch.float16)
    gc.disable()
    harness._steps([module], None, lambda: harness._Fresh.apply(like, False), dy,
                   WARM_STEPS + steps)


def _child_command(layer: str, steps: int) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--child", layer, str(steps)]


def _instructions(layer: str, steps: int) -> int:
    """Instructions of the whole process running ``steps`` steps after the warm ones."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        ["valgrind", "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
         *_child_command(layer, steps)], env=env, capture_output=True, text=True, check=False)
    found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"valgrind run of {layer!r} failed:\n{done.stderr[-2000:]}")
    return int(found.group(1).replace(",", ""))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=1000,
                        help="steps counted beyond the warm ones (default 1000)")
    parser.add_argument("--layers", nargs="+", choices=LAYERS, default=list(LAYERS),
                        help="which harnesses to count (default all)")
    parser.add_argument("--child", nargs=2, metavar=("LAYER", "STEPS"), help=argparse.SUPPRESS)
    results.add_arguments(parser)
    args = parser.parse_args()
    if args.child:
        _child(args.child[0], int(args.child[1]))
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH: this count needs it")
    rows = []
    for layer in args.layers:
        # Natively first: the kernels compiled (or found in Triton's cache) outside valgrind.
        subprocess.run(_child_command(layer, 0), check=True)
        per_step = (_instructions(layer, args.steps) - _instructions(layer, 0)) / args.steps
        rows.append([layer, round(per_step / 1000, 1)])
        print(f"{layer}: {per_step / 1000:.1f}k instructions a step", flush=True)
    table = results.markdown_table(["harness", "k instructions a step"], rows)
    print(table)
    results.record(args, "host_instructions.py (cpu)", table, notes=(
        f"Instructions per forward+backward of one layer, {SHAPE} float16 NCHW, on the Triton "
        "path, every launch through Triton's launcher to a stubbed cuLaunchKernelEx "
        "(host_overhead.py's harness), counted by valgrind's "
        f"cachegrind: a run of {WARM_STEPS} + {args.steps} steps minus one of {WARM_STEPS}, "
        "divided by the steps. PYTHONHASHSEED=0, OpenBLAS single-threaded, no garbage "
        "collection during the steps."))


if __name__ == "__main__":
    main()
