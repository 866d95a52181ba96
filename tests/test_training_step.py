"""A layer key's ``TrainingStep`` hands each Triton op (or launches itself) the launches the op's
own lookup would find for the call, whatever changed since the last call (strides, in place or
not, running statistics, the check), and nothing once the compiled kernels are forgotten;
where it launches them itself, with the arguments the op's builders make.

Under the interpreter no op keeps launches (``launch.prepare`` keeps nothing there), so each op
is replaced by a stand-in that records the launches it is handed and, as the real op does on a
lookup that finds none, keeps launches of its own under the call's key in the op's memo, with
the plan the planner makes; ``launch_direct`` by one that records what it is handed. What
the step's launches compute is the layer's tests on the Triton backend (its repeat calls run
through it: ``test_call_memo``) and, launched for real on the stand-in driver, the same bytes
as Triton's public launch (``test_launch``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from late_copies import late_copies

from encoding_syncbn.kernels import GammaCheck, NormParams, RunningStats, key_ops, triton_available

pytestmark = pytest.mark.skipif(not triton_available(), reason="triton is not installed")

SHAPE = (2, 4, 3, 3)
# Each op: its function in ``ops``, its memo's and its key function's names, and how many
# arguments it takes before ``prepared`` and its key of them.
OPS = {
    "batch_stats": ("_eager_batch_stats", "_BATCH_STATS", "batch_stats_key", 4, 4),
    "normalize_act": ("_eager_normalize_act", "_NORMALIZE_ACT", "normalize_act_key", 3, 3),
    "batch_backward": ("_batch_backward", "_BATCH_BACKWARD", "batch_backward_key", 6, 4),
}


@contextlib.contextmanager
def _ops_standing_in():
    """The Triton ops module with each op replaced by a stand-in, and ``launch_direct`` by one
    that launches nothing, and ``handed``: per op call through the step, (op, the launches
    the op or ``launch_direct`` was handed, the arguments ``launch_direct`` was handed)."""
    from encoding_syncbn.kernels.triton import ops

    handed = []
    with pytest.MonkeyPatch.context() as patch:
        for name, (function, memo_name, key_name, arguments, keyed) in OPS.items():
            memo = getattr(ops, memo_name)
            patch.setattr(ops, function, _stand_in(name, memo, getattr(ops, key_name),
                                                   arguments, keyed, handed))
            memo.clear()

        def launch_direct(prepared, device, *args):
            handed.append((None, prepared, args))
            return True

        patch.setattr(ops, "launch_direct", launch_direct)
        try:
            yield ops, handed
        finally:
            for _, memo_name, *_ in OPS.values():
                getattr(ops, memo_name).clear()


def _stand_in(name, memo, key_of, arguments, keyed, handed):
    """``name``'s op: records what it is handed and, as the real op does on a lookup that
    finds nothing, keeps launches of its own under the call's key: their plan the op's, as
    the planner makes it."""
    def op(*args):
        prepared = args[arguments] if len(args) > arguments else None
        handed.append((name, prepared, None))
        if prepared is None:
            memo.setdefault(key_of(*args[:keyed]), _prepared(name, *args[:keyed]))
        return None

    return op


def _prepared(name, *args):
    from encoding_syncbn.kernels.triton import backward_dx, channel_stats, launch, normalize_act
    from encoding_syncbn.kernels.triton.plan import launch_target

    target = launch_target(args[0].device)
    if name == "batch_stats":
        x, eps, running, check = args
        plan = channel_stats.batch_stats_plan(
            x, eps, None if running is None else running.mean,
            None if running is None else running.batches,
            None if running is None else running.momentum,
            None if check is None else check.weight, 0.0 if check is None else check.limit,
            target)
    elif name == "normalize_act":
        plan = normalize_act.normalize_act_plan(args[0], args[1], target)
    else:
        saved, _, params, saved_is_output = args
        plan = backward_dx.batch_backward_plans(saved, params, saved_is_output, target)
    return launch.Prepared(plan, (), (), (), 0, None, ())


def _x(channels_last: bool) -> torch.Tensor:
    x = torch.zeros(SHAPE)
    return x.to(memory_format=torch.channels_last) if channels_last else x


# What a call may differ in, each field's values.
FIELDS = {
    "channels_last": st.booleans(),
    "eps": st.sampled_from([1e-5, 1e-3]),
    # The running statistics: whether there are any, their dtypes, the batches' counter, the
    # momentum.
    "running": st.booleans(),
    "mean_dtype": st.sampled_from([torch.float32, torch.float64]),
    "var_dtype": st.sampled_from([torch.float32, torch.float64]),
    "counted": st.booleans(),
    "momentum": st.sampled_from([0.1, None]),
    "check": st.booleans(),
    "in_place": st.booleans(),
    "activation": st.sampled_from([("leaky_relu", 0.01), ("leaky_relu", 0.2), ("elu", 1.0)]),
    "dy_dtype": st.sampled_from([torch.float32, torch.float64]),
    "dy_like_x": st.booleans(),  # else contiguous
}
FIRST = st.fixed_dictionaries(FIELDS)
# Between calls: one field changed (what a variant must notice), or the compiled kernels
# forgotten (every memo cleared: nothing kept may be handed on).
FORGET = "forget"
CHANGE = st.sampled_from([*sorted(FIELDS), FORGET]).flatmap(
    lambda field: st.tuples(st.just(field), FIELDS.get(field, st.none())))


def _run(step, op, call):
    """Call ``op`` on ``step`` with the arguments ``call`` describes: the arguments of the op's
    key, what the step answered, and what builds the launches' arguments and the op's answer
    from its plan for them as the op does."""
    from encoding_syncbn.kernels.triton import backward_dx, channel_stats, normalize_act

    x = _x(call["channels_last"])
    # Each per-channel vector a tensor of its own: the step's launches take their addresses.
    mean, invstd, weight, bias = (torch.zeros(SHAPE[1]) for _ in range(4))
    if op == "batch_stats":
        running = None
        if call["running"]:
            # (a cumulative average, momentum None, needs the counter)
            counted = call["counted"] or call["momentum"] is None
            running = RunningStats(torch.zeros(SHAPE[1], dtype=call["mean_dtype"]),
                                   torch.ones(SHAPE[1], dtype=call["var_dtype"]),
                                   torch.zeros((), dtype=torch.long) if counted else None,
                                   call["momentum"])
        check = GammaCheck(weight, bias, 0.5) if call["check"] else None
        result = step.batch_stats(x, call["eps"], running, check)
        buffers = (None,) * 3 if running is None else running[:3]
        vectors = (None, None) if check is None else check[:2]

        def build(plan):
            args, (mean, invstd, small) = channel_stats.batch_stats_args(plan, x, *buffers,
                                                                         *vectors)
            return (args,), (mean, invstd, small if check is not None else None)

        return (x, call["eps"], running, check), result, build
    params = NormParams(mean, invstd, weight, bias, *call["activation"])
    if op == "normalize_act":
        out = x if call["in_place"] else torch.empty_like(x)
        result = step.normalize_act(x, params, out)
        return (x, params, out), (result,), lambda plan: (
            (normalize_act.normalize_act_args(plan, x, params, out),), (out,))
    dy = (torch.zeros_like(x, dtype=call["dy_dtype"]) if call["dy_like_x"]
          else torch.zeros(SHAPE, dtype=call["dy_dtype"]))
    count = x.numel() // SHAPE[1]
    result = step.batch_backward(x, dy, params, call["in_place"], count)

    def build(plans):
        reduce, dx, outputs = backward_dx.batch_backward_args(plans, x, dy, params, count)
        return (reduce, dx), outputs

    return (x, dy, params, call["in_place"]), result, build


def _same_arguments(launched: tuple, built: tuple, result: tuple, outputs: tuple) -> bool:
    """Whether the step's launches' arguments are the builders', each tensor as its address
    (``launch.launch_direct``): the same tensor's, or where the builders allocate one of the
    op's outputs, the address of the step's output in its place, which is allocated alike
    (shape, strides, dtype); every other argument equal, of one type."""
    fresh = {}
    for mine, theirs in zip(result, outputs, strict=True):
        if theirs is not None:
            if (mine.shape, mine.stride(), mine.dtype) != (theirs.shape, theirs.stride(),
                                                            theirs.dtype):
                return False
            fresh[id(theirs)] = mine
    for got, want in zip(launched, built, strict=True):
        if len(got) != len(want):
            return False
        for a, b in zip(got, want):
            if isinstance(b, torch.Tensor):
                if type(a) is not int or a != fresh.get(id(b), b).data_ptr():
                    return False
            elif type(a) is not type(b) or a != b:
                return False
    return True


@settings(max_examples=100, deadline=None, derandomize=True)
@given(first=FIRST, changes=st.lists(CHANGE, max_size=12))
def test_each_op_is_handed_its_own_keys_launches(first, changes):
    """Each op call through the step hands the op, or launches itself, what the op's own
    lookup finds under the call's key, or nothing (the op looks it up); a second call of the
    same arguments has it at once. Where the step launches itself, with the arguments the
    op's builders make."""
    from encoding_syncbn.kernels.triton import launch

    with _ops_standing_in() as (ops, handed):
        step = key_ops(ops.EAGER)
        assert isinstance(step, ops.TrainingStep)
        call = dict(first)
        for field, value in [(None, None), *changes]:
            if field == FORGET:
                launch.forget_compiled()
            elif field is not None:
                call[field] = value
            for op, (_, memo_name, key_name, *_) in OPS.items():
                for again in (False, True):  # the second: its key's launches at once
                    before = len(handed)
                    key_args, result, build = _run(step, op, call)
                    ((launcher, prepared, args),) = handed[before:]
                    found = getattr(ops, memo_name).get(getattr(ops, key_name)(*key_args))
                    assert prepared is found or prepared is None and not again
                    if launcher is None:  # launched by the step itself
                        built, outputs = build(prepared.plan)
                        assert _same_arguments(args, built, result, outputs)


def test_other_backends_run_as_they_are():
    from encoding_syncbn.kernels import reference_ops

    assert key_ops(reference_ops()) is reference_ops()


def test_a_layers_statistics_launch_is_looked_up_once_while_its_flags_land_late(monkeypatch):
    """On a GPU an in-place layer's small-gamma flags reach the host calls after the check
    that wrote them (``ChannelsAside``). Its training calls hand the statistics op the same
    variant all the same: the step looks the op's launches up at its first call only, as on
    the CPU, where each call reads its own flags at once."""
    import encoding_syncbn
    from encoding_syncbn import SyncBatchNorm
    from encoding_syncbn.kernels.triton import ops

    calls = []  # per call of the op: whether it was handed a check, and kept launches

    def batch_stats(*args, op=ops._eager_batch_stats):
        calls.append((args[3] is not None, len(args) > 4))
        return op(*args)

    monkeypatch.setattr(ops, "_eager_batch_stats", batch_stats)
    encoding_syncbn.set_backend("triton")
    try:
        layer = SyncBatchNorm(4, activation="leaky_relu")
        with late_copies() as landing:
            for call in range(6):
                # A copy lands at the poll of the call after the one that made it.
                landing["now"] = call % 2 == 0
                leaf = torch.randn(8, 4, 4, 4, requires_grad=True)
                layer(leaf * 1).sum().backward()
    finally:
        encoding_syncbn.set_backend("auto")
    step = layer._call_memo.key_ops
    assert isinstance(step, ops.TrainingStep) and step._stats.variant[2] is False
    # The repeat calls' (the layer's first call plans its own): one lookup, then the kept
    # launches, each call with its check.
    assert calls == [(True, False)] + [(True, True)] * 4


def test_the_flags_are_one_buffer_of_the_steps():
    """The small-gamma flags the step's statistics launch writes lie in one buffer of the
    step's, the flags of each call with a check (written whole by each launch: the next
    test); without a check, none, and the launch is handed the address the builder's empty
    tensor has, 0."""
    call = {"channels_last": False, "eps": 1e-5, "running": True, "mean_dtype": torch.float32,
            "var_dtype": torch.float32, "counted": True, "momentum": 0.1}
    flags, addresses = [], []
    with _ops_standing_in() as (ops, handed):
        step = key_ops(ops.EAGER)
        # Each first call of a variant goes to the op (which answers None here).
        for check in (True, True, True, False, False):
            call["check"] = check
            _, result, _ = _run(step, "batch_stats", call)
            ((launcher, _, args),) = handed[-1:]
            if launcher is None:  # launched by the step itself
                flags.append(result[2])
                addresses.append(args[0][15])
    buffer = flags[0]
    assert flags[1] is buffer and flags[2] is None and buffer.shape == (SHAPE[1],)
    assert addresses == [buffer.data_ptr(), buffer.data_ptr(), 0]


@pytest.mark.parametrize("shape, channels_last, gpu", [
    ((2, 4, 3, 3), False, False), ((3, 5, 7, 2), True, False), ((4, 6, 1, 1), False, False),
    ((8, 3, 40, 40), False, True), ((9, 70, 5, 7), True, True),
])
def test_each_statistics_launch_writes_every_flag(shape, channels_last, gpu):
    """Every flag, whatever the buffer held: the step hands each call's launch the buffer the
    last call's flags lie in. Checked with every byte set before the launch, one program a
    block of channels or (``gpu``: planned for a GPU's tiles and SMs) split over programs,
    whose last writes the flags."""
    from helpers.plans import forget_plans

    from encoding_syncbn.kernels.triton import channel_stats, ops
    from encoding_syncbn.kernels.triton import plan as P
    from encoding_syncbn.layer.inplace_policy import gamma_limit, small_gamma_mask

    x = torch.randn(shape)
    if channels_last:
        x = x.to(memory_format=torch.channels_last)
    channels = shape[1]
    weight = torch.linspace(-2.0, 2.0, channels)  # |gamma| small against beta in some
    bias = torch.ones(channels)
    limit = gamma_limit(with_margin=True)
    with pytest.MonkeyPatch.context() as patch:
        if gpu:
            patch.setattr(P, "_INTERPRET_TILE_ELEMS", P._GPU_TILE_ELEMS)
        forget_plans()
        try:
            target = P.Target(False, 132) if gpu else P.launch_target(x.device)
            launches, (_, _, small) = channel_stats.plan_batch_stats(
                x, 1e-5, None, None, None, None, weight, bias, limit, target)
            assert launches[0].grid[1] > 1 or not gpu  # split over programs
            small.fill_(255)
            ops._run(launches, x.device)
        finally:
            forget_plans()
    expected = small_gamma_mask(weight, bias, limit)
    assert expected.any() and not expected.all()
    assert (small != 0).tolist() == expected.tolist()
