"""Machine instructions per element in each Triton kernel's tile loop, from SASS (no GPU).

Read from sm_90 SASS compiled here, no GPU needed.

    python benchmarks/kernel_instructions.py [--arch 90]

For one training call's launches (planned for a 132-SM H100: (8, 256, 128, 128) fp16 NCHW,
(32, 64, 56, 56) fp16 channels_last and (8, 1024, 14, 14) fp16 NCHW, whose 196-position rows
are a multiple of 4 elements, not of 16; in place with leaky_relu), each kernel that walks the
input tile by tile is compiled as the AOT check compiles it (``tools/check_kernels.py``) and its
SASS disassembled (cuobjdump). The tile loop is the backward branch around the global loads; printed
per kernel: its instructions, the elements a thread takes from a tile (tile elements over
threads), the tiles an iteration takes (more than one where the compiler unrolled the loop: the
bytes its global loads and stores move say how many), instructions per element and per byte the
loop moves (reads and writes of the input's dtype), the bytes of its widest load (16: a
thread's 8 elements in one vector load; 2: one element a load), and the multi-function-unit
(division, exp), shuffle and barrier instructions inside it. A kernel whose loop issues many
instructions per byte is bound by issuing them, not by memory: a ranking of where a GPU's
bandwidth goes, before a profiler on the GPU says how much. The statistics kernel is planned
as an in-place layer trains (running statistics, the small-gamma check); a split reduction's
merge of its partials is no tile loop. Prints the table (``--record``: into
benchmarks/RESULTS.md too); the last line is one JSON object with
``statistics_instructions_per_byte`` (the largest over the layouts) and each kernel's figures
(``per_byte``, ``load_bytes``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path

from helpers import results

# The kernels must be Triton's JIT functions, compiled, not the interpreter's stand-ins.
os.environ.pop("TRITON_INTERPRET", None)
# The AOT check's compile helpers.
sys.path.append(str(Path(__file__).resolve().parent.parent / "tools"))

# (shape, channels_last): the host harness's first two shapes, and a small map with many
# channels (NCHW tiles of rows of channels), float16.
SHAPES = [((8, 256, 128, 128), False), ((32, 64, 56, 56), True), ((8, 1024, 14, 14), False)]
H100_SMS = 132
# "/*0a40*/   @!P0 BRA 0x5c0 ;": address, predicate, opcode and operands of one instruction.
_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def _instructions(sass: str) -> list[tuple[int, str, str]]:
    return [(int(addr, 16), op, operands.strip())
            for addr, op, operands in _INSTRUCTION.findall(sass)]


def _tile_loop(instructions: list[tuple[int, str, str]]) -> list[str]:
    """The opcodes of the widest backward branch's span that loads the input: a global load
    other than the ``.STRONG.GPU`` ones (``ld.global.cg``) with which a split reduction's last
    program reads the other programs' partials."""
    best: list[str] = []
    for addr, op, operands in instructions:
        if op != "BRA" or not operands.startswith("0x"):
            continue
        target = int(operands.split()[0], 16)
        if target >= addr:
            continue
        body = [o for a, o, _ in instructions if target <= a <= addr]
        if (any(o.startswith("LDG") and ".STRONG" not in o for o in body)
                and len(body) > len(best)):
            best = body
    return best


# Bytes one thread moves with a global load or store, by the opcode's width suffix (none: 32
# bits).
_WIDTHS = {"128": 16, "64": 8, "U16": 2, "S16": 2, "U8": 1, "S8": 1}


def _load_width(loop: list[str]) -> int:
    """Bytes of the widest global load in the loop (vector loads: 8 or 16)."""
    return max(_width(op) for op in loop if op.startswith("LDG"))


def _width(op: str) -> int:
    return next((w for suffix, w in _WIDTHS.items() if op.endswith("." + suffix)), 4)


def _bytes_moved(loop: list[str]) -> int:
    """Bytes one thread loads and stores through the loop's global memory instructions."""
    return sum(_width(op) for op in loop if op.startswith(("LDG", "STG")))


def _sass(launch, arch: int) -> str:
    from check_kernels import compile_spec, cuobjdump, launch_spec

    return cuobjdump(compile_spec(launch_spec("", launch), arch).asm["cubin"], "-sass")


def _launches(shape: tuple[int, ...], channels_last: bool):
    """``(name, launch, tensors moved per element)`` of the tile-walking kernels."""
    import torch

    from encoding_syncbn.kernels import BatchSums, NormParams
    from encoding_syncbn.kernels.triton.backward_dx import plan_backward_dx
    from encoding_syncbn.kernels.triton.backward_reduce import plan_backward_reduce
    from encoding_syncbn.kernels.triton.channel_stats import plan_batch_stats
    from encoding_syncbn.kernels.triton.normalize_act import plan_normalize_act
    from encoding_syncbn.kernels.triton.plan import Target

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.empty(shape, dtype=torch.float16, device="meta", memory_format=fmt)
    v = torch.empty(shape[1], dtype=torch.float32, device="meta")
    params = NormParams(v, v, v, v, "leaky_relu", 0.01)
    target = Target(False, H100_SMS)
    count = x.numel() // shape[1]
    batches = torch.empty((), dtype=torch.int64, device="meta")
    # As an in-place layer trains: running statistics, its counter, the small-gamma check.
    stats = plan_batch_stats(x, 1e-5, v, v, batches, 0.1, v, v, 0.016, target)[0][0]
    return [
        ("statistics", stats, 1),
        ("normalize", plan_normalize_act(x, params, x, target)[0][0], 2),
        ("backward reduce", plan_backward_reduce(x, x, *params, True, target)[0][0], 2),
        ("backward dx",
         plan_backward_dx(x, x, params, True, BatchSums(v, v, count), target)[0][0], 3),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="SM architecture (default 90)")
    results.add_arguments(parser)
    args = parser.parse_args()
    header = ["shape", "layout", "kernel", "tile", "loop instructions", "elements a thread",
              "tiles an iteration", "instructions an element", "instructions a byte",
              "bytes a load", "MUFU", "SHFL", "BAR"]
    rows = []
    for shape, channels_last in SHAPES:
        for name, launch, tensors in _launches(shape, channels_last):
            loop = _tile_loop(_instructions(_sass(launch, args.arch)))
            block_a, block_b = launch.constexprs["BLOCK_A"], launch.constexprs["BLOCK_B"]
            layout = ("channels_last" if channels_last else
                      "nchw, rows of channels" if launch.constexprs["CHANNEL_ROWS"] else "nchw")
            if not loop:
                # One tile a program: the tile count (1) is specialised and the loop is gone.
                if launch.args[-1] != 1:
                    raise SystemExit(f"{name}: no tile loop found in its SASS")
                rows.append([str(shape), layout, name, f"{block_a}x{block_b}",
                             "none (one tile a program)", *["-"] * 8])
                print(" ".join(str(cell) for cell in rows[-1]), flush=True)
                continue
            per_thread = block_a * block_b // (32 * launch.num_warps)
            # The compiler may unroll the loop: its loads and stores say over how many tiles.
            unrolled = _bytes_moved(loop) / (per_thread * 2 * tensors)
            per_element = len(loop) / (per_thread * unrolled)
            rows.append([str(shape), layout, name,
                         f"{block_a}x{block_b}", len(loop), per_thread, round(unrolled, 2),
                         round(per_element, 1), round(per_element / (2 * tensors), 1),
                         _load_width(loop), *(sum(op.startswith(unit) for op in loop)
                           for unit in ("MUFU", "SHFL", "BAR"))])
            print(" ".join(str(cell) for cell in rows[-1]), flush=True)
    table = results.markdown_table(header, rows)
    print(table)
    statistics = max(row[8] for row in rows if row[2] == "statistics")
    results.record(args, "kernel_instructions.py (cpu)", table, notes=(
        f"SASS for sm_{args.arch} compiled on this CPU (no GPU), launches planned for a "
        f"{H100_SMS}-SM H100, float16 inputs: the instructions in each kernel's tile loop, per "
        "element a thread takes an iteration and per byte the loop reads and writes (2 bytes "
        "an element per tensor moved: statistics 1, normalize and reduce 2, dx 3). Bytes a "
        "load: the widest global load a thread issues in the loop (16: 8 float16 values at "
        "once). MUFU: reciprocals (divisions), exponentials; SHFL, BAR: cross-thread "
        "reductions."))
    print(json.dumps({"statistics_instructions_per_byte": statistics,
                      "per_byte": {f"{row[2]} {row[1]}": row[8] for row in rows},
                      "load_bytes": {f"{row[2]} {row[1]}": row[9] for row in rows}}))


if __name__ == "__main__":
    main()
