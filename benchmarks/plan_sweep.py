"""Each Triton op's GPU time under other launch-planner constants: what to tune, measured.

    python benchmarks/plan_sweep.py [--repeats 30] [--shapes 0 1] [--configs NAME ...]

For shapes of ``bandwidth.py``'s table and three more (``--shapes``: their indices in
:data:`SHAPES`, the first two by default), the passes over one activation (as there) timed with
the planner's constants as shipped and with one or two of them changed: elements a tile
(``_GPU_TILE_ELEMS``), warps a program (``_NUM_WARPS``, NCHW, and ``_NUM_WARPS_CHANNELS_LAST``),
programs an SM for reductions and elementwise passes, the rows a step of a split reduction's
merge and its merge in two levels, the tiles a step of the statistics' loop loads, the register
ceiling the kernels compile with (``maxnreg`` of ``COMPILE_OPTIONS``: ptxas under 255 registers
uses more than it picks alone, so fewer programs fit an SM). Median of ``--repeats`` calls timed
as there, in us, and each configuration's passes summed.
Needs a CUDA GPU. Prints its table (``--record``: into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import copy
import sys

import bandwidth
import torch
from bandwidth import _inputs, _ops, _time
from helpers import results
from helpers.plans import forget_plans

# bandwidth.py's shapes (0-4), then channels-last inputs of a segmentation network's smaller
# maps, their reductions split as many ways as the larger ones' with loops of a few tiles
# (2, 6 and 4 a program): where a split merge's steps weigh most against the loop.
SHAPES = [*bandwidth.SHAPES,
          ((2, 256, 64, 64), torch.float16, True),
          ((16, 128, 56, 56), torch.float16, True),
          ((4, 64, 128, 128), torch.bfloat16, True)]

# The register ceiling's key among the compile options every kernel takes (``None``: no
# ceiling). A configuration names it like a planner constant; the other options stay as shipped.
CEILING = "maxnreg"

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
    # Fewer programs split a channel block's reduction fewer ways: a shorter merge of their
    # partials by the last to finish, which reads them one step after another.
    "reductions 1 a SM": {"_REDUCE_PROGRAMS_PER_SM": 1},
    "reductions 2 a SM": {"_REDUCE_PROGRAMS_PER_SM": 2},
    # The merge in steps of a tile's lanes, not half: half as many steps, more registers.
    "merge steps of a tile": {"_MERGE_STEP_SHARE": 1},
    # The merge in one level, where it ships in two (each group of a step's rows by its last
    # program, then the groups' rows by the last group, ``partials.merge_split``): tens of
    # steps in a row where two levels take a few.
    "merge in one level": {"_MERGE_IN_GROUPS": False},
    "merge in one level, steps of a tile": {"_MERGE_IN_GROUPS": False, "_MERGE_STEP_SHARE": 1},
    # The statistics' loop with one, two or four tiles' loads in flight a step (half inputs;
    # three as shipped).
    "statistics 1 tile a step": {"_STATS_LOADS": 1},
    "statistics 2 tiles a step": {"_STATS_LOADS": 2},
    "statistics 4 tiles a step": {"_STATS_LOADS": 4},
    "reductions 8 a SM": {"_REDUCE_PROGRAMS_PER_SM": 8},
    "reductions 16 a SM": {"_REDUCE_PROGRAMS_PER_SM": 16},
    "4 warps, reductions 16 a SM": {"_NUM_WARPS": 4, "_NUM_WARPS_CHANNELS_LAST": 4,
                                    "_REDUCE_PROGRAMS_PER_SM": 16},
    # 8-warp channels_last programs take more than 64 registers a thread: three an SM.
    "8 warps, reductions 3 a SM": {"_NUM_WARPS": 8, "_NUM_WARPS_CHANNELS_LAST": 8,
                                   "_REDUCE_PROGRAMS_PER_SM": 3},
    # 4-warp NCHW reductions: more programs an SM (the statistics' take 80 registers a thread
    # at 4 warps: six fit).
    "4 warps, reductions 5 a SM": {"_NUM_WARPS": 4, "_REDUCE_PROGRAMS_PER_SM": 5},
    "4 warps, reductions 6 a SM": {"_NUM_WARPS": 4, "_REDUCE_PROGRAMS_PER_SM": 6},
    "4 warps, reductions 8 a SM": {"_NUM_WARPS": 4, "_REDUCE_PROGRAMS_PER_SM": 8},
    "tile 1024, 4 warps, reductions 8 a SM": {"_GPU_TILE_ELEMS": 1024, "_NUM_WARPS": 4,
                                              "_REDUCE_PROGRAMS_PER_SM": 8},
    # The same under a 64-register ceiling, which ptxas meets for the 4-warp statistics
    # without a spill (Triton 3.6, sm_90): eight an SM, the planned grid in one wave. The
    # ceiling holds for every kernel: only the statistics' columns answer (the backward's
    # kernels may spill under it).
    "4 warps, reductions 8 a SM, registers <= 64": {
        "_NUM_WARPS": 4, "_REDUCE_PROGRAMS_PER_SM": 8, "maxnreg": 64},
    # Channels-last statistics take more than 100 registers a thread at 4 warps (four
    # programs an SM). Under a 72-register ceiling seven fit an SM, float16's without a
    # spill, bfloat16's with a few bytes spilled; under 80 six, neither spilling (Triton 3.6,
    # sm_90). Only the channels-last statistics' columns answer (NCHW's 8-warp programs still
    # fit four an SM: a second wave).
    "reductions 7 a SM, registers <= 72": {"_REDUCE_PROGRAMS_PER_SM": 7, "maxnreg": 72},
    "reductions 6 a SM, registers <= 80": {"_REDUCE_PROGRAMS_PER_SM": 6, "maxnreg": 80},
    # Without the ceiling ptxas takes fewer registers than under 255 (Triton 3.6, sm_90):
    # 40 for the 8-warp NCHW statistics (six an SM, where 56 fit four), 56 for the 4-warp
    # ones (nine), 80 for the 4-warp channels-last ones (six, where 111 fit four). Every
    # kernel compiles without it: only the statistics' columns answer (the elementwise passes
    # keep their planned programs an SM).
    "reductions 6 a SM, no register ceiling": {
        "_REDUCE_PROGRAMS_PER_SM": 6, "maxnreg": None},
    "4 warps, reductions 8 a SM, no register ceiling": {
        "_NUM_WARPS": 4, "_REDUCE_PROGRAMS_PER_SM": 8, "maxnreg": None},
    "elementwise 64 a SM": {"_ELEMENTWISE_PROGRAMS_PER_SM": 64},
    "no register ceiling": {"maxnreg": None},
    "registers <= 128": {"maxnreg": 128},
}


def _get(plan, name: str):
    """A planner constant's value (a copy), or the register ceiling's."""
    if name == CEILING:
        return plan.COMPILE_OPTIONS.get(CEILING)
    return copy.copy(getattr(plan, name))


def _set(plan, name: str, value) -> None:
    """Set a planner constant, or the register ceiling in the compile options in place (the
    ops hold that dict)."""
    if name != CEILING:
        setattr(plan, name, value)
    elif value is None:
        plan.COMPILE_OPTIONS.pop(CEILING, None)
    else:
        plan.COMPILE_OPTIONS[CEILING] = value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--shapes", type=int, nargs="+", default=[0, 1],
                        choices=range(len(SHAPES)), help="indices into SHAPES")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS),
                        metavar="NAME", help="configurations to time (default: all)")
    results.add_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("plan_sweep.py times GPU kernels and needs a CUDA GPU: nothing measured")
        return 0
    from encoding_syncbn.kernels.triton import ops as T
    from encoding_syncbn.kernels.triton import plan

    configs = {label: CONFIGS[label] for label in args.configs}
    shipped = {name: _get(plan, name) for config in CONFIGS.values() for name in config}
    rows = []
    for shape, dtype, channels_last in (SHAPES[index] for index in args.shapes):
        x, dy, vec = _inputs(shape, dtype, channels_last)
        ops = _ops(T, x, dy, vec, torch.empty_like(x))
        layout = "channels_last" if channels_last else "nchw"
        for label, config in configs.items():
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
    # A subset's table goes into a section of its own, not over the whole sweep's.
    subset = "" if args.shapes == [0, 1] and len(configs) == len(CONFIGS) else (
        f", shapes {' '.join(map(str, args.shapes))}, {len(configs)} configurations")
    results.record(args, f"plan_sweep.py ({gpu}{subset})", table, gpu=gpu, notes=(
        f"us per call, median of {args.repeats} (CUDA events behind a spin kernel), "
        f"leaky_relu, in place; the planner as shipped: tile "
        f"{shipped.get('_GPU_TILE_ELEMS')} elements, "
        f"{shipped.get('_NUM_WARPS')} warps (channels_last "
        f"{shipped.get('_NUM_WARPS_CHANNELS_LAST')}), {shipped.get('_REDUCE_PROGRAMS_PER_SM')} "
        f"reduction / {shipped.get('_ELEMENTWISE_PROGRAMS_PER_SM')} elementwise programs "
        f"an SM, compile options {plan.COMPILE_OPTIONS}."))
    return 0


if __name__ == "__main__":
    sys.exit(main())
