"""Host time of Triton's own launcher per launch of a layer call, down to the driver's launch.

    python benchmarks/launch_overhead.py [--iters 5000] [--repeats 5]

``host_overhead.py`` times a whole layer call; this script times its launches one by one:
each launch of one single-replica training call, (8, 256, 128, 128) fp16 NCHW in place with
leaky_relu, planned for sm_90 with 132 SMs, called as the ops call it (``kernel[grid](...)``)
on CPU tensors, through Triton's ``JITFunction.run`` (binding and specialising the arguments,
the cache key, the check of the constexpr globals the kernel reads, launch metadata) and its
C launcher (each argument extracted, each pointer checked) to the driver's
``cuLaunchKernelEx``: ``stub_driver.py``'s stand-in, which answers as an H100 and whose launch
returns at once (the driver's own work inside a launch is not counted). The kernels are
compiled for sm_90 on the CPU on first use (Triton's cache keeps them). Times are thread CPU
time, the fastest of ``--repeats`` means. Prints the table (``--record``:
into benchmarks/RESULTS.md too); the last line is one JSON object with ``launcher_us_per_call``
and ``launches``.
"""

from __future__ import annotations

import argparse
import json
import time

import host_overhead
import results
import stub_driver
import torch

# host_overhead.py's headline case: (8, 256, 128, 128) float16 NCHW.
SHAPE, DTYPE, _ = host_overhead.SHAPES[0]
C = SHAPE[1]
H100_SMS = stub_driver.H100_SMS


def planned_launches():
    """The launches of one single-replica in-place training call of the layer, in order:
    recorded from a real forward+backward on CPU tensors (``host_overhead.py``'s routing of
    them to the Triton backend)."""
    import encoding_syncbn
    from encoding_syncbn.kernels.triton import ops as triton_ops

    encoding_syncbn.set_backend("triton")
    launcher = host_overhead.StubLaunches(triton_ops)
    recorded, run = [], launcher.run

    def record(planned, device):
        recorded.extend(planned)
        run(planned, device)

    launcher.run = record
    layer = encoding_syncbn.SyncBatchNorm(C, activation="leaky_relu")
    like = torch.empty(SHAPE, dtype=DTYPE, requires_grad=True)
    layer(host_overhead._Fresh.apply(like, False)).backward(torch.empty(SHAPE, dtype=DTYPE))
    launcher.run = run
    return recorded


def launch_step(launch):
    """``launch`` as the ops launch it (``ops._run``), ready to time."""
    kernel, grid, args, constexprs = launch.kernel, launch.grid, launch.args, launch.constexprs
    num_warps = launch.num_warps
    from encoding_syncbn.kernels.triton.plan import COMPILE_OPTIONS  # (--help needs no triton)

    def step():
        kernel[grid](*args, **constexprs, num_warps=num_warps, **COMPILE_OPTIONS)

    step()  # compiled (or found in Triton's cache) and loaded here, not timed
    return step


def time_us(step, iters: int, repeats: int) -> float:
    best = float("inf")
    for _ in range(repeats):
        start = time.thread_time()
        for _ in range(iters):
            step()
        best = min(best, (time.thread_time() - start) / iters * 1e6)
    return best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=5000, help="launches per repeat")
    parser.add_argument("--repeats", type=int, default=5,
                        help="repeats; the fastest is reported (default 5)")
    results.add_arguments(parser)
    args = parser.parse_args()
    stub = stub_driver.activate(H100_SMS)  # imports triton: after --help
    steps = [(launch, launch_step(launch)) for launch in planned_launches()]
    rows = []
    for launch, step in steps:
        name = launch.kernel.fn.__name__
        before = stub.launches()
        step()
        if stub.launches() != before + 1:
            raise SystemExit(f"{name}: the launch did not reach the driver's cuLaunchKernelEx")
        rows.append([name, len(launch.args), round(time_us(step, args.iters, args.repeats), 2)])
        print(" ".join(str(cell) for cell in rows[-1]), flush=True)
    total = round(sum(row[2] for row in rows), 1)
    table = results.markdown_table(["kernel", "arguments", "launch us"], rows)
    table += f"\n\nPer layer call ({len(rows)} launches): {total} us."
    print(table)
    import triton

    results.record(args, f"launch_overhead.py (cpu, triton {triton.__version__})", table, notes=(
        "Triton's launcher per launch of one single-replica in-place training call "
        f"{SHAPE} fp16 NCHW, leaky_relu, planned for sm_90 with {H100_SMS} SMs, called as the "
        "ops call it (kernel[grid](...), CPU tensors): JITFunction.run and the C launcher down "
        "to the driver's cuLaunchKernelEx, stubbed (benchmarks/stub_driver.py: the driver's own "
        "work inside a launch is not counted). Thread CPU time, the fastest of "
        f"{args.repeats} means over {args.iters} launches. host_overhead.py's figures include "
        "these launches."))
    print(json.dumps({"launcher_us_per_call": total, "launches": len(rows)}))


if __name__ == "__main__":
    main()
