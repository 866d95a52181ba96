"""Host time per layer call of the Triton path: planning, ATen calls, autograd and Triton's
launcher, down to the driver's launch call.

    python benchmarks/host_overhead.py [--iters 200] [--repeats 5] [--stack 8] [--shapes N]

Runs ``SyncBatchNorm(C, activation="leaky_relu")`` (in place, one replica, training) with the
Triton backend on CPU tensors, the launch planner told it plans for a 132-SM GPU (an H100
SXM), and every launch going through Triton's own launcher for real: ``JITFunction.run`` binds
and specialises the arguments and finds the compiled kernel (compiled for sm_90 on the CPU),
its C launcher extracts and checks each argument and calls the driver's ``cuLaunchKernelEx``,
which is the one thing stubbed: ``stub_driver.py`` builds a stand-in ``libcuda.so.1`` that
answers as an H100 and whose launch returns at once (what it leaves out: the driver's own
work inside the launch, a few us a launch on a real one). So what is timed is everything the
host does for a layer call but the driver's inside of each launch. No kernel runs: the
small-gamma flags the layer reads back are zeroed after the launch that would write them (one
``zero_`` a call, counted, as it is in the bare ops' harness below; uninitialised, they would
keep random channels aside). The input is a fresh uninitialised non-leaf tensor per call (made
outside the timed region; nothing reads its values).

The package's Triton backend takes CPU tensors only under Triton's interpreter. This script
patches that check on its side (``launch_through_stub``: the backend's ``INTERPRET`` flag,
which only that check reads, is set, so CPU tensors reach the compiled kernels' launches;
Triton itself runs with ``TRITON_INTERPRET=0``), and the ops' ``_run`` is wrapped to clear the
flags; the package is unchanged for its users.

Times are this thread's CPU time (``time.thread_time``; CPU backward runs on the calling
thread): on a shared machine the time spent waiting for a core is not counted, but contention
for caches still inflates it, so the fastest of ``--repeats`` is reported. This machine's speed
drifts between runs (the same code measured 0.5 and 1.2 ms per call on different runs), so
each figure comes with a floor measured in the same run, taking turns with it: the same
harness around an empty in-place layer (``_FloorLayer``: one autograd Function that marks its
input dirty, saves it with weight and bias, and in backward returns the incoming gradient and
two per-channel gradients made in advance, which autograd accumulates as it does ours). What
is above the floor ("own") is the layer's own host time; the floor is what PyTorch's autograd
costs any in-place layer here. A third harness, also in turns, splits "own" in two: the bare
ops (``_BareLayer``: an in-place autograd Function that calls the backend's three ops, the same
launches with the same arguments as the layer's, through the same launcher, and nothing else),
above which is what the layer's own Python adds ("above bare": module call, input checks,
configuration, the channels kept aside, the wrappers around the ops).

Two harnesses: one layer, whose backward is a whole ``backward()`` call (the engine's start
included, as the issue's figure is defined), and ``--stack`` layers chained in one graph with
one ``backward()``, as in a network where the engine starts once per step: its figures are
per layer. Between stacked layers an autograd Function hands each in-place layer a fresh
non-leaf input (a preallocated buffer, no pass over memory) and passes the gradient through;
the floor's stack has the same links, so "own" does not include them.

Prints, per shape, the host microseconds of the forward, the backward and their sum, the
floor's and the bare ops' sums and what is above each, of our sum the part spent inside the
Triton backend's ops (planning, allocating outputs, launching) and of that the part inside the
launches (Triton's launcher, from ``kernel[grid](...)`` to the stubbed driver call; both timed
in a separate pass with the ops wrapped, so the other columns carry no timer), the launches
(counted by the stand-in driver) and the ATen ops outside the backend's ops per
forward+backward; then the stacked figures. On the CPU the ops' part includes
``torch.empty_like`` of dx. On a GPU that comes from the caching allocator in a few us; on the
CPU glibc serves a block that large with an mmap, and frees it with an munmap (together some
30-60 us a call here, none of it the layer's doing). So by default (``--allocator cached``)
glibc is told to serve every block from its heap and to keep what is freed (``mallopt``: no
mmap, no trim), as the caching allocator keeps it; ``--allocator system`` leaves glibc as it
is. Prints the tables (``--record``: into benchmarks/RESULTS.md too); the last line is one JSON
object with ``host_us_fwd_bwd`` (one layer, the launcher included), ``in_ops_us_fwd_bwd``
(its part inside the backend's ops), ``launcher_us_fwd_bwd`` (the ops' part inside the
launches), ``launches``, ``launcher_included: true``,
``floor_us_fwd_bwd``, ``bare_us_fwd_bwd``, ``own_us_fwd_bwd`` and the stacked per-layer figures
for (8, 256, 128, 128) float16 NCHW. The first run compiles the kernels for sm_90 (some seconds
each; Triton's cache keeps them).
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import json
import time

import torch
from helpers import results, stub_driver
from torch.utils._python_dispatch import TorchDispatchMode

import encoding_syncbn
from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.kernels import GammaCheck, NormParams, RunningStats

SHAPES = [
    ((8, 256, 128, 128), torch.float16, False),
    ((32, 64, 56, 56), torch.float16, True),
    ((8, 1024, 14, 14), torch.float32, False),
    ((256, 512), torch.float32, False),
]
H100_SMS = stub_driver.H100_SMS
# The Triton backend's ops the layer calls (``TritonBackend``'s methods), timed for the "in
# the ops" column.
BACKEND_OPS = ("batch_stats", "normalize_act", "batch_backward")
# The part of the ops' time inside their launches (Triton's launcher, the driver's call).
LAUNCHES = "launches"


# glibc's mallopt parameters (malloc.h), and the largest value its C int takes: ctypes
# passes a Python int as a C int, truncating (2**62 arrived as 0: a trim on every free).
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_C_INT_MAX = 2**31 - 1


def _cache_freed_memory() -> None:
    """Make glibc's malloc behave like a caching allocator for this process: every block from
    its heap (no mmap), nothing given back to the system (no trim), so a block freed by one call
    serves the next as CUDA's caching allocator does."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    if not (libc.mallopt(_M_MMAP_MAX, 0) and libc.mallopt(_M_TRIM_THRESHOLD, _C_INT_MAX)):
        raise SystemExit("--allocator cached: glibc's mallopt refused; use --allocator system")


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


class _Link(torch.autograd.Function):
    """Between stacked layers: ``buffer`` (preallocated) as a fresh non-leaf input, attached to
    ``x``; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx, x, buffer):
        return buffer.detach()

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _EmptyInPlace(torch.autograd.Function):
    """The floor: what the autograd of any in-place layer does, and nothing else."""

    @staticmethod
    def forward(ctx, x, weight, bias, param_grads):
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, weight, bias)
        ctx.param_grads = param_grads
        return x

    @staticmethod
    def backward(ctx, grad):
        _ = ctx.saved_tensors  # unpacked, with its version checks, as every layer's backward
        return grad, *ctx.param_grads, None


class _BareOps(torch.autograd.Function):
    """The backend's ops and nothing else: an in-place autograd Function whose forward
    calls ``batch_stats`` (running statistics and the small-gamma check included, as the
    layer's) and ``normalize_act``, and whose backward calls ``batch_backward``: the same six
    launches with the same arguments as the layer's, none of its checks, configuration or
    bookkeeping. Above the floor, what the ops cost; below the layer, what the layer's own
    Python adds."""

    @staticmethod
    def forward(ctx, x, weight, bias, layer):
        ops = layer.ops
        mean, invstd, _ = ops.batch_stats(x, layer.eps, layer.running, layer.check)
        params = NormParams(mean, invstd, weight, bias, "leaky_relu", layer.slope)
        ops.normalize_act(x, params, x)
        ctx.mark_dirty(x)
        ctx.save_for_backward(x, mean, invstd, weight, bias)
        ctx.layer, ctx.count = layer, x.numel() // x.shape[1]
        return x

    @staticmethod
    def backward(ctx, grad):
        y, mean, invstd, weight, bias = ctx.saved_tensors
        ops = ctx.layer.ops
        params = NormParams(mean, invstd, weight, bias, "leaky_relu", ctx.layer.slope)
        dx, sum_dz, sum_dz_xhat = ops.batch_backward(y, grad, params, True, ctx.count)
        return dx, sum_dz_xhat, sum_dz, None


class _BareLayer(torch.nn.Module):
    def __init__(self, channels: int, ops) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))
        self.ops, self.eps, self.slope = ops, 1e-5, 0.01
        self.running = RunningStats(torch.zeros(channels), torch.ones(channels),
                                    torch.zeros((), dtype=torch.long), 0.1)
        self.check = GammaCheck(self.weight.detach(), self.bias.detach(), 0.016)

    def forward(self, x):
        return _BareOps.apply(x, self.weight, self.bias, self)


class _FloorLayer(torch.nn.Module):
    def __init__(self, channels: int) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(channels))
        self.bias = torch.nn.Parameter(torch.zeros(channels))
        self.param_grads = (torch.zeros(channels), torch.zeros(channels))

    def forward(self, x):
        return _EmptyInPlace.apply(x, self.weight, self.bias, self.param_grads)


class _CountAten(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace != "encoding_syncbn":
            self.ops += 1
        return func(*args, **(kwargs or {}))


def _steps(layers, links, make_input, dy, iters):
    """Mean (forward, backward) thread CPU seconds per step of ``layers`` chained (``links``
    between them), one ``backward()`` a step."""
    fwd = bwd = 0.0
    for _ in range(iters):
        x = make_input()
        start = time.thread_time()
        for i, layer in enumerate(layers):
            x = layer(x if i == 0 else _Link.apply(x, links[i]))
        middle = time.thread_time()
        x.backward(dy)
        end = time.thread_time()
        fwd += middle - start
        bwd += end - middle
    return fwd / iters, bwd / iters


class StubLaunches:
    """The Triton backend on CPU tensors, planned for an H100 and launched through Triton's
    launcher onto the stand-in driver (``stub_driver.activate()`` first). ``run`` is the
    backend's own launch function, which ``_time_in_ops`` may wrap."""

    def __init__(self, triton_ops) -> None:
        from encoding_syncbn.kernels.triton.plan import Target

        # kernels.ops_for hands a CPU tensor to the Triton backend only where its kernels are
        # interpreted (this flag, which nothing else reads): told so, it routes CPU tensors to
        # the compiled kernels' launches.
        triton_ops.INTERPRET = True
        h100 = Target(False, H100_SMS)
        triton_ops.launch_target = lambda device: h100  # the real one is memoised per device
        self.run = triton_ops._run
        # id(kernel) -> its flags argument's index (a JITFunction's own hash is its cache
        # key, taken under a lock: a cost of the harness, not of the layer)
        self._flags: dict[int, int | None] = {}
        triton_ops._run = self._launch

    def _launch(self, planned, device) -> None:
        """The launches, then what no kernel wrote and the layer reads: the small-gamma flags
        (an argument ``small_ptr``), cleared as a check that found no small gamma leaves them."""
        self.run(planned, device)
        for launch in planned:
            kernel = launch.kernel
            index = self._flags.get(id(kernel), -1)
            if index == -1:
                names = kernel.arg_names
                index = self._flags[id(kernel)] = (names.index("small_ptr")
                                                   if "small_ptr" in names else None)
            if index is not None:
                launch.args[index].zero_()


def measure(triton_ops, launcher, stub, shape, dtype, channels_last, iters, repeats, stack):
    """Per shape: ours and the floor, one layer and ``stack`` chained, in turns; the part in
    the backend's ops and in their launches; launches and ATen ops per call."""
    channels = shape[1]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    like = torch.empty(shape, dtype=dtype, requires_grad=True)
    dy = torch.empty(shape, dtype=dtype, memory_format=fmt)
    links = [torch.empty(shape, dtype=dtype, memory_format=fmt) for _ in range(stack)]

    def make_input():
        return _Fresh.apply(like, channels_last)

    # float32 parameters, as under AMP.
    ours = [SyncBatchNorm(channels, activation="leaky_relu") for _ in range(stack)]
    floor = [_FloorLayer(channels) for _ in range(stack)]
    bare = [_BareLayer(channels, triton_ops.EAGER) for _ in range(stack)]
    variants = {
        "ours": (ours[:1], iters), "floor": (floor[:1], iters), "bare": (bare[:1], iters),
        "ours stacked": (ours, max(1, iters // stack)),
        "floor stacked": (floor, max(1, iters // stack)),
        "bare stacked": (bare, max(1, iters // stack)),
    }
    for layers, _ in variants.values():  # warm-up: plans, caches, autograd's first calls
        _steps(layers, links, make_input, dy, 20)
    before = stub.launches()
    _steps(ours[:1], links, make_input, dy, 1)
    per_call_launches = stub.launches() - before
    with _CountAten() as counter:
        _steps(ours[:1], links, make_input, dy, 1)
    best = {name: (float("inf"), float("inf")) for name in variants}
    for _ in range(repeats):  # in turns: each variant sees the machine as the others do
        for name, (layers, n) in variants.items():
            fwd, bwd = _steps(layers, links, make_input, dy, n)
            per_layer = (fwd * 1e6 / len(layers), bwd * 1e6 / len(layers))
            if sum(per_layer) < sum(best[name]):
                best[name] = per_layer
    return best, _time_in_ops(triton_ops, launcher, ours[:1], links, make_input, dy, iters,
                              repeats), (per_call_launches, counter.ops)


def _time_in_ops(triton_ops, launcher, layers, links, make_input, dy, iters, repeats):
    """Microseconds per call inside the backend's ops (a pass of its own, ops wrapped): the
    fastest repeat's total, each op's part of it, and the part inside the launches."""
    spent = dict.fromkeys([*BACKEND_OPS, LAUNCHES], 0.0)
    direct = triton_ops.EAGER
    plain = {name: getattr(direct, name) for name in BACKEND_OPS}
    run = launcher.run

    def timed(name, op):
        def call(*args, **kwargs):
            start = time.thread_time()
            try:
                return op(*args, **kwargs)
            finally:
                spent[name] += time.thread_time() - start
        return call

    for name, op in plain.items():
        setattr(direct, name, timed(name, op))
    launcher.run = timed(LAUNCHES, run)
    try:
        best = None
        for _ in range(repeats):
            spent.update(dict.fromkeys(spent, 0.0))
            _steps(layers, links, make_input, dy, iters)
            per_op = {name: seconds / iters * 1e6 for name, seconds in spent.items()}
            if best is None or sum(per_op[name] for name in BACKEND_OPS) < sum(
                    best[name] for name in BACKEND_OPS):
                best = per_op
    finally:
        for name in plain:  # the class's methods again
            delattr(direct, name)
        launcher.run = run
    return sum(best[name] for name in BACKEND_OPS), best


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--iters", type=int, default=200, help="calls per repeat (default 200)")
    parser.add_argument("--repeats", type=int, default=5,
                        help="repeats; the fastest is reported (default 5)")
    parser.add_argument("--stack", type=int, default=8,
                        help="layers chained for the per-layer figures (default 8)")
    parser.add_argument("--shapes", type=int, default=len(SHAPES),
                        choices=range(1, len(SHAPES) + 1),
                        help=f"measure the first N shapes only (default all {len(SHAPES)}; the "
                             "JSON line is the first's)")
    parser.add_argument("--allocator", choices=("cached", "system"), default="cached",
                        help="cached (default): glibc keeps freed blocks, as a GPU's caching "
                             "allocator does; system: glibc as it is (an mmap per large block)")
    results.add_arguments(parser)
    args = parser.parse_args()
    if args.allocator == "cached":
        _cache_freed_memory()
    stub = stub_driver.activate()  # imports triton: after --help
    from encoding_syncbn.kernels.triton import ops as triton_ops

    torch.set_num_threads(1)
    encoding_syncbn.set_backend("triton")
    launcher = StubLaunches(triton_ops)
    header = ["shape", "dtype", "layout", "fwd us", "bwd us", "total us", "floor us",
              "bare ops us", "own us", "above bare us", "in the ops us", "launching us",
              "launches", "ATen ops"]
    stack_header = ["shape", "dtype", "layout", "per layer us", "floor us", "bare ops us",
                    "own us", "above bare us"]
    op_header = ["shape", "dtype", "layout", *(f"{op} us" for op in BACKEND_OPS),
                 "of which launching us"]
    rows, stack_rows, op_rows, first = [], [], [], None
    for shape, dtype, channels_last in SHAPES[:args.shapes]:
        best, (in_ops, per_op), (launches, ops) = measure(
            triton_ops, launcher, stub, shape, dtype, channels_last, args.iters, args.repeats,
            args.stack)
        fwd, bwd = best["ours"]
        total, floor, bare = fwd + bwd, sum(best["floor"]), sum(best["bare"])
        stacked, stacked_floor, stacked_bare = (
            sum(best[f"{name} stacked"]) for name in ("ours", "floor", "bare"))
        cells = [str(shape), str(dtype).split(".")[1],
                 "channels_last" if channels_last else "nchw"]
        rows.append([*cells, round(fwd, 1), round(bwd, 1), round(total, 1), round(floor, 1),
                     round(bare, 1), round(total - floor, 1), round(total - bare, 1),
                     round(in_ops, 1), round(per_op[LAUNCHES], 1), launches, ops])
        stack_rows.append([*cells, round(stacked, 1), round(stacked_floor, 1),
                           round(stacked_bare, 1), round(stacked - stacked_floor, 1),
                           round(stacked - stacked_bare, 1)])
        op_rows.append([*cells, *(round(per_op[name], 1) for name in [*BACKEND_OPS, LAUNCHES])])
        print(" ".join(str(cell) for cell in rows[-1] + stack_rows[-1][3:]), flush=True)
        if first is None:
            one, stacked_one = dict(zip(header, rows[0])), dict(zip(stack_header, stack_rows[0]))
            first = {"host_us_fwd_bwd": one["total us"],
                     "in_ops_us_fwd_bwd": one["in the ops us"],
                     "launcher_us_fwd_bwd": one["launching us"], "launches": launches,
                     "launcher_included": True, "floor_us_fwd_bwd": one["floor us"],
                     "bare_us_fwd_bwd": one["bare ops us"], "own_us_fwd_bwd": one["own us"],
                     "stack_us_per_layer": stacked_one["per layer us"],
                     "stack_floor_us_per_layer": stacked_one["floor us"],
                     "stack_bare_us_per_layer": stacked_one["bare ops us"],
                     "stack_own_us_per_layer": stacked_one["own us"]}
    table = (results.markdown_table(header, rows) + "\n\n"
             f"Per layer in a stack of {args.stack} (one backward() a step):\n\n"
             + results.markdown_table(stack_header, stack_rows) + "\n\n"
             "Inside the backend's ops, per op (planning, allocating, launching; one layer's "
             "forward+backward), and the part of them inside the launches:\n\n"
             + results.markdown_table(op_header, op_rows))
    print(table)
    import triton

    results.record(args, "host_overhead.py (cpu)", table, notes=(
        "Host time per layer forward+backward on the Triton path, planned for a 132-SM GPU, "
        f"every launch through Triton's own launcher (triton {triton.__version__}, kernels "
        "compiled for sm_90) down to the driver's cuLaunchKernelEx, the one call stubbed "
        "(benchmarks/stub_driver.py): thread CPU time, the fastest of "
        f"{args.repeats} means over {args.iters} calls. 'floor': the same harness around an "
        "empty in-place autograd Function, measured in turns with ours; 'bare ops': one that "
        "calls the backend's three ops and nothing else (the same launches); 'own': ours "
        "minus the floor; 'above bare': ours minus the bare ops, what the layer's own Python "
        "adds to its ops. 'in the ops': the part inside the Triton backend's ops (dx's "
        "allocation included); 'launching': the part of that inside the launches (Triton's "
        "launcher from kernel[grid](...) to the stubbed driver call; in the ops' column too). "
        "ATen ops: outside the backend's ops. The stacked figures are per layer of "
        f"a chain with one backward() a step. Allocator: {args.allocator} ("
        + ("glibc keeps freed blocks, as a GPU's caching allocator does" if args.allocator ==
           "cached" else "glibc as it is: an mmap and an munmap per large block") + ")."))
    print(json.dumps({**first, "shape": list(SHAPES[0][0]), "dtype": "float16",
                      "layout": "nchw", "allocator": args.allocator}))


if __name__ == "__main__":
    main()
