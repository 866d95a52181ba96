"""Host time per layer call of the Triton path: planning, ATen calls and autograd, no kernels.

    python benchmarks/host_overhead.py [--iters 200] [--repeats 5]

Runs ``SyncBatchNorm(C, activation="leaky_relu")`` (in place, one replica, training) with the
Triton backend on CPU tensors, the kernel launches replaced by no-ops and the launch planner
told it plans for a 132-SM GPU (an H100 SXM), so what is timed is everything the host does for
a layer call except the launches themselves (Triton's launcher adds its own cost per launch:
counted in ``launches``, not timed). The input is a fresh uninitialised non-leaf tensor per
call (made outside the timed region; nothing reads its values).

Times are this thread's CPU time (``time.thread_time``; CPU backward runs on the calling
thread): on a shared machine the time spent waiting for a core is not counted, but contention
for caches still inflates it, so the fastest of ``--repeats`` is reported. Prints, per shape,
the host microseconds of the forward, the backward and their sum (the
fastest of ``--repeats`` means over ``--iters`` calls), of that the part spent inside the
Triton backend's four ops (planning, allocating outputs, launching: timed in a separate pass
with the ops wrapped, so the other columns carry no timer), the Triton launches and the ATen ops
outside the four ops per forward+backward. On the CPU the ops' part includes ``torch.empty_like``
of dx, an mmap of the whole activation (~30 us at 64 MiB here); a GPU's caching allocator
serves it in a few us. The table goes to benchmarks/RESULTS.md (``--no-record``: print only);
the last line is one JSON object with ``host_us_fwd_bwd`` for (8, 256, 128, 128) float16 NCHW.
"""

from __future__ import annotations

import argparse
import json
import os
import time

# The Triton path accepts CPU tensors only under the interpreter; no kernel runs here.
os.environ["TRITON_INTERPRET"] = "1"

import results  # noqa: E402
import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import encoding_syncbn  # noqa: E402
from encoding_syncbn import SyncBatchNorm  # noqa: E402

SHAPES = [
    ((8, 256, 128, 128), torch.float16, False),
    ((32, 64, 56, 56), torch.float16, True),
    ((8, 1024, 14, 14), torch.float32, False),
    ((256, 512), torch.float32, False),
]
H100_SMS = 132


class _Fresh(torch.autograd.Function):
    """A new uninitialised tensor shaped like ``like``, attached to it (a non-leaf input that
    the in-place layer may overwrite, without the cost of computing one)."""

    @staticmethod
    def forward(ctx, like, channels_last):
        fmt = torch.channels_last if channels_last else torch.contiguous_format
        return torch.empty(like.shape, dtype=like.dtype, memory_format=fmt)

    @staticmethod
    def backward(ctx, grad):
        return None, None  # accumulating into ``like`` would be a full pass


class _CountAten(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "encoding_syncbn":
            self.ops += 1
        return func(*args, **(kwargs or {}))


def measure(triton_ops, shape, dtype, channels_last, iters, repeats):
    from encoding_syncbn.kernels.triton.plan import Target

    launches = [0]

    def no_launch(planned, device):
        launches[0] += len(planned)

    triton_ops._run = no_launch
    triton_ops._target = lambda device: Target(False, H100_SMS)
    layer = SyncBatchNorm(shape[1], activation="leaky_relu")  # float32 parameters, as under AMP
    like = torch.empty(shape, dtype=dtype, requires_grad=True)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    dy = torch.empty(shape, dtype=dtype, memory_format=fmt)

    def call():
        x = _Fresh.apply(like, channels_last)
        start = time.thread_time()
        out = layer(x)
        middle = time.thread_time()
        out.backward(dy)
        end = time.thread_time()
        return middle - start, end - middle

    for _ in range(20):  # warm-up: plans, caches, autograd's first calls
        call()
    launches[0] = 0
    call()
    per_call_launches = launches[0]
    with _CountAten() as counter:
        call()
    fwd_means, bwd_means = [], []
    for _ in range(repeats):
        times = [call() for _ in range(iters)]
        fwd_means.append(sum(t[0] for t in times) / iters * 1e6)
        bwd_means.append(sum(t[1] for t in times) / iters * 1e6)
    in_ops = [0.0]
    direct = triton_ops.DIRECT
    plain = {name: getattr(direct, name) for name in ("_stats", "_normalize", "_reduce", "_dx")}

    def timed(op):
        def call(*args):
            start = time.thread_time()
            try:
                return op(*args)
            finally:
                in_ops[0] += time.thread_time() - start
        return call

    for name, op in plain.items():
        setattr(direct, name, timed(op))
    try:
        ops_means = []
        for _ in range(repeats):
            in_ops[0] = 0.0
            for _ in range(iters):
                call()
            ops_means.append(in_ops[0] / iters * 1e6)
    finally:
        for name, op in plain.items():
            setattr(direct, name, op)
    return (min(fwd_means), min(bwd_means), min(ops_means), per_call_launches, counter.ops)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200, help="calls per repeat (default 200)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="repeats; the fastest is reported (default 5)")
    results.add_arguments(parser)
    args = parser.parse_args()
    from encoding_syncbn.kernels.triton import ops as triton_ops  # triton: after --help

    torch.set_num_threads(1)
    encoding_syncbn.set_backend("triton")
    header = ["shape", "dtype", "layout", "fwd us", "bwd us", "total us", "in the ops us",
              "launches", "ATen ops"]
    rows = []
    for shape, dtype, channels_last in SHAPES:
        fwd, bwd, in_ops, launches, ops = measure(triton_ops, shape, dtype, channels_last,
                                                  args.iters, args.repeats)
        layout = "channels_last" if channels_last else "nchw"
        rows.append([str(shape), str(dtype).split(".")[1], layout, round(fwd, 1),
                     round(bwd, 1), round(fwd + bwd, 1), round(in_ops, 1), launches, ops])
        print(" ".join(str(cell) for cell in rows[-1]), flush=True)
    key = rows[0][5]
    table = results.markdown_table(header, rows)
    print(table)
    results.record(args, "host_overhead.py (cpu)", table, notes=(
        "Host time per layer forward+backward on the Triton path, kernel launches replaced by "
        "no-ops, planned for a 132-SM GPU: thread CPU time, the fastest of "
        f"{args.repeats} means over {args.iters} calls. 'in the ops': the part inside the four "
        "ops of the Triton backend (dx's allocation included: an mmap on the CPU). "
        "ATen ops: outside the four ops."))
    print(json.dumps({"host_us_fwd_bwd": key, "shape": list(SHAPES[0][0]),
                      "dtype": "float16", "layout": "nchw"}))


if __name__ == "__main__":
    main()
