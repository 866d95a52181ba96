"""A layer key's ``TrainingStep`` hands each Triton op the launches the op's own lookup would find
for the call, whatever changed since the last call (strides, in place or not, running
statistics, the check), and nothing once the compiled kernels are forgotten.

Under the interpreter no op keeps launches (``launch.prepare`` keeps nothing there), so each op
is replaced by a stand-in that records the launches it is handed and, as the real op does on a
lookup that finds none, keeps a token of its own under the call's key in the op's memo. The
numbers the layer computes through the step are the tests of the layer on the Triton backend
(its repeat calls run through it: ``test_call_memo``).
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

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
    """The Triton ops module with each op replaced by a stand-in, and ``handed``: per call,
    (op, what it was handed, what its memo held under the call's key as it ran)."""
    from encoding_syncbn.kernels.triton import ops

    handed = []
    with pytest.MonkeyPatch.context() as patch:
        for name, (function, memo_name, key_name, arguments, keyed) in OPS.items():
            memo = getattr(ops, memo_name)
            patch.setattr(ops, function, _stand_in(name, memo, getattr(ops, key_name),
                                                   arguments, keyed, handed))
            memo.clear()
        try:
            yield ops, handed
        finally:
            for _, memo_name, *_ in OPS.values():
                getattr(ops, memo_name).clear()


def _stand_in(name, memo, key_of, arguments, keyed, handed):
    def op(*args):
        prepared = args[arguments] if len(args) > arguments else None
        key = key_of(*args[:keyed])
        handed.append((name, prepared, memo.get(key)))
        if prepared is None:
            memo.setdefault(key, object())  # what the real op's first launch of a key keeps
        return None

    return op


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
}
FIRST = st.fixed_dictionaries(FIELDS)
# Between calls: one field changed (what a variant must notice), or the compiled kernels
# forgotten (every memo cleared: nothing kept may be handed on).
FORGET = "forget"
CHANGE = st.sampled_from([*sorted(FIELDS), FORGET]).flatmap(
    lambda field: st.tuples(st.just(field), FIELDS.get(field, st.none())))


def _run(step, op, call):
    """Call ``op`` on ``step`` with the arguments ``call`` describes."""
    x = _x(call["channels_last"])
    vector = torch.zeros(SHAPE[1])
    if op == "batch_stats":
        running = None
        if call["running"]:
            running = RunningStats(torch.zeros(SHAPE[1], dtype=call["mean_dtype"]),
                                   torch.ones(SHAPE[1], dtype=call["var_dtype"]),
                                   torch.zeros((), dtype=torch.long) if call["counted"] else None,
                                   call["momentum"])
        check = GammaCheck(vector, vector, 0.5) if call["check"] else None
        step.batch_stats(x, call["eps"], running, check)
        return
    params = NormParams(vector, vector, vector, vector, *call["activation"])
    if op == "normalize_act":
        step.normalize_act(x, params, x if call["in_place"] else torch.empty_like(x))
        return
    step.batch_backward(x, torch.zeros(SHAPE, dtype=call["dy_dtype"]), params,
                        call["in_place"], x.numel() // SHAPE[1])


@settings(max_examples=100, deadline=None, derandomize=True)
@given(first=FIRST, changes=st.lists(CHANGE, max_size=12))
def test_each_op_is_handed_its_own_keys_launches(first, changes):
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
            for op in OPS:
                before = len(handed)
                _run(step, op, call)
                _run(step, op, call)  # the same again: its key's launches handed at once
                (_, first, found), (_, second, found_again) = handed[before:]
                assert first is None or first is found  # None: the op looks them up itself
                assert second is found_again is not None


def test_other_backends_run_as_they_are():
    from encoding_syncbn.kernels import reference_ops

    assert key_ops(reference_ops()) is reference_ops()
