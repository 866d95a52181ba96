"""Host time of Triton's own launcher per launch of a layer call, down to the driver's launch.

    python benchmarks/launch_overhead.py [--iters 5000] [--repeats 5]

``host_overhead.py`` times a whole layer call; this script times its launches one by one:
each launch of one single-replica training call, (8, 256, 128, 128) fp16 NCHW in place with
leaky_relu, planned for sm_90 with 132 SMs, on CPU tensors, two ways: through Triton's public
launch (``kernel[grid](...)``: ``JITFunction.run`` binding and specialising the arguments, the
cache key, the check of the constexpr globals the kernel reads, launch metadata), and as the
ops launch it (``kernels/triton/launch.py``: the compiled kernel called directly once seen).
Both end in Triton's C launcher (each argument extracted, each pointer checked) and the
driver's ``cuLaunchKernelEx``: ``stub_driver.py``'s stand-in, which answers as an H100 and
whose launch returns at once (the driver's own work inside a launch is not counted). The
kernels are compiled for sm_90 on the CPU on first use (Triton's cache keeps them). Times are
thread CPU time, the fastest of ``--repeats`` means. Prints the table (``--record``: into
benchmarks/RESULTS.md too); the last line is one JSON object with ``launcher_us_per_call`` (as
the ops launch), ``public_launcher_us_per_call`` and ``launches``.
"""

from __future__ import annotations

import argparse
import json
import time

import host_overhead
import torch
from helpers import results, stub_driver

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


def launch_steps(planned):
    """``planned`` launched through Triton's public launch (``kernel[grid](...)``), and as the
    ops launch it (``launch.launch``: its compiled kernel directly once seen), ready to time."""
    from encoding_syncbn.kernels.triton import launch  # (--help needs no triton)

    def public():
        launch.public(planned)

    def ops():
        launch.launch(planned, None)

    ops()  # compiled (or found in Triton's cache), loaded and remembered here, not timed
    if launch.compiled_for(planned, None) is None:
        raise SystemExit(f"{planned.kernel.fn.__name__}: no direct launch with this Triton")
    return public, ops


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
    rows = []
    for planned in planned_launches():
        name = planned.kernel.fn.__name__
        row = [name, len(planned.args)]
        for step in launch_steps(planned):
            before = stub.launches()
            step()
            if stub.launches() != before + 1:
                raise SystemExit(f"{name}: the launch did not reach the driver's "
                                 "cuLaunchKernelEx")
            row.append(round(time_us(step, args.iters, args.repeats), 2))
        rows.append(row)
        print(" ".join(str(cell) for cell in row), flush=True)
    public, direct = (round(sum(row[i] for row in rows), 1) for i in (2, 3))
    table = results.markdown_table(["kernel", "arguments", "public launch us",
                                    "direct launch us"], rows)
    table += (f"\n\nPer layer call ({len(rows)} launches): {public} us through Triton's public "
              f"launch, {direct} us as the ops launch (the compiled kernel directly).")
    print(table)
    import triton

    results.record(args, f"launch_overhead.py (cpu, triton {triton.__version__})", table, notes=(
        "Triton's launcher per launch of one single-replica in-place training call "
        f"{SHAPE} fp16 NCHW, leaky_relu, planned for sm_90 with {H100_SMS} SMs, CPU tensors: "
        "through Triton's public launch (kernel[grid](...): JITFunction.run), and as the ops "
        "launch it (kernels/triton/launch.py: the compiled kernel directly), each down to the "
        "driver's cuLaunchKernelEx, stubbed (benchmarks/stub_driver.py: the driver's own work "
        "inside a launch is not counted). Thread CPU time, the fastest of "
        f"{args.repeats} means over {args.iters} launches. host_overhead.py's figures include "
        "the launches as the ops launch them."))
    print(json.dumps({"launcher_us_per_call": direct, "public_launcher_us_per_call": public,
                      "launches": len(rows)}))


if __name__ == "__main__":
    main()
