"""Host cost of a layer call on the Triton path, timed or counted down to the driver's launch.

Planning, ATen calls, autograd and Triton's launcher: timed per call (the default), per launch
(``--per-launch``) or counted in instructions under valgrind (``--instructions``).

    python benchmarks/host_overhead.py [--iters 200] [--repeats 5] [--stack 8] [--shapes N]
    python benchmarks/host_overhead.py --per-launch [--iters 5000] [--repeats 5]
    python benchmarks/host_overhead.py --instructions [--steps 1000] [--harnesses ours bare floor]

Runs ``SyncBatchNorm(C, activation="leaky_relu")`` (in place, one replica, training) with the
Triton backend on CPU tensors, the launch planner told it plans for a 132-SM GPU (an H100
SXM), and every launch going through Triton's own launcher for real: ``JITFunction.run`` binds
and specialises the arguments and finds the compiled kernel (compiled for sm_90 on the CPU),
its C launcher extracts and checks each argument and calls the driver's ``cuLaunchKernelEx``,
which is the one thing stubbed: ``helpers/stub_driver.py`` builds a stand-in ``libcuda.so.1`` that
answers as an H100 and whose launch returns at once (what it leaves out: the driver's own
work inside the launch, a few us a launch on a real one). So what is timed is everything the
host does for a layer call but the driver's inside of each launch. No kernel runs: the small-gamma
flags the layer reads back are zeroed (uninitialised, they would keep random channels aside): in
the warm-up calls where the layer reads them, once a buffer (the training step's repeat calls
write theirs into one), and for the timed calls nowhere on their path (``StubLaunches.settled``:
the timed calls are checked to have kept no channel aside); and the CPU treats denormal floats as
zero, for every harness alike: the weight's and bias's gradients, which no kernel writes, hold
allocator leftovers that autograd adds into ``.grad``, denormals among them, each addition a
microcode assist on the CPU where a GPU's is a launch whose cost no value changes. The layer is
as on a GPU: the hook that a layer on CPU parameters runs after each backward (counting the
channels a compiled in-place layer keeps aside) is removed (``host_harness.as_on_a_gpu``). The
input is a fresh uninitialised non-leaf tensor per call (made outside the timed region; nothing
reads its values).

The package's Triton backend takes CPU tensors only under Triton's interpreter. This script
patches that check on its side (``StubLaunches`` of ``helpers/host_harness.py``: the backend's
``INTERPRET`` flag, which only that check reads, is set, so CPU tensors reach the compiled
kernels' launches; Triton itself runs with ``TRITON_INTERPRET=0``), and the layer's reading
of the flags is wrapped to clear them; the package is unchanged for its users.

Times are this thread's CPU time (``time.thread_time``; CPU backward runs on the calling
thread): on a shared machine the time spent waiting for a core is not counted, but contention
for caches still inflates it, so the fastest of ``--repeats`` is reported. This machine's speed
drifts between runs (the same code measured 0.5 and 1.2 ms per call on different runs), so
each figure comes with a floor measured in the same run, taking turns with it: the same
harness around an empty in-place layer (``FloorLayer``: one autograd Function that marks its
input dirty, saves it with weight and bias, and in backward returns the incoming gradient and
two per-channel gradients made in advance, which autograd accumulates as it does ours). What
is above the floor ("own") is the layer's own host time; the floor is what PyTorch's autograd
costs any in-place layer here. A third harness, also in turns, splits "own" in two: the bare
ops (``BareLayer``: an in-place autograd Function that calls the backend's three ops as the
layer's repeat calls run them, the same launches with the same arguments launched the same way
(checked), and nothing else), above which is what the layer's own Python adds ("above bare":
module call, input checks, configuration, the channels kept aside, the wrappers around the
ops).

Two harnesses: one layer, whose backward is a whole ``backward()`` call (the engine's start
included, as the issue's figure is defined), and ``--stack`` layers chained in one graph with
one ``backward()``, as in a network where the engine starts once per step: its figures are
per layer. Between stacked layers an autograd Function hands each in-place layer a fresh
non-leaf input (a preallocated buffer, no pass over memory) and passes the gradient through;
the floor's stack has the same links, so "own" does not include them.

Prints, per shape, the host microseconds of the forward, the backward and their sum, the
floor's and the bare ops' sums and what is above each, of our sum the part spent inside the
Triton backend's ops (planning, allocating outputs, launching) and of that the part inside the
launches (from the ops' launch functions, ``_run``, ``launch_prepared`` and
``launch_direct``, to the stubbed driver call: the direct launches and, where taken, Triton's
public one; both timed in a separate pass with the ops wrapped, so the other columns carry
no timer), the launches (counted by the stand-in driver) and the ATen ops outside the
backend's ops per forward+backward; then the stacked figures. On the CPU the ops' part includes
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

``--per-launch`` times the launches of one call one by one instead: each launch of one
single-replica training call of the first shape, two ways: through Triton's public launch
(``kernel[grid](...)``: ``JITFunction.run`` binding and specialising the arguments, the cache
key, the check of the constexpr globals the kernel reads, launch metadata), and as the ops
launch it (``kernels/triton/launch.py``: the compiled kernel called directly once seen). Both
end in Triton's C launcher and the stand-in driver's ``cuLaunchKernelEx``. Thread CPU time, the
fastest of ``--repeats`` means over ``--iters`` launches; the last line is one JSON object with
``launcher_us_per_call`` (as the ops launch), ``public_launcher_us_per_call`` and
``launches``.

``--instructions`` counts instead of timing: the harness of one layer (the first shape; 'ours',
'bare' or 'floor', ``--harnesses``) runs under ``valgrind --tool=cachegrind --cache-sim=no``
twice, for 40 steps and for 40 + ``--steps``, and the difference per step is printed: the
instructions of one forward+backward, all the host does but the driver's inside of each
launch, a measure that does not drift from run to run as time does. Each harness first runs
once without valgrind (the kernels compiled, or found in Triton's cache). Both counted runs fix
``PYTHONHASHSEED`` and run OpenBLAS single-threaded (its idle threads spin a varying number of
instructions) with the garbage collector off: the same code then counts the same to within a
few thousand instructions a step, where timed runs scatter by 1-2 us. An import or an
environment variable more moves the count by up to ~4k (memory layout); compare counts made
alike. Needs valgrind on PATH. With ``--by-function`` both runs are callgrind's, and the
table gives besides each harness's total the instructions a step of Triton's C launcher, the
allocations (``torch.empty``, ``empty_like``, ``new_empty``) and autograd's C parts, each with
everything it calls (they nest): where a step's instructions go (needs callgrind_annotate).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

import torch
from helpers import host_harness, results, stub_driver

import encoding_syncbn
from encoding_syncbn import SyncBatchNorm

SHAPES = [
    ((8, 256, 128, 128), torch.float16, False),
    ((32, 64, 56, 56), torch.float16, True),
    ((8, 1024, 14, 14), torch.float32, False),
    ((256, 512), torch.float32, False),
]
H100_SMS = stub_driver.H100_SMS
# The Triton backend's ops the layer calls (``triton_ops.EAGER``'s methods), timed for the "in
# the ops" column.
BACKEND_OPS = ("batch_stats", "normalize_act", "batch_backward")
# The part of the ops' time inside their launches (Triton's launcher, the driver's call),
# timed from the ops' launch functions (``host_harness.LAUNCHERS``): no launch timed twice.
LAUNCHES = "launches"
# --instructions: the steps run before the counted ones, and the harnesses it may count.
WARM_STEPS = 40
HARNESSES = ("ours", "bare", "floor")


def measure(triton_ops, stub, stub_launches, shape, dtype, channels_last, iters, repeats, stack):
    """Per shape: ours and the floor, one layer and ``stack`` chained, in turns; the part in
    the backend's ops and in their launches; launches and ATen ops per call."""
    channels = shape[1]
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    like = torch.empty(shape, dtype=dtype, requires_grad=True)
    dy = torch.empty(shape, dtype=dtype, memory_format=fmt)
    links = [torch.empty(shape, dtype=dtype, memory_format=fmt) for _ in range(stack)]

    def make_input():
        return host_harness.Fresh.apply(like, channels_last)

    # float32 parameters, as under AMP.
    ours = [host_harness.as_on_a_gpu(SyncBatchNorm(channels, activation="leaky_relu"))
            for _ in range(stack)]
    floor = [host_harness.FloorLayer(channels) for _ in range(stack)]
    bare = [host_harness.BareLayer(channels, triton_ops.EAGER) for _ in range(stack)]
    variants = {
        "ours": (ours[:1], iters), "floor": (floor[:1], iters), "bare": (bare[:1], iters),
        "ours stacked": (ours, max(1, iters // stack)),
        "floor stacked": (floor, max(1, iters // stack)),
        "bare stacked": (bare, max(1, iters // stack)),
    }
    for layers, _ in variants.values():  # warm-up: plans, caches, autograd's first calls
        host_harness.steps(layers, links, make_input, dy, 20)
    before = stub.launches()
    host_harness.steps(ours[:1], links, make_input, dy, 1)
    per_call_launches = stub.launches() - before
    # "Above bare" is the layer's own Python only where the bare ops launch as its calls do.
    paths = {name: host_harness.launch_paths(triton_ops, lambda layers=layers: host_harness.steps(
                 layers, links, make_input, dy, 1))
             for name, layers in (("ours", ours[:1]), ("bare", bare[:1]))}
    if paths["bare"] != paths["ours"]:
        raise SystemExit(f"the bare ops launch otherwise than the layer's call: {paths}")
    with host_harness.CountAten() as counter:
        host_harness.steps(ours[:1], links, make_input, dy, 1)
    best = {name: (float("inf"), float("inf")) for name in variants}
    with stub_launches.settled(ours):
        for _ in range(repeats):  # in turns: each variant sees the machine as the others do
            for name, (layers, n) in variants.items():
                fwd, bwd = host_harness.steps(layers, links, make_input, dy, n)
                per_layer = (fwd * 1e6 / len(layers), bwd * 1e6 / len(layers))
                if sum(per_layer) < sum(best[name]):
                    best[name] = per_layer
        in_ops = _time_in_ops(triton_ops, ours[:1], links, make_input, dy, iters, repeats)
    return best, in_ops, (per_call_launches, counter.ops)


def _time_in_ops(triton_ops, layers, links, make_input, dy, iters, repeats):
    """Microseconds per call inside the backend's ops (a pass of its own, ops wrapped): the
    fastest repeat's total, each op's part of it, and the part inside the launches."""
    spent = dict.fromkeys([*BACKEND_OPS, LAUNCHES], 0.0)
    direct = triton_ops.EAGER
    plain = {name: getattr(direct, name) for name in BACKEND_OPS}
    launchers = host_harness.launchers_of(triton_ops)
    # The ops as a layer key's calls run them: a ``TrainingStep``'s methods (a checkout
    # without one, compared with this one's harness, calls the backend's).
    step = getattr(triton_ops, "TrainingStep", None)
    step_ops = {} if step is None else {name: vars(step)[name] for name in BACKEND_OPS}

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
    for name, op in step_ops.items():
        setattr(step, name, timed(name, op))
    for name, launcher in launchers.items():
        setattr(triton_ops, name, timed(LAUNCHES, launcher))
    try:
        best = None
        for _ in range(repeats):
            spent.update(dict.fromkeys(spent, 0.0))
            host_harness.steps(layers, links, make_input, dy, iters)
            per_op = {name: seconds / iters * 1e6 for name, seconds in spent.items()}
            if best is None or sum(per_op[name] for name in BACKEND_OPS) < sum(
                    best[name] for name in BACKEND_OPS):
                best = per_op
    finally:
        for name in plain:  # the class's methods again
            delattr(direct, name)
        for name, op in step_ops.items():
            setattr(step, name, op)
        for name, launcher in launchers.items():
            setattr(triton_ops, name, launcher)
    return sum(best[name] for name in BACKEND_OPS), best


def per_call(args: argparse.Namespace) -> None:
    """The default: host time per layer call, ours against the floor and the bare ops."""
    if args.allocator == "cached":
        host_harness.cache_freed_memory()
    stub = stub_driver.activate()  # imports triton: after --help
    from encoding_syncbn.kernels.triton import ops as triton_ops

    torch.set_num_threads(1)
    encoding_syncbn.set_backend("triton")
    stub_launches = host_harness.StubLaunches(triton_ops)
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
            triton_ops, stub, stub_launches, shape, dtype, channels_last, args.iters,
            args.repeats, args.stack)
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
        "(benchmarks/helpers/stub_driver.py): thread CPU time, the fastest of "
        f"{args.repeats} means over {args.iters} calls. 'floor': the same harness around an "
        "empty in-place autograd Function, measured in turns with ours; 'bare ops': one that "
        "calls the backend's three ops and nothing else (the same launches); 'own': ours "
        "minus the floor; 'above bare': ours minus the bare ops, what the layer's own Python "
        "adds to its ops. 'in the ops': the part inside the Triton backend's ops (dx's "
        "allocation included); 'launching': the part of that inside the launches (from the "
        "ops' launch functions, _run, launch_prepared and launch_direct, to the stubbed "
        "driver call; in the "
        "ops' column too). "
        "ATen ops: outside the backend's ops. The stacked figures are per layer of "
        f"a chain with one backward() a step. Allocator: {args.allocator} ("
        + ("glibc keeps freed blocks, as a GPU's caching allocator does" if args.allocator ==
           "cached" else "glibc as it is: an mmap and an munmap per large block") + ")."))
    print(json.dumps({**first, "shape": list(SHAPES[0][0]), "dtype": "float16",
                      "layout": "nchw", "allocator": args.allocator}))


def planned_launches():
    """The launches of one single-replica in-place training call of the layer (the first
    shape), in order: recorded from a real forward+backward on CPU tensors."""
    from encoding_syncbn.kernels.triton import ops as triton_ops

    shape, dtype, _ = SHAPES[0]
    encoding_syncbn.set_backend("triton")
    host_harness.StubLaunches(triton_ops)
    recorded, run = [], triton_ops._run

    def record(planned, device):
        recorded.extend(planned)
        run(planned, device)

    triton_ops._run = record
    layer = SyncBatchNorm(shape[1], activation="leaky_relu")
    like = torch.empty(shape, dtype=dtype, requires_grad=True)
    layer(host_harness.Fresh.apply(like, False)).backward(torch.empty(shape, dtype=dtype))
    triton_ops._run = run
    return recorded


def launch_steps(planned):
    """``planned`` launched through Triton's public launch (``kernel[grid](...)``), and as the
    ops launch it (``launch.launch``: its compiled kernel directly once seen), ready to time."""
    from encoding_syncbn.kernels.triton import launch

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


def per_launch(args: argparse.Namespace) -> None:
    """--per-launch: each launch of one call, through Triton's public launch and directly."""
    stub = stub_driver.activate(H100_SMS)  # imports triton: after --help
    shape = SHAPES[0][0]
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

    results.record(args, f"host_overhead.py --per-launch (cpu, triton {triton.__version__})",
                   table, notes=(
        "Triton's launcher per launch of one single-replica in-place training call "
        f"{shape} fp16 NCHW, leaky_relu, planned for sm_90 with {H100_SMS} SMs, CPU tensors: "
        "through Triton's public launch (kernel[grid](...): JITFunction.run), and as the ops "
        "launch it (kernels/triton/launch.py: the compiled kernel directly), each down to the "
        "driver's cuLaunchKernelEx, stubbed (benchmarks/helpers/stub_driver.py: the driver's "
        "own work inside a launch is not counted). Thread CPU time, the fastest of "
        f"{args.repeats} means over {args.iters} launches. The per-call figures include "
        "the launches as the ops launch them."))
    print(json.dumps({"launcher_us_per_call": direct, "public_launcher_us_per_call": public,
                      "launches": len(rows)}))


def counted_steps(harness: str, steps: int) -> None:
    """Under valgrind (--instructions): ``WARM_STEPS`` steps, then ``steps`` more, of one
    harness."""
    import gc

    host_harness.cache_freed_memory()
    stub_driver.activate()
    from encoding_syncbn.kernels.triton import ops as triton_ops

    torch.set_num_threads(1)
    encoding_syncbn.set_backend("triton")
    stub_launches = host_harness.StubLaunches(triton_ops)
    shape, dtype, _ = SHAPES[0]
    channels = shape[1]
    module = {"ours": lambda: host_harness.as_on_a_gpu(
                  SyncBatchNorm(channels, activation="leaky_relu")),
              "bare": lambda: host_harness.BareLayer(channels, triton_ops.EAGER),
              "floor": lambda: host_harness.FloorLayer(channels)}[harness]()
    like = torch.empty(shape, dtype=dtype, requires_grad=True)
    dy = torch.empty(shape, dtype=dtype)
    gc.disable()

    def make_input():
        return host_harness.Fresh.apply(like, False)

    host_harness.steps([module], None, make_input, dy, WARM_STEPS)
    with stub_launches.settled([module]):
        if steps:  # (the run of the warm steps alone enters and leaves the same way)
            host_harness.steps([module], None, make_input, dy, steps)


def _counted_command(harness: str, steps: int) -> list[str]:
    return [sys.executable, os.path.abspath(__file__), "--counted", harness, str(steps)]


# --by-function: the C functions whose instructions (theirs and their callees') a step are
# reported, by callgrind's name of each. They nest: the launches and allocations of a backward
# are inside its Python nodes, and those inside the engine.
BY_FUNCTION = (
    ("Triton's C launcher", "launchKernel"),
    ("torch.empty", "torch::autograd::THPVariable_empty("),
    ("torch.empty_like", "torch::autograd::THPVariable_empty_like("),
    ("Tensor.new_empty", "torch::autograd::THPVariable_new_empty("),
    ("Function.apply in C (its forward inside)", "(anonymous namespace)::THPFunction_apply("),
    ("backward's Python nodes", "torch::autograd::PyNode::apply("),
    ("backward() in C (the engine)", "THPEngine_run_backward("),
)


def _process_instructions(harness: str, steps: int, by_function: bool = False
                          ) -> dict[str, int]:
    """Instructions of the whole process running ``steps`` steps after the warm ones
    (``"total"``), and with ``by_function`` those of each of :data:`BY_FUNCTION`, under
    callgrind instead of cachegrind."""
    env = {**os.environ, "PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1",
           "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "out") if by_function else "/dev/null"
        tool = (["--tool=callgrind", f"--callgrind-out-file={out}"] if by_function else
                ["--tool=cachegrind", "--cache-sim=no", f"--cachegrind-out-file={out}"])
        done = subprocess.run(["valgrind", *tool, *_counted_command(harness, steps)], env=env,
                              capture_output=True, text=True, check=False)
        found = re.search(r"I\s+refs:\s+([\d,]+)", done.stderr)
        if done.returncode != 0 or found is None:
            raise SystemExit(f"valgrind run of {harness!r} failed:\n{done.stderr[-2000:]}")
        counts = {"total": int(found.group(1).replace(",", ""))}
        if by_function:
            annotated = subprocess.run(
                ["callgrind_annotate", "--inclusive=yes", "--threshold=100", out],
                capture_output=True, text=True, check=True).stdout
            counts.update(_inclusive_counts(annotated))
    return counts


def _inclusive_counts(annotated: str) -> dict[str, int]:
    """Per :data:`BY_FUNCTION` label, the instructions ``callgrind_annotate --inclusive=yes``
    gives its function (0 where it does not appear): its line whose name starts with the
    function's (a recursive call's own line, ``name'2``, is inside the first)."""
    counts = dict.fromkeys((label for label, _ in BY_FUNCTION), 0)
    for line in annotated.splitlines():
        found = re.match(r"\s*([\d,]+)\s+(?:\([^)]*\)\s+)?\S*?:(\S.*)$", line)
        if found is None:
            continue
        name = found.group(2)
        for label, function in BY_FUNCTION:
            if name.startswith(function) and not counts[label]:
                counts[label] = int(found.group(1).replace(",", ""))
    return counts


def instructions(args: argparse.Namespace) -> None:
    """--instructions: each harness's instructions a step, counted under valgrind."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not on PATH: --instructions needs it")
    if args.by_function and shutil.which("callgrind_annotate") is None:
        raise SystemExit("callgrind_annotate is not on PATH: --by-function needs it")
    per_step = {}
    for harness in args.harnesses:
        # Natively first: the kernels compiled (or found in Triton's cache) outside valgrind.
        subprocess.run(_counted_command(harness, 0), check=True)
        longer, warm = (_process_instructions(harness, steps, args.by_function)
                        for steps in (args.steps, 0))
        per_step[harness] = {name: (longer[name] - warm[name]) / args.steps for name in longer}
        print(f"{harness}: {per_step[harness]['total'] / 1000:.1f}k instructions a step",
              flush=True)
    if args.by_function:
        names = ["total", *(label for label, _ in BY_FUNCTION)]
        table = results.markdown_table(
            ["instructions a step (k), with callees", *args.harnesses],
            [[name, *(round(per_step[h][name] / 1000, 1) for h in args.harnesses)]
             for name in names])
    else:
        table = results.markdown_table(
            ["harness", "k instructions a step"],
            [[h, round(per_step[h]["total"] / 1000, 1)] for h in args.harnesses])
    print(table)
    results.record(args, "host_overhead.py --instructions (cpu)", table, notes=(
        f"Instructions per forward+backward of one layer, {SHAPES[0][0]} float16 NCHW, on the "
        "Triton path, every launch through Triton's launcher to a stubbed cuLaunchKernelEx "
        "(benchmarks/helpers/host_harness.py), counted by valgrind's "
        f"{'callgrind' if args.by_function else 'cachegrind'}: a run of {WARM_STEPS} + "
        f"{args.steps} steps minus one of {WARM_STEPS}, "
        "divided by the steps. PYTHONHASHSEED=0, OpenBLAS single-threaded, no garbage "
        "collection during the steps."))


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--per-launch", action="store_true",
                      help="time each launch of one call, through Triton's public launch and "
                           "directly, instead of whole calls")
    mode.add_argument("--instructions", action="store_true",
                      help="count each harness's instructions a step under valgrind instead of "
                           "timing")
    parser.add_argument("--iters", type=int,
                        help="calls per repeat (default 200; --per-launch: 5000 launches)")
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
    parser.add_argument("--steps", type=int, default=1000,
                        help="--instructions: steps counted beyond the warm ones (default 1000)")
    parser.add_argument("--harnesses", nargs="+", choices=HARNESSES, default=list(HARNESSES),
                        help="--instructions: which harnesses to count (default all)")
    parser.add_argument("--by-function", action="store_true",
                        help="--instructions: count under callgrind and also give the "
                             "instructions a step of the launcher, the allocations and "
                             "autograd's C parts (with their callees)")
    parser.add_argument("--counted", nargs=2, metavar=("HARNESS", "STEPS"),
                        help=argparse.SUPPRESS)
    results.add_arguments(parser)
    args = parser.parse_args()
    if args.counted:
        counted_steps(args.counted[0], int(args.counted[1]))
    elif args.instructions:
        instructions(args)
    elif args.per_launch:
        args.iters = args.iters or 5000
        per_launch(args)
    else:
        args.iters = args.iters or 200
        per_call(args)


if __name__ == "__main__":
    main()
