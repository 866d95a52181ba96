"""Run by ``test_launch.py`` in a process of its own (Triton's JIT on the stand-in driver of
``benchmarks/helpers/stub_driver.py``, not the interpreter): launches each chosen specialisation
through Triton's public launch and directly (``kernels/triton/launch.py``) and prints, as one
JSON line, what the stand-in driver saw.

The launches are those the AOT check compiles (planned for a 132-SM sm_90 over meta tensors),
per kernel a set in which every choice any of them makes occurs (``check.covering(..., 1)``:
each dtype, layout, tile, activation, split, integer typing), their tensors replaced by small
CPU tensors of the same dtypes (16-byte aligned), and per kernel one more with its first tensor
one element off alignment (Triton specialises on it).
"""

import functools
import json
import sys
from pathlib import Path

# This checkout's package and benchmarks, whichever is installed.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(_ROOT), str(_ROOT / "benchmarks"), str(_ROOT / "tools")]

from helpers import stub_driver  # noqa: E402
from helpers.launches import counted_launches  # noqa: E402
from helpers.plans import forget_plans  # noqa: E402

STUB = stub_driver.activate()

import check_kernels as check  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
from kernel_specialisations import launch_specialisations  # noqa: E402
from triton.backends.nvidia.driver import CudaLauncher  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

from encoding_syncbn.kernels.triton import launch  # noqa: E402
from encoding_syncbn.kernels.triton.plan import Launch, Target  # noqa: E402

# Bytes of a kernel parameter of each type as Triton's launchers pass it.
_SIZES = {"i1": 1, "i8": 1, "u1": 1, "u8": 1, "i16": 2, "u16": 2, "fp16": 2, "bf16": 2,
          "i32": 4, "u32": 4, "fp32": 4, "i64": 8, "u64": 8, "fp64": 8}
# After the kernel's own parameters, the launchers pass two scratch pointers.
_SCRATCH = [8, 8]


def _chosen() -> list[Launch]:
    planned = [launch for _, launch in launch_specialisations(Target(False, stub_driver.H100_SMS))]
    specs = [check.launch_spec("", launch) for launch in planned]
    by_spec = {id(spec): launch for spec, launch in zip(specs, planned)}
    return [by_spec[id(spec)] for spec in check.covering(specs, 1)]


def _on_cpu(planned: Launch, misaligned: bool, real: dict | None = None) -> Launch:
    """``planned`` with a small CPU tensor for each meta tensor (one per meta tensor: aliases
    stay aliases, across the launches given one ``real``); ``misaligned``: the first one
    element past a 16-byte boundary."""
    real = {} if real is None else real
    args = []
    for arg in planned.args:
        if isinstance(arg, torch.Tensor):
            if id(arg) not in real:
                first = not real
                tensor = torch.zeros(17, dtype=arg.dtype)
                real[id(arg)] = tensor[1:] if misaligned and first else tensor[:16]
            arg = real[id(arg)]
        args.append(arg)
    return planned._replace(args=tuple(args))


def _batch_backward() -> list[Launch]:
    """``batch_backward``'s two launches (the reduction, then dx following it) on meta
    tensors, planned for a 132-SM sm_90."""
    from encoding_syncbn.kernels.backend import NormParams
    from encoding_syncbn.kernels.triton.backward_dx import plan_batch_backward

    x = torch.empty((4, 16, 8, 8), dtype=torch.float16, device="meta")
    params = NormParams(*(torch.empty(16, device="meta") for _ in range(4)), "leaky_relu", 0.01)
    return plan_batch_backward(x, torch.empty_like(x), params, True, 256,
                               Target(False, stub_driver.H100_SMS))[0]


def _hot_ops(x: torch.Tensor) -> dict:
    """Per hot op of ``ops`` (those with prepared launches): its call on ``x`` (CPU, planned for
    a 132-SM sm_90), its memo, and what rebuilds its launches' arguments and ``Launch``es from a
    prepared plan as the op builds them."""
    from encoding_syncbn.kernels.backend import GammaCheck, NormParams, RunningStats
    from encoding_syncbn.kernels.triton import backward_dx, channel_stats, normalize_act, ops

    channels = x.shape[1]
    weight, bias = torch.ones(channels), torch.zeros(channels)
    running = RunningStats(torch.zeros(channels), torch.ones(channels),
                           torch.zeros((), dtype=torch.long), 0.1)
    check = GammaCheck(weight, bias, 0.016)
    params = NormParams(torch.zeros(channels), torch.ones(channels), weight, bias,
                        "leaky_relu", 0.01)
    dy, count = torch.zeros_like(x), x.numel() // channels

    def stats(plan):
        args, _ = channel_stats.batch_stats_args(plan, x, *running[:3], weight, bias)
        return (args,), [channel_stats.batch_stats_launch(plan, args)]

    def normalize(plan):
        args = normalize_act.normalize_act_args(plan, x, params, x)
        return (args,), [normalize_act.normalize_act_launch(plan, args)]

    def backward(plans):
        reduce, dx, _ = backward_dx.batch_backward_args(plans, x, dy, params, count)
        return (reduce, dx), backward_dx.batch_backward_launches(plans, reduce, dx)

    return {
        "batch_stats": (lambda: ops._batch_stats(x, 1e-5, running, check), ops._BATCH_STATS,
                        stats),
        "normalize_act": (lambda: ops._normalize_act(x, params, x), ops._NORMALIZE_ACT,
                          normalize),
        "batch_backward": (lambda: ops._batch_backward(x, dy, params, True, count),
                           ops._BATCH_BACKWARD, backward),
    }


def _prepared_launches(runs: list[int]) -> dict:
    """The hot ops' prepared launches (``launch.Prepared``): from an op's second call on, its
    launches are direct (no public launch, each reaching the driver), each handing the driver
    what Triton's public launch of the same arguments does; an input off 16 bytes takes the
    public launch; a changed shape, stride or dtype gets a plan of its own, and the memo stays
    within its bound."""
    from encoding_syncbn.kernels.triton import ops

    ops.launch_target = lambda device: Target(False, stub_driver.H100_SMS)
    x = torch.zeros((4, 16, 8, 8), dtype=torch.float16)
    found = {"not_direct": [], "different": [], "addresses_different": [],
             "not_prepared": []}
    for name, (call, memo, rebuild) in _hot_ops(x).items():
        call()  # the first: public, then prepared
        before, launched = runs[0], STUB.launches()
        call()
        if len(memo) != 1:
            found["not_prepared"].append(name)
            continue
        prepared = next(iter(memo.values()))
        if runs[0] != before or STUB.launches() != launched + len(prepared.direct):
            found["not_direct"].append(name)
        args, launches = rebuild(prepared.plan)
        for direct, direct_args, planned in zip(prepared.direct, args, launches):
            sizes = _parameter_sizes(launch.public(planned))
            STUB.record(sizes)
            launch.public(planned)
            public = STUB.recorded()
            STUB.record(sizes)
            alone = prepared._replace(direct=(direct,), keyed=(), pre_run_hooks=([],))
            if not launch.launch_prepared(alone, x.device, direct_args):
                found["not_direct"].append(name)
            if STUB.recorded() != public:
                found["different"].append(name)
            # Each tensor as its address (what ``TrainingStep`` hands): the same bytes.
            STUB.record(sizes)
            addresses = tuple(arg.data_ptr() if isinstance(arg, torch.Tensor) else arg
                              for arg in direct_args)
            if not launch.launch_direct(alone, x.device, addresses):
                found["not_direct"].append(name)
            if STUB.recorded() != public:
                found["addresses_different"].append(name)
    # An input off 16 bytes, its key's otherwise: Triton's public launch (its own kernel).
    misaligned = torch.zeros(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)
    before = runs[0]
    _hot_ops(misaligned)["batch_stats"][0]()
    found["misaligned_public"] = runs[0] == before + 1
    # The memo's key: another shape, stride or dtype is planned apart, each its own entry.
    memo = ops._BATCH_STATS
    plans = {id(prepared.plan) for prepared in memo.values()}
    others = [torch.zeros((4, 16, 8, 4), dtype=torch.float16),
              x.to(memory_format=torch.channels_last), x.float()]
    for other in others:
        _hot_ops(other)["batch_stats"][0]()
        plans.update(id(prepared.plan) for prepared in memo.values())
    found["new_plans"] = len(plans) == len(memo) == 1 + len(others)
    bound, launch._MAX_PREPARED = launch._MAX_PREPARED, 2
    try:
        for other in (x[:2], x[:3]):
            _hot_ops(other)["batch_stats"][0]()
        found["bounded"] = 0 < len(memo) <= 2
    finally:
        launch._MAX_PREPARED = bound
    return found


# Each hot op's kernels, in launch order.
_HOT_KERNELS = {"batch_stats": ["_batch_stats_kernel"],
                "normalize_act": ["_normalize_act_kernel"],
                "batch_backward": ["_backward_reduce_kernel", "_backward_dx_kernel"]}


def _by_step(step, channels: int) -> dict:
    """Per hot op, its call through the ``TrainingStep`` ``step`` on an input (CPU, float16)
    of ``channels`` channels, as a training in-place layer calls it."""
    from encoding_syncbn.kernels.backend import GammaCheck, NormParams, RunningStats

    weight, bias = torch.ones(channels), torch.zeros(channels)
    running = RunningStats(torch.zeros(channels), torch.ones(channels),
                           torch.zeros((), dtype=torch.long), 0.1)
    params = NormParams(torch.zeros(channels), torch.ones(channels), weight, bias,
                        "leaky_relu", 0.01)
    return {
        "batch_stats": lambda x: step.batch_stats(x, 1e-5, running,
                                                  GammaCheck(weight, bias, 0.016)),
        "normalize_act": lambda x: step.normalize_act(x, params, x),
        "batch_backward": lambda x: step.batch_backward(x, torch.zeros_like(x), params, True,
                                                        x.numel() // channels),
    }


def _step_launches(runs: list[int]) -> list[str]:
    """The hot ops through a layer key's ``TrainingStep`` (what ``kernels.key_ops`` makes of
    the eager ops once the Triton backend is loaded), each called anew on a fresh step: from
    each op's second call on, its launches are direct, each reaching the driver; a call of
    the same variant on an input off 16 bytes goes to the op (its launches reach the driver,
    none by the step's direct launch of the aligned kernels). The problems: an op whose
    launches were not direct (its name), or whose misaligned call was not the op's
    (``"<op> misaligned"``)."""
    from encoding_syncbn.kernels.triton import ops

    x = torch.zeros((4, 16, 8, 8), dtype=torch.float16)
    misaligned = torch.zeros(x.numel() + 1, dtype=x.dtype)[1:].view(x.shape)
    direct, launch_direct = [0], ops.launch_direct

    def counted(*args):
        direct[0] += 1
        return launch_direct(*args)

    ops.launch_direct = counted
    problems = []
    for name, call in _by_step(ops.TrainingStep(), x.shape[1]).items():
        launches = len(_HOT_KERNELS[name])
        call(x)  # public, or found in the op's memo: the step keeps it
        before, launched = runs[0], STUB.launches()
        call(x)
        if runs[0] != before or STUB.launches() != launched + launches:
            problems.append(name)
        before, launched = direct[0], STUB.launches()
        call(misaligned)
        if direct[0] != before or STUB.launches() != launched + launches:
            problems.append(f"{name} misaligned")
    ops.launch_direct = launch_direct
    return problems


def _uncounted_launches(runs: list[int]) -> list[str]:
    """``counted_launches`` (benchmarks/helpers/launches.py) around each hot op's calls, by
    the op and by a ``TrainingStep``, the first (public) and a repeat (direct): the problems,
    a call whose count is not its kernels' names or not the launches the driver saw, and a
    repeat call not direct (its launch not the one the count must see)."""
    from encoding_syncbn.kernels.triton import ops

    x = torch.zeros((4, 8, 8, 4), dtype=torch.float16)  # a key no other check planned
    by_step = _by_step(ops.TrainingStep(), x.shape[1])
    problems = []
    for name, (by_op, _, _) in _hot_ops(x).items():
        for way, call in (("op", by_op), ("step", functools.partial(by_step[name], x))):
            for repeat in (False, True):
                before, launched = runs[0], STUB.launches()
                with counted_launches() as names:
                    call()
                if names != _HOT_KERNELS[name] or STUB.launches() != launched + len(names):
                    problems.append(f"{name} by the {way}: counted {names}")
                if repeat and runs[0] != before:
                    problems.append(f"{name} by the {way}: repeat not direct")
    return problems


def _lone_dx() -> Launch:
    """``backward_dx`` from the sums of ``_batch_backward``'s reduction, alone, on meta
    tensors of its geometry."""
    from encoding_syncbn.kernels.backend import BatchSums, NormParams
    from encoding_syncbn.kernels.triton.backward_dx import plan_backward_dx

    x = torch.empty((4, 16, 8, 8), dtype=torch.float16, device="meta")
    params = NormParams(*(torch.empty(16, device="meta") for _ in range(4)), "leaky_relu", 0.01)
    sums = BatchSums(torch.empty(16, device="meta"), torch.empty(16, device="meta"), 256)
    return plan_backward_dx(x, torch.empty_like(x), params, True, sums,
                            Target(False, stub_driver.H100_SMS))[0][0]


def _parameter_sizes(compiled) -> list[int]:
    types = [t for t in compiled.src.signature.values() if t != "constexpr"]
    return [8 if t.startswith("*") else _SIZES[t] for t in types] + _SCRATCH


def _count_calls(owner: type, name: str) -> list[int]:
    """Count the calls of ``owner.name`` from now on, in the one-item list returned."""
    calls = [0]
    original = getattr(owner, name)

    def counted(self, *args, **kwargs):
        calls[0] += 1
        return original(self, *args, **kwargs)

    setattr(owner, name, counted)
    return calls


def main() -> None:
    runs = _count_calls(JITFunction, "run")
    # Triton's Python launcher around its C launch: a direct launch passes it by where
    # ``compat.triton_direct_launch`` knows this release's.
    wrapped = _count_calls(CudaLauncher, "__call__")
    cases = []  # (label, launch, the aligned launch it is a misaligned twin of)
    for planned in _chosen():
        name = planned.kernel.fn.__name__
        aligned = _on_cpu(planned, False)
        cases.append((name, aligned, None))
        if not any(label == f"{name} misaligned" for label, _, _ in cases):
            cases.append((f"{name} misaligned", _on_cpu(planned, True), aligned))

    found = {"triton": triton.__version__, "cases": len(cases),
             "kernels": sorted({label.split()[0] for label, _, _ in cases}), "different": [],
             "public_on_second_launch": [], "python_launcher_on_second_launch": [],
             "pointers_missing": [], "misaligned_shares_kernel": []}
    for label, planned, twin in cases:
        launch.launch(planned, None)  # the first: public, its compiled kernel remembered
        compiled = launch.compiled_for(planned, None)
        if twin is not None and compiled is launch.compiled_for(twin, None):
            found["misaligned_shares_kernel"].append(label)
        sizes = _parameter_sizes(compiled)
        STUB.record(sizes)
        launch.public(planned)
        public = STUB.recorded()
        before, before_wrapped = runs[0], wrapped[0]
        STUB.record(sizes)
        launch.launch(planned, None)
        direct = STUB.recorded()
        if runs[0] != before:
            found["public_on_second_launch"].append(label)
        if wrapped[0] != before_wrapped:
            found["python_launcher_on_second_launch"].append(label)
        if direct != public:
            found["different"].append(label)
        pointer = planned.args[0].data_ptr().to_bytes(8, sys.byteorder)
        if pointer not in public:
            found["pointers_missing"].append(label)

    # An op's launches one after another: the dx launch keyed after the reduction it follows
    # (``Launch.follows``) is launched directly from the second call on too.
    real: dict = {}
    pair = [_on_cpu(planned, False, real) for planned in _batch_backward()]
    launch.launch_all(pair, None)
    before, launched = runs[0], STUB.launches()
    launch.launch_all(pair, None)
    found["following_launch_direct"] = (pair[1].follows and runs[0] == before
                                        and STUB.launches() == launched + 2)
    # A lone dx launch from the same plan's sums reads the tensors the following one fixes:
    # off 16 bytes, it gets a kernel of its own.
    lone = [_on_cpu(_lone_dx(), misaligned) for misaligned in (False, True)]
    for planned in lone:
        launch.launch(planned, None)
    found["lone_dx_misaligned_apart"] = (launch.compiled_for(lone[0], None)
                                         is not launch.compiled_for(lone[1], None))

    found["prepared"] = _prepared_launches(runs)
    found["step_problems"] = _step_launches(runs)
    found["uncounted"] = _uncounted_launches(runs)

    # A launch hook sees every launch: with one set, launches take the public path again.
    planned = cases[0][1]
    hooked = []
    hook = triton.knobs.runtime.launch_enter_hook
    hook.add(hooked.append)
    try:
        before = runs[0]
        launch.launch(planned, None)
        found["hooked_launch_public"] = runs[0] == before + 1 and len(hooked) == 1
    finally:
        hook.remove(hooked.append)
    before = runs[0]
    launch.launch(planned, None)
    found["unhooked_launch_direct"] = runs[0] == before
    # After a planning constant changes (the compile options), the compiled kernels are
    # forgotten with the plans.
    forget_plans()
    found["forgotten_with_plans"] = launch.compiled_for(planned, None) is None
    print(json.dumps(found))


if __name__ == "__main__":
    main()
