"""``kernels/triton/launch.py``: the compiled kernel launched directly hands the driver what
Triton's public launch hands it (CI runs this module with Triton 3.6 too)."""

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("triton")

from encoding_syncbn import compat  # noqa: E402
from encoding_syncbn.kernels.triton import launch  # noqa: E402
from encoding_syncbn.kernels.triton.plan import INTERPRET  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None
                    and shutil.which("clang") is None,
                    reason="the stand-in driver is built with a C compiler")
def test_direct_and_public_launches_hand_the_driver_the_same_arguments():
    """Every kernel, and in it every dtype, layout, tile, activation, split and integer typing
    (``tests/launch_paths.py``), aligned and misaligned: the public launch and the direct one
    give the stand-in driver the same grid, block, shared memory, stream, attributes, function
    and parameter bytes; the second launch of a specialisation is direct (on a release whose
    launcher was read, to Triton's C launch, past its Python launcher), a misaligned tensor
    gets a kernel of its own, an op's launch that follows another of its launches is direct
    from its second call on too while a lone launch of the same dx kernel off 16 bytes gets a
    kernel of its own, the hot ops' prepared launches (``launch.Prepared``) are
    direct from an op's second call on and hand the driver what the public launch of the same
    arguments does, an input off 16 bytes takes the public launch, a changed shape, stride or
    dtype gets a plan of its own and their memo stays
    within its bound, a launch hook turns the public path back on, and forgetting the
    plans after a planning constant changed (``forget_plans`` of
    benchmarks/helpers/plans.py, which plan_sweep.py calls) forgets the compiled kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(_ROOT, "tests", "launch_paths.py")],
                          capture_output=True, text=True, env=env, timeout=1200, cwd=_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["kernels"] == ["_backward_dx_kernel", "_backward_reduce_kernel",
                                "_batch_stats_kernel", "_channel_stats_kernel",
                                "_normalize_act_kernel", "_normalize_running_kernel"]
    assert found["cases"] > 2 * len(found["kernels"])
    problems = ["different", "public_on_second_launch", "pointers_missing",
                "misaligned_shares_kernel"]
    if compat.triton_c_launch_release(found["triton"]):
        problems.append("python_launcher_on_second_launch")
    for problem in problems:
        assert found[problem] == [], (problem, found)
    assert found["following_launch_direct"], found
    assert found["lone_dx_misaligned_apart"], found
    assert found["hooked_launch_public"] and found["unhooked_launch_direct"], found
    assert found["forgotten_with_plans"], found
    prepared = found["prepared"]
    for problem in ("not_direct", "different", "addresses_different", "not_prepared"):
        assert prepared[problem] == [], (problem, prepared)
    assert prepared["misaligned_public"], prepared
    assert prepared["new_plans"] and prepared["bounded"], prepared
    assert found["step_problems"] == [], found
    assert found["uncounted"] == [], found


@pytest.mark.parametrize("version,known", [
    ("3.6.0", True), ("3.7.1", True), ("3.8.0", True), ("3.9.0", True),
    ("3.9.0+git1234abcd", True), ("3.5.1", False), ("3.10.0", False), ("4.0.0", False),
    ("unknown", False)])
def test_direct_launch_only_for_triton_releases_it_was_read_against(version, known):
    assert compat.compiled_launch_release(version) is known


@pytest.mark.parametrize("version,known", [
    ("3.6.0", True), ("3.7.1", False), ("3.8.0", False), ("3.9.0", True),
    ("3.9.0+git1234abcd", True), ("3.10.0", False), ("unknown", False)])
def test_c_launch_only_for_triton_releases_it_was_read_against(version, known):
    """Triton's C launch is called directly only where its Python launcher was read; other
    releases' direct launches go through that launcher (``kernel.run``)."""
    assert compat.triton_c_launch_release(version) is known


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's launches")
def test_interpreted_launches_take_the_public_path():
    assert launch._resolve_knobs() is None


def _planned_twice(shape, dtype, channels_last, activation, first, second):
    """Each planner's launches for two calls alike in sizes, strides, dtype and options but not
    in their tensors (fresh ones) nor in the per-call values the token does not cover (the
    backward's count, the parameters' and gradients' dtypes), on meta tensors; and the ids of
    the tensors handed to the planners."""
    from encoding_syncbn.kernels.backend import BatchSums, DxCoefs, NormParams, RunningParams
    from encoding_syncbn.kernels.torch_ops import stats_dtype
    from encoding_syncbn.kernels.triton.backward_dx import (
        plan_backward_dx,
        plan_batch_backward,
    )
    from encoding_syncbn.kernels.triton.backward_reduce import plan_backward_reduce
    from encoding_syncbn.kernels.triton.channel_stats import plan_batch_stats, plan_channel_stats
    from encoding_syncbn.kernels.triton.normalize_act import (
        plan_normalize_act,
        plan_normalize_running,
    )
    from encoding_syncbn.kernels.triton.plan import Target

    target = Target(INTERPRET, 0 if INTERPRET else 132)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    acc = stats_dtype(dtype)
    calls, given = [], []
    for count, vector_dtype, grad_dtype in (first, second):
        x = torch.empty(shape, dtype=dtype, device="meta", memory_format=fmt)
        dy = torch.empty(shape, dtype=grad_dtype, device="meta", memory_format=fmt)

        given.extend((x, dy))

        def vec(dt=vector_dtype):
            given.append(torch.empty(shape[1], dtype=dt, device="meta"))
            return given[-1]

        params = NormParams(vec(acc), vec(acc), vec(), vec(), activation, 0.01)
        batches = torch.empty((), dtype=torch.long, device="meta")
        given.append(batches)
        ops = [
            plan_channel_stats(x, target)[0],
            plan_batch_stats(x, 1e-5, vec(acc), vec(), batches, 0.1, vec(), vec(), 0.016,
                             target)[0],
            plan_normalize_act(x, params, x, target)[0],
            plan_normalize_running(x, RunningParams(vec(), vec(), 1e-5, vec(), vec(),
                                                    activation, 0.01), x, target)[0],
            plan_backward_reduce(x, dy, *params, True, target)[0],
            plan_backward_dx(x, dy, params, True, DxCoefs(vec(acc), vec(acc), vec(acc)),
                             target)[0],
            plan_backward_dx(x, dy, params, True, BatchSums(vec(acc), vec(acc), count),
                             target)[0],
            plan_batch_backward(x, dy, params, True, count, target)[0],
        ]
        calls.append(ops)
    return calls, {id(t) for t in given}


@settings(max_examples=12, deadline=None, derandomize=True)
@given(shape=st.sampled_from([(4, 16, 8, 8), (2, 3, 5, 7), (8, 7), (1, 32, 16, 16)]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       channels_last=st.booleans(), activation=st.sampled_from(["leaky_relu", "elu"]),
       counts=st.tuples(st.integers(2, 2**40), st.integers(2, 2**40)),
       vector_dtypes=st.tuples(*[st.sampled_from([torch.float32, torch.float64])] * 2),
       grad_dtypes=st.tuples(*[st.sampled_from([torch.float16, torch.float32])] * 2))
def test_a_plan_token_fixes_all_the_launch_but_its_tensors(shape, dtype, channels_last,
                                                           activation, counts, vector_dtypes,
                                                           grad_dtypes):
    """Every planner names the memoised plan of its launches (``Launch.token``), which stands
    for all that Triton specialises on but the tensors' dtypes and addresses: two calls alike
    in what the plans are memoised by get the same tokens, and launches of one kernel with one
    token and the same tensor dtypes get the same key from every argument (so the compiled
    kernel found by the token is the one Triton's launch would find); the tensors a launch's
    key leaves out (``Launch.fixed``) are its planner's own, or repeats of one the key reads,
    or, in a launch that ``follows`` another of its op, one that launch's key reads."""
    if channels_last and len(shape) != 4:
        channels_last = False
    (first_ops, second_ops), given = _planned_twice(shape, dtype, channels_last, activation,
                                                    *zip(counts, vector_dtypes, grad_dtypes))
    first, second = ([p for op in call for p in op] for call in (first_ops, second_ops))
    assert all(planned.token is not None for planned in first + second)
    assert [p.token for p in first] == [p.token for p in second]
    read_before: list = []
    for planned in first + second:
        read = [arg for i, arg in enumerate(planned.args) if i not in planned.fixed]
        for i in planned.fixed:
            arg = planned.args[i]
            assert isinstance(arg, torch.Tensor), (planned.kernel.fn.__name__, i)
            assert id(arg) not in given or any(
                arg is other for other in read + (read_before if planned.follows else [])), (
                planned.kernel.fn.__name__, i)
        read_before = read
    by_token: dict[tuple, tuple] = {}
    for call in (first_ops, second_ops):
        for op in call:
            key = None
            arguments = ()
            for planned in op:  # keyed as ``launch_all`` keys an op's launches
                key = launch._key(planned, None, key)
                # meta tensors lie at 0: aligned, keyed by the token
                assert key[1] is planned.token
                # the launch's own arguments and those of the launches it follows
                arguments = (*arguments, launch._argument_key(planned, None)) \
                    if planned.follows else (launch._argument_key(planned, None),)
                assert by_token.setdefault(key, arguments) == arguments, \
                    planned.kernel.fn.__name__
