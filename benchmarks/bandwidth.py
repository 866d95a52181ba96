"""Effective memory bandwidth of each Triton op on a GPU, against the device's peak.

    python benchmarks/bandwidth.py [--peak-gbps GBPS] [--repeats 50]

For each shape and op: the Triton launches of one call, and the bytes the op must move
(channel_stats and batch_stats read x; normalize_act and normalize_running read x and write y;
backward_reduce reads y and dy; backward_dx reads y and dy and writes dx; batch_backward both;
then torch's own batch_norm and leaky_relu, forward and backward, for comparison) over its
median time (CUDA events around the call, queued behind a spin kernel so that the host's
planning and launching do not count; after a warm-up), in GB/s and as a share of ``--peak-gbps``
(default: this device's own copy rate, measured first in the same run: a 1 GiB device-to-device
copy, bytes read and written over its median time, the ceiling an op that reads and writes
memory can reach here).
Needs a CUDA GPU: without one it says so and exits (0, nothing recorded).
Prints its table (``--record``: into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
from helpers import results
from helpers.launches import counted_launches

SHAPES = [
    ((8, 256, 128, 128), torch.float16, False),
    ((8, 256, 128, 128), torch.float16, True),
    ((32, 64, 112, 112), torch.bfloat16, True),
    ((8, 1024, 14, 14), torch.float32, False),
    ((64, 2048, 7, 7), torch.float16, True),
]
# Elements read or written per element of the activation: ours, then what torch's own
# BatchNorm (cuDNN) and leaky_relu do for the same layer, counted the same way (a two-pass
# forward 3, a backward 5; the activation 2 and 3).
TRAFFIC = {"channel_stats": 1, "batch_stats": 1, "normalize_act": 2, "normalize_running": 2,
           "backward_reduce": 2, "backward_dx": 3, "batch_backward": 5, "torch batch_norm": 3,
           "torch batch_norm backward": 5, "torch leaky_relu": 2, "torch leaky_relu backward": 3}


def _ops(T, x, dy, vec, out):
    """The passes over one activation (leaky_relu, rebuilt from the output in backward), as a
    training layer calls them: the statistics of a replica of a synchronised layer
    (channel_stats: the same loop as batch_stats, its finishing left to the merge), then a
    single replica's batch_stats with running statistics and the small-gamma check;
    evaluation's normalize_running; the backward's two ops alone and as one batch_backward."""
    from encoding_syncbn.kernels import (
        DxCoefs,
        GammaCheck,
        NormParams,
        RunningParams,
        RunningStats,
    )

    c = x.shape[1]
    running = RunningStats(torch.zeros(c, device=x.device), torch.ones(c, device=x.device),
                           torch.zeros((), dtype=torch.long, device=x.device), 0.1)
    params = NormParams(*vec, "leaky_relu", 0.01)
    evaluation = RunningParams(running.mean, running.var, 1e-5, *vec[2:], "leaky_relu", 0.01)
    check = GammaCheck(*vec[2:], 0.016)
    coefs = DxCoefs(*vec[:3])
    count = x.numel() // c
    B = T.EAGER
    return {
        "channel_stats": lambda: B.channel_stats(x),
        "batch_stats": lambda: B.batch_stats(x, 1e-5, running, check),
        "normalize_act": lambda: B.normalize_act(x, params, out),
        "normalize_running": lambda: B.normalize_running(x, evaluation, out),
        "backward_reduce": lambda: B.backward_reduce(out, dy, params, True),
        "backward_dx": lambda: B.backward_dx(out, dy, params, True, coefs),
        "batch_backward": lambda: B.batch_backward(out, dy, params, True, count),
    }


def _launches(fn) -> int:
    """The Triton launches of one call of ``fn`` (``helpers.launches``: by every path)."""
    with counted_launches() as names:
        fn()
    return len(names)


# GPU cycles of a spin kernel queued before each timed call (~2.5 ms at 2 GHz): the host plans
# and launches the call while the GPU spins, so the events time the kernels alone, not the
# host's time between them (which host_overhead.py and host_profile.py measure).
_SPIN_CYCLES = 5_000_000


def _inputs(shape, dtype, channels_last):
    """An activation in its layout, a gradient like it, and (mean, invstd, weight, bias)."""
    from encoding_syncbn.kernels import torch_ops

    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(shape, device="cuda", dtype=dtype).to(memory_format=fmt)
    acc = torch_ops.stats_dtype(dtype)
    vec = [torch.rand(shape[1], device="cuda", dtype=acc) + 0.5 for _ in range(4)]
    return x, torch.randn_like(x), vec


def _torch_ops(x, dy):
    """The same layer as torch computes it: ``torch.batch_norm`` (training) and leaky_relu."""
    c = x.shape[1]
    x = x.detach().requires_grad_()
    weight = torch.ones(c, device=x.device, requires_grad=True)
    bias = torch.zeros(c, device=x.device, requires_grad=True)

    def forward():
        return torch.batch_norm(x, weight, bias, None, None, True, 0.1, 1e-5, True)

    z = forward()
    y = torch.nn.functional.leaky_relu(z, 0.01)
    return {
        "torch batch_norm": forward,
        "torch batch_norm backward": lambda: torch.autograd.grad(z, (x, weight, bias), dy,
                                                                 retain_graph=True),
        "torch leaky_relu": lambda: torch.nn.functional.leaky_relu(z, 0.01),
        "torch leaky_relu backward": lambda: torch.autograd.grad(y, z, dy, retain_graph=True),
    }


def _time(fn, repeats: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(_SPIN_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def _copy_rate(repeats: int) -> float:
    """GB/s of a 1 GiB device-to-device copy (bytes read and written), median of ``repeats``."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    seconds = _time(lambda: dst.copy_(src), repeats)
    return 2 * (1 << 30) / seconds / 1e9


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--peak-gbps", type=float, default=None,
                        help="the device's peak memory bandwidth (default: its measured "
                             "device-to-device copy rate)")
    parser.add_argument("--repeats", type=int, default=50,
                        help="timed calls per op and shape; the median is reported (default 50)")
    results.add_arguments(parser)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bandwidth.py measures GPU kernels and needs a CUDA GPU; none is visible here "
              "(torch.cuda.is_available() is False): nothing measured, nothing recorded")
        return 0
    from encoding_syncbn.kernels.triton import ops as T
    from encoding_syncbn.kernels.triton.plan import INTERPRET

    if INTERPRET:
        print("TRITON_INTERPRET is set: unset it to time the compiled kernels", file=sys.stderr)
        return 2
    name = torch.cuda.get_device_name()
    measured = args.peak_gbps is None
    if measured:
        args.peak_gbps = _copy_rate(args.repeats)
    peak = f"{args.peak_gbps:.0f} GB/s" + (" (this device's copy rate)" if measured else "")
    print(f"device: {name}; peak {peak}")
    rows = []
    for shape, dtype, channels_last in SHAPES:
        x, dy, vec = _inputs(shape, dtype, channels_last)
        ops = {**_ops(T, x, dy, vec, torch.empty_like(x)), **_torch_ops(x, dy)}
        layout = "channels_last" if channels_last else "nchw"
        for op, fn in ops.items():
            seconds = _time(fn, args.repeats)
            launches = _launches(fn) if not op.startswith("torch") else None
            gbps = TRAFFIC[op] * x.numel() * x.element_size() / seconds / 1e9
            row = {"device": name, "shape": list(shape), "dtype": str(dtype).split(".")[1],
                   "layout": layout, "op": op, "launches": launches,
                   "us": round(seconds * 1e6, 1), "gbps": round(gbps, 1),
                   "of_peak": round(gbps / args.peak_gbps, 3)}
            rows.append(row)
            print(f"{str(shape):>20} {row['dtype']:>8} {layout:>13} {op:>17} "
                  f"{'-' if launches is None else launches:>2} {row['us']:9.1f} us "
                  f"{gbps:8.1f} GB/s {100 * row['of_peak']:5.1f}%")
    table = results.markdown_table(
        ["shape", "dtype", "layout", "op", "launches", "us", "GB/s", "of peak"],
        [[str(tuple(r["shape"])), r["dtype"], r["layout"], r["op"],
          "-" if r["launches"] is None else r["launches"], r["us"], r["gbps"], r["of_peak"]]
         for r in rows])
    results.record(args, f"bandwidth.py ({name})", table,
                   notes=f"Bytes each op must move over its median time (CUDA events "
                         f"behind a spin kernel, "
                         f"{args.repeats} calls after a warm-up), against a peak of "
                         f"{peak}.", gpu=name)
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
