"""Where a layer call's host time goes, with real launches: per-call time and a profile.

    python benchmarks/host_profile.py --device cuda [--shape 2 256 8 8] [--calls 200]

One in-place ``SyncBatchNorm(C, activation="leaky_relu")`` on one replica, forward and backward
of ``--calls`` calls in a row on one input, the device synchronised only at the end: where the
GPU finishes each call's work sooner than the host issues the next (a small input), the time per
call is the host's. Printed: that time for the Triton (on a GPU) and the torch backends and for
``nn.BatchNorm2d`` + ``F.leaky_relu`` (taking turns, best of ``--repeats``; ``--record``: into
benchmarks/RESULTS.md too); then the first backend's calls under
cProfile (the calling thread: on a GPU autograd runs backward on a thread of its own) and
under torch's profiler (every thread: ATen ops, the layer's registered ops,
the CUDA runtime's and driver's calls), printed only (``--top 0``: no profile).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

from helpers import results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda or cpu (default: %(default)s)")
    parser.add_argument("--shape", type=int, nargs="+", default=[2, 256, 8, 8])
    parser.add_argument("--dtype", default="float16", choices=("float32", "float16", "bfloat16"))
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--top", type=int, default=30, help="profile rows (default 30)")
    results.add_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    import torch.nn.functional as F
    from helpers.timing import synchronize

    import encoding_syncbn
    from encoding_syncbn import SyncBatchNorm

    device = torch.device(args.device)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    x0 = torch.randn(args.shape, device=device, dtype=getattr(torch, args.dtype))
    dy = torch.randn_like(x0)
    leaf = torch.zeros((), device=device, requires_grad=True)
    ours = SyncBatchNorm(args.shape[1], activation="leaky_relu", slope=0.01).to(device)
    plain = torch.nn.BatchNorm2d(args.shape[1]).to(device)

    def layer(backend: str):
        def call() -> None:
            encoding_syncbn.set_backend(backend)
            ours(x0 + leaf).backward(dy)
        return call

    def plain_call() -> None:
        F.leaky_relu(plain(x0 + leaf), 0.01, inplace=True).backward(dy)

    # Triton's kernels need a GPU here (the interpreter's times would say nothing).
    backends = ["triton", "torch"] if device.type == "cuda" else ["torch"]
    variants = {name: layer(name) for name in backends}
    variants["nn.BatchNorm2d + leaky_relu"] = plain_call

    def per_call_us(call) -> float:
        synchronize(device)
        start = time.perf_counter()
        for _ in range(args.calls):
            call()
        synchronize(device)
        return (time.perf_counter() - start) / args.calls * 1e6

    for call in variants.values():  # warm-up: compilation, caches, allocator
        per_call_us(call)
    best = {name: float("inf") for name in variants}
    for _ in range(args.repeats):
        for name, call in variants.items():
            best[name] = min(best[name], per_call_us(call))
    print(f"{tuple(args.shape)} {args.dtype} on {device.type}"
          + (f" ({gpu})" if gpu else "")
          + f": forward+backward per call, best of {args.repeats} x {args.calls} calls, us")
    for name, us in best.items():
        print(f"  {name:30s} {us:8.1f}")
    table = results.markdown_table(["layer", "us per forward+backward call"],
                                   [[name, round(us, 1)] for name, us in best.items()])
    size = "x".join(map(str, args.shape)) + " " + args.dtype
    results.record(args, f"host_profile.py ({device.type}, {size})", table, gpu=gpu, notes=(
        f"One in-place layer, one replica: {args.calls} forward+backward calls in a row, the "
        f"device synchronised at the end, best of {args.repeats}; the backends and "
        f"`nn.BatchNorm2d` + `F.leaky_relu` taking turns."))
    if args.top <= 0:
        return
    profile = cProfile.Profile()
    profile.runcall(per_call_us, variants[backends[0]])
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        per_call_us(variants[backends[0]])
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))


if __name__ == "__main__":
    main()
