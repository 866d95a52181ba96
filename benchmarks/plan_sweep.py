"""Each Triton op's GPU time under other launch-planner constants: what to tune, measured.

    python benchmarks/plan_sweep.py [--repeats 30]

For the shapes of ``bandwidth.py``'s first rows, the four passes over one activation (as there)
timed with the planner's constants as shipped and with one or two of them changed: elements a
tile (``_GPU_TILE_ELEMS``), warps a program (``_NUM_WARPS``, NCHW, and
``_NUM_WARPS_CHANNELS_LAST``), programs an SM for reductions and elementwise passes, the
register ceiling the kernels compile with (``COMPILE_OPTIONS``:
ptxas under 255 registers uses more than it picks alone, so fewer programs fit an SM).
Median of ``--repeats`` calls timed as there, in us, and each configuration's four passes
summed. Needs a CUDA GPU. Prints its table (``--record``: into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import copy
import sys

import torch
from bandwidth import SHAPES, _inputs, _ops, _time
from helpers import results
from helpers.plans import forget_plans

# Name -> the planner constants it changes (the rest as shipped).
CONFIGS = {
    "as shipped": {},
    "4 warps": {"_NUM_WARPS": 4, "_NUM_WARPS_CHANNELS_LAST": 4},
    "8 warps": {"_NUM_WARPS": 8, "_NUM_WARPS_CHANNELS_LAST": 8},
    "tile 1024, 4 warps": {"_GPU_TILE_ELEMS": 1024, "_NUM_WARPS": 4,
                           "_NUM_WARPS_CHANNELS_LAST": 4},
    "tile 4096": {"_GPU_TILE_ELEMS": 4096},
    "tile 4096, 4 warps": {"_GPU_TILE_ELEMS": 4096, "_NUM_WARPS": 4,
                           "_NUM_WARPS_CHANNELS_LAST": 4},
    "reductions 8 a SM": {"_REDUCE_PROGRAMS_PER_SM": 8},
    "reductions 16 a SM": {"_REDUCE_PROGRAMS_PER_SM": 16},
    "4 warps, reductions 16 a SM": {"_NUM_WARPS": 4, "_NUM_WARPS_CHANNELS_LAST": 4,
                                    "_REDUCE_PROGRAMS_PER_SM": 16},
    "elementwise 64 a SM": {"_ELEMENTWISE_PROGRAMS_PER_SM": 64},
    "no register ceiling": {"COMPILE_OPTIONS": {"enable_fp_fusion": True}},
    "registers <= 128": {"COMPILE_OPTIONS": {"enable_fp_fusion": True, "maxnreg": 128}},
}


def _set(plan, name: str, value) -> None:
    """Set a planner constant; the compile options in place (the ops hold that dict)."""
    if name == "COMPILE_OPTIONS":
        plan.COMPILE_OPTIONS.clear()
        plan.COMPILE_OPTIONS.update(value)
    else:
        setattr(plan, name, value)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    results.add_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("plan_sweep.py times GPU kernels and needs a CUDA GPU: nothing measured")
        return 0
    from encoding_syncbn.kernels.triton import ops as T
    from encoding_syncbn.kernels.triton import plan

    shipped = {name: copy.copy(getattr(plan, name))
               for config in CONFIGS.values() for name in config}
    rows = []
    for shape, dtype, channels_last in SHAPES[:2]:
        x, dy, vec = _inputs(shape, dtype, channels_last)
        ops = _ops(T, x, dy, vec, torch.empty_like(x))
        layout = "channels_last" if channels_last else "nchw"
        for label, config in CONFIGS.items():
            for name, value in {**shipped, **config}.items():
                _set(plan, name, value)
            forget_plans()
            us = [round(_time(fn, args.repeats) * 1e6, 1) for fn in ops.values()]
            rows.append([f"{shape} {str(dtype)[6:]} {layout}", label, *us, round(sum(us), 1)])
            print(" | ".join(map(str, rows[-1])), flush=True)
    for name, value in shipped.items():
        _set(plan, name, value)
    table = results.markdown_table(["input", "planner", *ops, "sum"], rows)
    print(table)
    gpu = torch.cuda.get_device_name()
    results.record(args, f"plan_sweep.py ({gpu})", table, gpu=gpu, notes=(
        f"us per call, median of {args.repeats} (CUDA events behind a spin kernel), "
        f"leaky_relu, in place; the planner as shipped: tile "
        f"{shipped.get('_GPU_TILE_ELEMS')} elements, "
        f"{shipped.get('_NUM_WARPS')} warps (channels_last "
        f"{shipped.get('_NUM_WARPS_CHANNELS_LAST')}), {shipped.get('_REDUCE_PROGRAMS_PER_SM')} "
        f"reduction / {shipped.get('_ELEMENTWISE_PROGRAMS_PER_SM')} elementwise programs "
        f"an SM, compile options {shipped.get('COMPILE_OPTIONS')}."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
