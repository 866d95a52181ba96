"""The Triton kernels against the ATen reference (``torch_ops``), on Triton's CPU interpreter.

pytest imports every test module into one process: the interpreter switch must be in the
environment before anything imports triton, hence the first statements below.
"""

import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
from hypothesis import example, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from flat_ops import REFERENCE as R  # noqa: E402
from flat_ops import triton_ops as flat_triton_ops  # noqa: E402
from fresh_python import run_fresh  # noqa: E402
from helpers.launches import counted_launches  # noqa: E402
from helpers.plans import forget_plans  # noqa: E402

from encoding_syncbn.activations import elu_inverse_floor  # noqa: E402
from encoding_syncbn.kernels import (  # noqa: E402
    TORCH,
    BatchSums,
    GammaCheck,
    NormParams,
    RunningStats,
    dx_coefs,
    torch_ops,
)
from encoding_syncbn.kernels.triton import activations as TA  # noqa: E402
from encoding_syncbn.kernels.triton import backward_reduce as TB  # noqa: E402
from encoding_syncbn.kernels.triton import channel_stats as TS  # noqa: E402
from encoding_syncbn.kernels.triton import finalize_stats as TF  # noqa: E402
from encoding_syncbn.kernels.triton import ops as triton_ops  # noqa: E402
from encoding_syncbn.kernels.triton import plan as P  # noqa: E402
from encoding_syncbn.kernels.triton import tiles as TT  # noqa: E402

T = flat_triton_ops()

if P.INTERPRET:
    DEVICE = "cpu"
elif torch.cuda.is_available():
    DEVICE = "cuda"
else:
    pytest.skip("triton was imported without TRITON_INTERPRET=1 and there is no GPU",
                allow_module_level=True)

# (rtol, atol) for results in each dtype. Statistics and reductions are float32 for the half
# types, so they get float32's tolerance; elementwise outputs are compared after rounding.
TOL = {
    torch.float64: (1e-12, 1e-12),
    torch.float32: (2e-6, 2e-6),
    torch.float16: (1e-3, 1e-3),
    torch.bfloat16: (8e-3, 8e-3),
}
# Sums over a channel: absolute error grows with the number of terms and their size.
SUM_TOL = {torch.float64: 1e-12, torch.float32: 2e-6}

ALL_ACTIVATIONS = ("none", "identity", "leaky_relu", "elu", "relu")
SLOPE = {"none": 0.01, "identity": 0.01, "leaky_relu": 0.1, "elu": 1.3, "relu": 0.0,
         "silu": 0.0, "gelu": 0.0, "gelu_tanh": 0.0}

# (shape, layout): 2-D to 5-D, contiguous and channels-last, sizes not multiples of any block.
CASES = [
    ((7, 5), "nchw"),
    ((4, 3, 10), "nchw"),
    ((4, 3, 10), "last"),
    ((3, 5, 7, 9), "nchw"),
    ((3, 5, 7, 9), "last"),
    ((2, 3, 4, 5, 6), "nchw"),
    ((2, 3, 4, 5, 6), "last"),
]
CASE_IDS = [f"{'x'.join(map(str, s))}-{fmt}" for s, fmt in CASES]


def layout(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Same values; ``last`` puts channels innermost (channels_last / _3d for 4-D / 5-D)."""
    if fmt == "nchw":
        return x.contiguous()
    last = x.permute(0, *range(2, x.dim()), 1).contiguous()
    return last.permute(0, x.dim() - 1, *range(1, x.dim() - 1))


def make_input(shape, dtype, fmt="nchw", seed=0, mean_scale=3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    c = shape[1]
    per_channel = (1, c) + (1,) * (len(shape) - 2)
    offset = torch.randn(per_channel, generator=g, dtype=torch.float64) * mean_scale
    scale = torch.rand(per_channel, generator=g, dtype=torch.float64) * 2 + 0.25
    x = torch.randn(shape, generator=g, dtype=torch.float64) * scale + offset
    return layout(x.to(dtype), fmt).to(DEVICE)


def make_params(c, acc, seed=1):
    """mean, invstd, weight (both signs, |w| >= 0.5 so xhat is well conditioned), bias."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(c, generator=g, dtype=torch.float64)
    invstd = torch.rand(c, generator=g, dtype=torch.float64) + 0.5
    sign = torch.where(torch.rand(c, generator=g) > 0.3, 1.0, -1.0).double()
    weight = sign * (torch.rand(c, generator=g, dtype=torch.float64) + 0.5)
    bias = torch.randn(c, generator=g, dtype=torch.float64) * 0.5
    return [v.to(acc).to(DEVICE) for v in (mean, invstd, weight, bias)]


def assert_close(actual, expected, dtype, sum_terms=None):
    rtol, atol = TOL[dtype]
    if sum_terms is not None:
        atol = SUM_TOL[torch_ops.stats_dtype(dtype)] * sum_terms
    torch.testing.assert_close(actual.cpu(), expected.cpu(), rtol=rtol, atol=atol)


def upcast(t: torch.Tensor) -> torch.Tensor:
    """Half inputs in float32 for the reference: the ops promise float32 math for them, and
    torch_ops' scalar steps (``y / alpha``, ``y + alpha``) would otherwise run in half."""
    return t.float() if t.dtype in (torch.float16, torch.bfloat16) else t


def reference_stats(x):
    """The ATen reference, computed in float64 for a ground truth."""
    mean, m2, count = torch_ops.channel_stats(x.cpu().double())
    return mean, m2, count


# ------------------------------------------------------------------------------------------
# channel_stats
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shape,fmt", CASES, ids=CASE_IDS)
def test_channel_stats(shape, fmt, dtype):
    x = make_input(shape, dtype, fmt)
    mean, m2, count = T.channel_stats(x)
    ref_mean, ref_m2, ref_count = torch_ops.channel_stats(upcast(x))
    acc = torch_ops.stats_dtype(dtype)
    assert count == ref_count and mean.dtype == acc and m2.dtype == acc
    assert_close(mean, ref_mean, acc)
    assert_close(m2, ref_m2, acc)


@pytest.mark.parametrize("fmt", ["nchw", "last"])
def test_channel_stats_split_reduction(fmt):
    # Few channels, many tiles: the tiles of a channel are split over several programs and the
    # partial (mean, M2, n) merged by the last of them to finish, in the same launch.
    shape = (64, 2, 33, 9) if fmt == "nchw" else (64, 3, 17, 11)
    x = make_input(shape, torch.float64, fmt)
    launches, _ = TS.plan_channel_stats(x, P.launch_target(x.device))
    assert [launch.kernel for launch in launches] == [TS._channel_stats_kernel]
    assert launches[0].grid[1] > 1 and launches[0].constexprs["SPLIT"]
    mean, m2, count = T.channel_stats(x)
    ref_mean, ref_m2, _ = reference_stats(x)
    assert_close(mean, ref_mean, torch.float64)
    assert_close(m2, ref_m2, torch.float64)


def test_channel_stats_large_mean_float32():
    # mean 1e4, std 0.5: E[x^2] - E[x]^2 would lose every digit of the variance in float32.
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(16, 3, 20, 20, generator=g, dtype=torch.float64) * 0.5 + 1e4).float()
    x = x.to(DEVICE)
    mean, m2, count = T.channel_stats(x)
    ref_mean, ref_m2, _ = reference_stats(x)
    torch.testing.assert_close(mean.cpu().double(), ref_mean, rtol=1e-7, atol=0)
    torch.testing.assert_close(m2.cpu().double(), ref_m2, rtol=1e-4, atol=0)


@pytest.mark.parametrize("fmt", ["nchw", "last"])
@pytest.mark.parametrize("dtype,offset,std,m2_rtol", [
    (torch.float64, 1e8, 1e-3, 1e-9), (torch.float32, 1e4, 0.5, 2e-5),
    (torch.float16, 300.0, 2.0, 2e-5), (torch.bfloat16, 300.0, 8.0, 2e-5)])
def test_channel_stats_far_from_their_shift(fmt, dtype, offset, std, m2_rtol):
    """The statistics sum each value's deviation from a shift taken from the channel block's
    first tile. That tile far from the channel's mean (its images 20 std above the others), a
    large common offset, the tiles split over programs: the mean within a few roundings of the
    float64 truth of the same values, M2 within the statistics dtype's summation error."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(48, 3, 9, 11, generator=g, dtype=torch.float64) * std + offset
    x[:6] += 20 * std
    x = layout(x.to(dtype), fmt).to(DEVICE)
    launches, _ = TS.plan_channel_stats(x, P.launch_target(x.device))
    assert launches[0].grid[1] > 1
    mean, m2, _ = T.channel_stats(x)
    # The truth in float64, two passes about the mean with the residual's correction (the
    # reference's one-pass Welford loses 1e-5 of M2 at an offset of 1e11 std).
    values = x.cpu().double().transpose(0, 1).reshape(3, -1)
    truth_mean = values.mean(1)
    centred = values - truth_mean[:, None]
    truth_m2 = centred.square().sum(1) - centred.sum(1).square() / values.shape[1]
    eps = torch.finfo(torch_ops.stats_dtype(dtype)).eps
    torch.testing.assert_close(mean.cpu().double(), truth_mean, rtol=4 * eps, atol=0)
    torch.testing.assert_close(m2.cpu().double(), truth_m2, rtol=m2_rtol, atol=0)


@pytest.mark.parametrize("fmt", ["nchw", "last"])
@pytest.mark.parametrize("dtype,value", [(torch.float32, 3e38), (torch.float32, -1e30),
                                         (torch.bfloat16, 3e38), (torch.float16, 65504.0)])
def test_channel_stats_of_a_constant_channel_near_the_largest_value(fmt, dtype, value):
    """A constant channel: its shift is its value exactly, so the mean is the value and M2
    is 0, up to the dtype's largest values (no sum or square overflows)."""
    x = make_input((40, 3, 5, 7), dtype, fmt)
    x[:, 1] = value
    mean, m2, _ = T.channel_stats(x)
    assert mean[1].item() == x[0, 1, 0, 0].item() and m2[1].item() == 0.0
    assert torch.isfinite(mean).all() and torch.isfinite(m2).all()


def test_channel_stats_empty_batch():
    x = torch.empty(0, 4, 3, 3, device=DEVICE)
    mean, m2, count = T.channel_stats(x)
    assert count == 0
    assert torch.equal(mean.cpu(), torch.zeros(4)) and torch.equal(m2.cpu(), torch.zeros(4))


# ------------------------------------------------------------------------------------------
# normalize_act
# ------------------------------------------------------------------------------------------


def _check_normalize(x, activation, dtype, inplace):
    acc = torch_ops.stats_dtype(dtype)
    mean, invstd, weight, bias = make_params(x.shape[1], acc)
    slope = SLOPE[activation]
    expected = R.normalize_act(upcast(x), mean, invstd, weight, bias, activation, slope,
                                       torch.empty_like(upcast(x))).to(dtype)
    out = x if inplace else torch.empty_like(x)
    result = T.normalize_act(x, mean, invstd, weight, bias, activation, slope, out)
    assert result is out and result.dtype == dtype and result.stride() == expected.stride()
    assert_close(result, expected, dtype)


@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,fmt", CASES, ids=CASE_IDS)
def test_normalize_act(shape, fmt, dtype, activation):
    # float32 runs in place (out is x), float64 into a separate output.
    _check_normalize(make_input(shape, dtype, fmt), activation, dtype,
                     inplace=dtype == torch.float32)


@pytest.mark.parametrize("activation", ALL_ACTIVATIONS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["nchw", "last"])
def test_normalize_act_half_inplace(fmt, dtype, activation):
    _check_normalize(make_input((3, 5, 7, 9), dtype, fmt), activation, dtype, inplace=True)


def test_normalize_act_large_mean_float32():
    # (x - mean) * scale + bias keeps the normalised value where x * scale + shift would not.
    g = torch.Generator().manual_seed(4)
    x = (torch.randn(8, 3, 9, 9, generator=g, dtype=torch.float64) * 0.5 + 1e4).float()
    mean, m2, count = torch_ops.channel_stats(x)
    invstd = (m2 / count).rsqrt()
    weight, bias = torch.ones(3), torch.zeros(3)
    out = T.normalize_act(x.to(DEVICE), mean.to(DEVICE), invstd.to(DEVICE), weight.to(DEVICE),
                          bias.to(DEVICE), "identity", 0.0, torch.empty_like(x, device=DEVICE))
    exact = (x.double() - mean.double().view(1, 3, 1, 1)) * invstd.double().view(1, 3, 1, 1)
    torch.testing.assert_close(out.cpu().double(), exact, rtol=0, atol=1e-5)


@pytest.mark.parametrize("dtype,running_dtype", [
    (torch.float64, torch.float64), (torch.float32, torch.float32),
    (torch.float16, torch.float32), (torch.bfloat16, torch.bfloat16),
    (torch.float32, torch.float16)])
@pytest.mark.parametrize("shape,fmt", CASES[1:5], ids=CASE_IDS[1:5])
def test_normalize_running(shape, fmt, dtype, running_dtype):
    """Evaluation in one launch: the output as ``normalize_act`` gives it from the reference's
    (mean, invstd), and those (mean, invstd) to the last bit (the running mean in the
    statistics dtype, ``1 / sqrt(var + eps)`` correctly rounded as the CPU's rsqrt), from
    buffers of any dtype, in place or not; the buffers untouched."""
    x = make_input(shape, dtype, fmt)
    acc = torch_ops.stats_dtype(dtype)
    g = torch.Generator().manual_seed(4)
    c = shape[1]
    running_mean = (torch.randn(c, generator=g, dtype=torch.float64) * 3).to(running_dtype)
    running_var = (torch.rand(c, generator=g, dtype=torch.float64) * 4 + 1e-3).to(running_dtype)
    _, _, weight, bias = make_params(c, acc)
    buffers = running_mean.clone(), running_var.clone()
    ref_out = torch.empty_like(upcast(x))
    ref_mean, ref_invstd = R.normalize_running(upcast(x), running_mean, running_var,
                                                       1e-3, weight, bias, "elu", 1.3, ref_out)
    for inplace in (False, True):
        src = x.clone()
        out = src if inplace else torch.empty_like(src)
        mean, invstd = T.normalize_running(src, running_mean, running_var, 1e-3, weight, bias,
                                           "elu", 1.3, out)
        assert mean.dtype == invstd.dtype == acc
        torch.testing.assert_close((mean, invstd), (ref_mean, ref_invstd), rtol=0, atol=0)
        assert out.stride() == x.stride()
        assert_close(out, ref_out.to(dtype), dtype)
    torch.testing.assert_close((running_mean, running_var), buffers, rtol=0, atol=0)


def test_elu_near_zero_is_accurate():
    # expm1 for tiny negative z: exp(z) - 1 alone would keep only a few digits.
    z = -torch.logspace(-12, 1, 60, dtype=torch.float64).view(1, 60)
    ones, zeros = torch.ones(60, dtype=torch.float64), torch.zeros(60, dtype=torch.float64)
    for dtype in (torch.float64, torch.float32):
        x = z.to(dtype).to(DEVICE)
        acc = [v.to(torch_ops.stats_dtype(dtype)).to(DEVICE) for v in (zeros, ones, ones, zeros)]
        out = T.normalize_act(x, *acc, "elu", 1.0, torch.empty_like(x))
        torch.testing.assert_close(out.cpu().double(), torch.expm1(x.cpu().double()),
                                   rtol=TOL[dtype][0] * 4, atol=0)


def test_normalize_act_other_strides_and_out_layouts():
    base = make_input((6, 4, 5, 8), torch.float32)
    x = base[:, :, :, ::2]  # neither NCHW nor channels_last: read through one copy
    mean, invstd, weight, bias = make_params(4, torch.float32)
    expected = R.normalize_act(x, mean, invstd, weight, bias, "elu", 1.0,
                                       torch.empty_like(x))
    for out in (torch.empty_like(x), torch.empty(x.shape, device=DEVICE),
                layout(torch.empty(x.shape), "last").to(DEVICE)):
        T.normalize_act(x, mean, invstd, weight, bias, "elu", 1.0, out)
        assert_close(out, expected, torch.float32)
    # In place on the strided view: its elements change, the ones between them do not.
    untouched = base[:, :, :, 1::2].clone()
    T.normalize_act(x, mean, invstd, weight, bias, "elu", 1.0, x)
    assert_close(x, expected, torch.float32)
    assert torch.equal(base[:, :, :, 1::2], untouched)


# ------------------------------------------------------------------------------------------
# backward_reduce and backward_dx
# ------------------------------------------------------------------------------------------

VARIANTS = [(a, False) for a in ALL_ACTIVATIONS] + [
    (a, True) for a in ALL_ACTIVATIONS if a != "relu"
]
VARIANT_IDS = [f"{a}-{'y' if s else 'x'}" for a, s in VARIANTS]


def _check_backward(shape, fmt, dtype, activation, saved_is_output, dy_fmt=None, seed=0):
    acc = torch_ops.stats_dtype(dtype)
    x = make_input(shape, dtype, fmt, seed=seed)
    mean, invstd, weight, bias = make_params(shape[1], acc, seed=seed + 1)
    slope = SLOPE[activation]
    if saved_is_output:
        saved = R.normalize_act(x, mean, invstd, weight, bias, activation, slope,
                                        torch.empty_like(x))
    else:
        saved = x
    dy = make_input(shape, dtype, dy_fmt or fmt, seed=seed + 2, mean_scale=0.0)
    coefs = make_params(shape[1], acc, seed=seed + 3)[1:]
    terms = x.numel() // shape[1]

    sums = T.backward_reduce(saved, dy, mean, invstd, weight, bias, activation, slope,
                             saved_is_output)
    # The reference gets dy in saved's layout: same values, and torch_ops (as of writing) fails
    # to write dx when saved is channels_last and dy is not.
    ref_dy = upcast(layout(dy, fmt))
    ref_sums = R.backward_reduce(upcast(saved), ref_dy, mean, invstd, weight, bias,
                                         activation, slope, saved_is_output)
    for got, ref in zip(sums, ref_sums):
        assert got.dtype == acc
        assert_close(got, ref, acc, sum_terms=terms)

    dx = T.backward_dx(saved, dy, mean, invstd, weight, bias, activation, slope,
                       saved_is_output, *coefs)
    ref_dx = R.backward_dx(upcast(saved), ref_dy, mean, invstd, weight, bias,
                                   activation, slope, saved_is_output, *coefs).to(dtype)
    assert dx.dtype == dtype and dx.stride() == saved.stride()
    assert_close(dx, ref_dx, dtype)

    # The coefficients of a layer on its own batch, derived in the kernel from the sums: the
    # same bits as given in dx_coefs' order, and close to the reference from the same sums.
    params = NormParams(mean, invstd, weight, bias, activation, slope)
    batch = BatchSums(*sums, terms)
    from_sums = triton_ops.EAGER.backward_dx(saved, dy, params, saved_is_output, batch)
    given = triton_ops.EAGER.backward_dx(saved, dy, params, saved_is_output,
                                         dx_coefs(params, batch))
    torch.testing.assert_close(from_sums, given, rtol=0, atol=0)
    ref_from_sums = TORCH.backward_dx(upcast(saved), ref_dy, params, saved_is_output,
                                      batch).to(dtype)
    assert_close(from_sums, ref_from_sums, dtype)

    # Both in one call (one plan lookup, the same three launches): the same bits as the two
    # calls, eagerly and through the registered ops; the reference's (ATen's fused BatchNorm
    # backward) close to its two.
    for backend in (triton_ops.EAGER, triton_ops.TRACED):
        dx_sums = backend.batch_backward(saved, dy, params, saved_is_output, terms)
        torch.testing.assert_close(dx_sums, (from_sums, *sums), rtol=0, atol=0)
    ref_sums = TORCH.backward_reduce(upcast(saved), ref_dy, params, saved_is_output)
    ref_dx, *ref_batch_sums = TORCH.batch_backward(upcast(saved), ref_dy, params,
                                                   saved_is_output, terms)
    for got, ref in zip(ref_batch_sums, ref_sums):
        assert_close(got, ref, acc, sum_terms=terms)
    # dx from its own sums: sums that differ by their rounding move every dx by up to that
    # rounding times |xhat|, which the elementwise tolerance does not cover.
    assert_close(ref_dx.to(dtype), TORCH.backward_dx(upcast(saved), ref_dy, params,
                                                     saved_is_output,
                                                     BatchSums(*ref_batch_sums, terms)
                                                     ).to(dtype), dtype)


@pytest.mark.parametrize("activation,saved_is_output", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("shape,fmt", CASES, ids=CASE_IDS)
def test_backward_float64(shape, fmt, activation, saved_is_output):
    _check_backward(shape, fmt, torch.float64, activation, saved_is_output)


@pytest.mark.parametrize("activation,saved_is_output", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("fmt", ["nchw", "last"])
def test_backward_float32(fmt, activation, saved_is_output):
    _check_backward((3, 5, 7, 9), fmt, torch.float32, activation, saved_is_output)


@pytest.mark.parametrize("activation,saved_is_output",
                         [("leaky_relu", True), ("elu", True), ("relu", False)])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("fmt", ["nchw", "last"])
def test_backward_half(fmt, dtype, activation, saved_is_output):
    _check_backward((3, 5, 7, 9), fmt, dtype, activation, saved_is_output)


@settings(max_examples=12, deadline=None, derandomize=True)
@given(c=st.sampled_from([1, 2, 5, 64, 100]), fmt=st.sampled_from(["nchw", "last"]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       variant=st.sampled_from(VARIANTS), sms=st.sampled_from([None, 1, 8, 132]),
       groups=st.booleans(), seed=st.integers(0, 2**16))
@example(c=2, fmt="last", dtype=torch.float32, variant=("leaky_relu", True), sms=132,
         groups=False, seed=0)
@example(c=300, fmt="nchw", dtype=torch.float16, variant=("elu", True), sms=132, groups=False,
         seed=1)
# Split more ways than a merge step takes (71 programs, 64 rows a step): two levels.
@example(c=5, fmt="last", dtype=torch.float16, variant=("elu", False), sms=132, groups=True,
         seed=2)
def test_backward_planned_for_any_target(c, fmt, dtype, variant, sms, groups, seed):
    """The backward reduction and dx, planned as for the interpreter (``sms`` None) or for a
    GPU of 1-132 SMs: split over programs or not, the partial buffer's two planes merged in one
    step or several (few channels get many rows), in one level or in groups, against the
    reference."""
    # Few channels get many rows (float64's GPU tiles are 2 rows: 12 images give 6 tiles), more
    # where the merge may take groups.
    rows = 12 if dtype == torch.float64 and sms is not None else 200 if groups else 60
    shape = (rows, c, 5, 9) if c < 16 else (2, c, 3, 5)
    with pytest.MonkeyPatch.context() as patch:
        if sms is not None:
            patch.setattr(triton_ops, "launch_target", lambda device: P.Target(False, sms))
        patch.setattr(P, "_MERGE_IN_GROUPS", groups)
        forget_plans()
        try:
            _check_backward(shape, fmt, dtype, *variant, seed=seed)
        finally:
            forget_plans()


# SiLU and GELU (out of place only: saved x). Few cases: the interpreter is slow.
SMOOTH = ("silu", "gelu", "gelu_tanh")


@pytest.mark.parametrize("activation", SMOOTH)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("shape,fmt", [((4, 3, 10), "nchw"), ((3, 5, 7, 9), "last")],
                         ids=["4x3x10-nchw", "3x5x7x9-last"])
def test_smooth_activations(shape, fmt, dtype, activation):
    _check_normalize(make_input(shape, dtype, fmt), activation, dtype, inplace=False)
    _check_backward(shape, fmt, dtype, activation, False)


@pytest.mark.parametrize("activation", SMOOTH)
def test_smooth_activations_float32_accuracy(activation):
    """Over z in [-30, 30] (both tails, and near 0), in float32: act(z) and dy * act'(z) within
    a few float32 roundings of float64 torch."""
    z = torch.cat([torch.linspace(-30, 30, 601), torch.logspace(-8, 0, 40),
                   -torch.logspace(-8, 0, 40)]).view(1, -1)
    n = z.shape[1]
    ones, zeros = torch.ones(n), torch.zeros(n)
    params = [v.to(DEVICE) for v in (zeros, ones, ones, zeros)]
    x = z.to(DEVICE)
    want = R.normalize_act(z.double(), *(v.double() for v in (zeros, ones, ones, zeros)),
                                   activation, 0.0, torch.empty_like(z.double()))
    got = T.normalize_act(x, *params, activation, 0.0, torch.empty_like(x))
    torch.testing.assert_close(got.cpu().double(), want, rtol=1e-6, atol=1e-7)
    # dx = 1 * dz + 0 * xhat + 0: the derivative itself, dy = 1.
    coefs = (params[1], params[0], params[0])
    got_dz = T.backward_dx(x, torch.ones_like(x), *params, activation, 0.0, False, *coefs)
    want_dz = R.backward_dx(z.double(), torch.ones_like(want),
                                    *(v.double() for v in (zeros, ones, ones, zeros)),
                                    activation, 0.0, False, *(v.double() for v in (ones, zeros,
                                                                                  zeros)))
    torch.testing.assert_close(got_dz.cpu().double(), want_dz, rtol=1e-6, atol=1e-7)


@triton.jit
def _activation_probe(x_ptr, y_ptr, ACTIVATION: tl.constexpr, SAVED_IS_OUTPUT: tl.constexpr):
    offsets = tl.arange(0, 16)
    x = tl.load(x_ptr + offsets)
    if SAVED_IS_OUTPUT:
        y, dz = TA.xhat_dz(x, x, 0.0, 1.0, 1.0, 0.0, 0.5, ACTIVATION, True)
    else:
        y = TA.activate(x, 0.5, ACTIVATION)
    tl.store(y_ptr + offsets, y)


@pytest.mark.parametrize("activation,saved_is_output",
                         [("swish", False), ("silu", True), ("relu", True)])
def test_unknown_or_non_invertible_activation_id_fails_to_compile(activation, saved_is_output):
    """No catch-all branch: an id with no Triton code (or no inverse, from the output) is a
    compile error, never some other activation's code."""
    x = torch.zeros(16, device=DEVICE)
    with pytest.raises(Exception, match="unknown activation id|without an inverse"):
        _activation_probe[(1,)](x, torch.empty_like(x), activation, saved_is_output)
    _activation_probe[(1,)](x, torch.empty_like(x), "leaky_relu", saved_is_output)


@triton.jit
def _constants_probe(like_ptr, out_ptr):
    like = tl.load(like_ptr)
    tl.store(out_ptr, TA._elu_floor(like))
    tl.store(out_ptr + 1, TA._sqrt1_2(like))
    tl.store(out_ptr + 2, TA._inv_sqrt_2pi(like))
    tl.store(out_ptr + 3, TA._gelu_tanh_beta(like))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_activation_constants_are_their_definitions(dtype):
    """The kernels' constants, literals in their source, are their definitions rounded once
    to the operand's dtype."""
    out = torch.empty(4, dtype=dtype, device=DEVICE)
    _constants_probe[(1,)](torch.zeros(1, dtype=dtype, device=DEVICE), out)
    want = torch.tensor([elu_inverse_floor(dtype), math.sqrt(0.5), 1.0 / math.sqrt(2.0 * math.pi),
                         math.sqrt(2.0 / math.pi)], dtype=torch.float64).to(dtype)
    assert torch.equal(out.cpu(), want)


@triton.jit
def _float64_invstd_probe(m2_ptr, out_ptr, n: tl.float64, eps: tl.float64,
                          BLOCK: tl.constexpr):
    offsets = tl.arange(0, BLOCK)
    tl.store(out_ptr + offsets, TF._float64_invstd(tl.load(m2_ptr + offsets), n, eps))


@settings(max_examples=12, deadline=None, derandomize=True)
@given(m2=st.lists(st.floats(0.0, allow_infinity=False, allow_nan=False), min_size=16,
                   max_size=16),
       count=st.integers(1, 2**40), eps=st.sampled_from([0.0, 1e-5, 1e-3]))
# Dividends within 2^-53 of float64's largest: ``q n`` overflows (float64's largest over 14),
# or the halves of Dekker's split do (the ATen version's, one ulp below it over 2^36 + 1).
@example(m2=[1.7976931348623157e308] * 16, count=14, eps=0.0)
@example(m2=[1.7976931348623155e308] * 16, count=2**36 + 1, eps=0.0)
def test_kernel_float64_invstd_is_the_aten_ones(m2, count, eps):
    """The kernels' float64 invstd (``finalize_stats._float64_invstd``) is
    ``torch_ops.float64_invstd``'s to the bit, over float64's whole range of M2: the same
    double-double steps, the quotient's exact remainder from a fused multiply-add there."""
    values = torch.tensor(m2, dtype=torch.float64)
    out = torch.empty_like(values, device=DEVICE)
    _float64_invstd_probe[(1,)](values.to(DEVICE), out, float(count), eps, len(m2))
    want = torch_ops.float64_invstd(values, float(count), eps)
    torch.testing.assert_close(out.cpu(), want, rtol=0, atol=0)


@pytest.mark.parametrize("fmt", ["nchw", "last"])
def test_backward_split_reduction(fmt):
    shape = (64, 2, 33, 9) if fmt == "nchw" else (64, 3, 17, 11)
    x = make_input(shape, torch.float64, fmt)
    launches, _ = TB.plan_backward_reduce(x, x, *make_params(shape[1], torch.float64),
                                          "elu", 1.0, True, P.launch_target(x.device))
    assert [launch.kernel for launch in launches] == [TB._backward_reduce_kernel]
    assert launches[0].grid[1] > 1 and launches[0].constexprs["SPLIT"]
    _check_backward(shape, fmt, torch.float64, "elu", True)


def test_backward_dy_in_another_layout():
    _check_backward((3, 5, 7, 9), "last", torch.float64, "leaky_relu", True, dy_fmt="nchw")
    _check_backward((3, 5, 7, 9), "nchw", torch.float64, "leaky_relu", True, dy_fmt="last")


def test_backward_gpu_tile_shapes(monkeypatch):
    # The interpreter normally gets bigger tiles; run the GPU tile shapes too: several tiles and
    # several channel blocks per launch, partial blocks on both axes.
    monkeypatch.setattr(P, "_INTERPRET_TILE_ELEMS", P._GPU_TILE_ELEMS)
    forget_plans()
    try:
        for shape, fmt in [((40, 3, 5, 13), "nchw"), ((3, 2, 41, 50), "nchw"),
                           ((9, 70, 5, 7), "last"), ((30, 11, 9, 9), "last")]:
            x = make_input(shape, torch.float64, fmt)
            # Planned anew, not a stale plan.
            planned = P.plan_op(x, P.launch_target(x.device), reduction=True).constexprs
            assert planned["BLOCK_A"] * planned["BLOCK_B"] == P._GPU_TILE_ELEMS
            mean, m2, _ = T.channel_stats(x)
            ref_mean, ref_m2, _ = reference_stats(x)
            assert_close(mean, ref_mean, torch.float64)
            assert_close(m2, ref_m2, torch.float64)
            _check_backward(shape, fmt, torch.float64, "elu", True)
    finally:
        monkeypatch.undo()
        forget_plans()  # no plan for the GPU tiles left for the tests after this one


@settings(max_examples=10, deadline=None, derandomize=True)
@given(fmt=st.sampled_from(["nchw", "last"]), which=st.integers(0, 2),
       gpu_tiles=st.booleans(), n=st.integers(2, 5), c=st.sampled_from([1, 3, 12, 40, 70]),
       spatial=st.sampled_from([(1, 1), (2, 3), (2, 6), (4, 6), (7, 7), (9, 15)]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       sms=st.sampled_from([None, 132]), seed=st.integers(0, 2**16))
@example(fmt="nchw", which=2, gpu_tiles=True, n=3, c=70, spatial=(9, 15),
         dtype=torch.float32, sms=132, seed=0)  # channel rows: split, 3 blocks, partial last
@example(fmt="nchw", which=2, gpu_tiles=False, n=2, c=40, spatial=(7, 7), dtype=torch.float16,
         sms=None, seed=1)  # channel rows: 2 images of 7x7, unsplit
@example(fmt="nchw", which=2, gpu_tiles=True, n=3, c=70, spatial=(2, 6), dtype=torch.float16,
         sms=132, seed=2)  # channel rows of 12 positions: ALIGN 4
@example(fmt="nchw", which=0, gpu_tiles=True, n=5, c=3, spatial=(4, 6), dtype=torch.bfloat16,
         sms=132, seed=3)  # rows of images of 24 positions: ALIGN 8
@example(fmt="last", which=1, gpu_tiles=True, n=4, c=12, spatial=(2, 3), dtype=torch.float32,
         sms=132, seed=4)  # channels_last rows of 12 channels: ALIGN 4
@example(fmt="last", which=0, gpu_tiles=False, n=2, c=40, spatial=(9, 15), dtype=torch.float16,
         sms=None, seed=11792)  # 270 rows summed one after another: M2 off by 3e-6 in float32
def test_every_tile_computes_the_same(fmt, which, gpu_tiles, n, c, spatial, dtype, sms, seed):
    """Each tile the planner may choose (``tile_choices``: NCHW rows of images, one long run,
    rows of channels; channels_last's two widths), forced whatever the padding would pick, at
    the interpreter's and the GPU's sizes, split over programs or not, rows of every
    alignment (``ALIGN`` 1 to 8): the statistics, the batch statistics, the normalisation and
    the backward as the reference computes them."""
    shape = (n, c, *spatial)
    channels_last = fmt == "last" or spatial == (1, 1)  # (N, C, 1, 1) reads as rows of C
    choices = P.tile_choices(channels_last, dtype, interpret=not gpu_tiles)
    tile = choices[which % len(choices)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(P, "_pick_tile", lambda geo, dtype, interpret: tile)
        if sms is not None:
            patch.setattr(triton_ops, "launch_target", lambda device: P.Target(False, sms))
        forget_plans()
        try:
            x = make_input(shape, dtype, fmt, seed=seed)
            planned = P.plan_op(x, P.launch_target(x.device), reduction=True)
            assert planned.constexprs["CHANNEL_ROWS"] == tile.channel_rows
            mean, m2, _ = T.channel_stats(x)
            ref_mean, ref_m2, _ = torch_ops.channel_stats(upcast(x))
            acc = torch_ops.stats_dtype(dtype)
            assert_close(mean, ref_mean, acc)
            # M2 sums n squares: the interpreter reduces a tile's rows one after another
            # (NumPy along axis 0), an error of up to n roundings in float32.
            assert_close(m2, ref_m2, acc, sum_terms=x.numel() // c)
            running, weight, bias, limit = finalize_inputs(c, acc, acc, True, 0.1, True, seed)
            check_batch_stats(x, running, weight, bias, limit, 0.1)
            _check_normalize(x, "leaky_relu", dtype, inplace=False)
            _check_backward(shape, fmt, dtype, "elu", True, seed=seed)
        finally:
            forget_plans()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("n,c,s", [(8, 1024, 14 * 14), (2, 256, 8 * 8), (1, 512, 7 * 7),
                                   (4, 2048, 7 * 7), (64, 2048, 7 * 7)])
def test_small_maps_fill_their_tiles_on_a_gpu(n, c, s, dtype):
    """Small maps, many channels, few images (NCHW, planned for a 132-SM GPU): at least 3 of 4
    lanes of every tile hold an element (rows of 32 images of a 7x7 map held 2 of 32 rows when
    there were 2 images), and a launch has a program for each SM, none walking more than a few
    tiles."""
    geo = P._Geometry(False, n, c, s)
    for reduction in (True, False):
        tile, (blocks, splits), args = P._plan_tiles(geo, dtype, P.Target(False, 132),
                                                     reduction, None)
        covered = blocks * splits * args[-1] * tile.block_a * tile.block_b
        assert n * c * s >= 0.75 * covered, (tile, blocks, splits)
        # Fewer programs than SMs only where each has a single tile (a tensor that small).
        assert args[-1] <= 4 and (blocks * splits >= 132 or args[-1] == 1), (
            tile, blocks, splits, args)
        assert tile.channel_rows == (n < 32), tile  # 32 images fill rows of images


@settings(max_examples=60, deadline=None, derandomize=True)
@given(channels_last=st.booleans(), length=st.integers(1, 5000),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]))
def test_rows_aligned_to_the_widest_vector_that_divides_them(channels_last, length, dtype):
    """``ALIGN`` divides the row length (S positions; C channels in channels_last), and is the
    largest power of two that does, up to a 16-byte vector: the kernels then read a 14x14 map's
    float32 rows 16 bytes at a time."""
    c, s = (length, 1) if channels_last else (3, length)
    align = P.row_align(P._Geometry(channels_last, 2, c, s), dtype)
    vector = 16 // dtype.itemsize
    assert length % align == 0 and align & (align - 1) == 0 and align <= vector
    assert align == vector or (length // align) % 2 == 1


def test_a_wrong_row_alignment_changes_the_statistics(monkeypatch):
    """The kernels take ``ALIGN`` as a fact about the row length by rounding the length down to
    a multiple of it, so a planner that claimed too much would compute other sums, which the
    interpreted tests see (a hint the compiler trusted would fail only on a GPU)."""
    x = make_input((2, 3, 2, 3), torch.float16)
    monkeypatch.setattr(P, "row_align", lambda geo, dtype: 4)  # 6 positions: 2 is the truth
    forget_plans()
    try:
        mean, _, _ = T.channel_stats(x)
    finally:
        monkeypatch.undo()
        forget_plans()
    assert not torch.allclose(mean, torch_ops.channel_stats(upcast(x))[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_gpu_tiles_keep_in_tile_offsets_within_int32(dtype):
    """The kernels address a tile's elements with int32 offsets from its start: images of
    over 2**31 / 32 elements each (a (32, 96, 1025, 1025) batch) must get a tile whose
    offsets fit (one image's long run, or rows of its channels), not the 32 images that the
    padding cost alone would choose."""
    for n, c, s in [(32, 96, 1025 * 1025), (32, 256, 769 * 769), (40, 3, 5 * 13)]:
        geo = P._Geometry(False, n, c, s)
        tile = P._pick_tile(geo, dtype, interpret=False)
        rows, row_stride = (c, s) if tile.channel_rows else (n, c * s)
        assert (min(tile.block_a, rows) - 1) * row_stride + tile.block_b - 1 < 2**31, (geo, tile)
        if c * s < 2**31 // 64:  # every tile is safe: the padding cost alone decides
            # fp32: the 32x64 tile pads least; fp64's tiles are 2x64 and 1x128, which pad the
            # same here, and the tie goes to the wider one.
            wide = P.Tile(1, 128) if dtype == torch.float64 else P.Tile(32, P._NCHW_WIDTH)
            assert tile == wide, (geo, tile)
    # channels_last: rows of C channels; only absurd channel counts overflow.
    assert P._pick_tile(P._Geometry(True, 8, 2**24, 4), dtype, interpret=False).block_b == 64
    with pytest.raises(ValueError, match="channels are too many"):
        P._pick_tile(P._Geometry(True, 8, 2**31, 4), dtype, interpret=False)


@triton.jit
def _tile_offsets_kernel(off_ptr, mask_ptr, t, c0, N, C, S, R, CS, tiles_s,
                         CHANNELS_LAST: tl.constexpr, CHANNEL_ROWS: tl.constexpr,
                         BLOCK_A: tl.constexpr, BLOCK_B: tl.constexpr):
    """Stores the element offsets and mask that ``nth_tile`` gives tile ``t`` (nothing else)."""
    base, local, mask = TT.nth_tile(t, c0, N, C, S, R, CS, tiles_s, CHANNELS_LAST, CHANNEL_ROWS,
                                    BLOCK_A, BLOCK_B)
    i = tl.arange(0, BLOCK_A)[:, None] * BLOCK_B + tl.arange(0, BLOCK_B)[None, :]
    tl.store(off_ptr + i, base + local)
    tl.store(mask_ptr + i, mask)


def _tile_offsets(geo, tile, t, c0):
    """``nth_tile``'s (offsets, mask) for a tensor of geometry ``geo``, which is never allocated:
    the kernel only computes addresses. The arguments are typed as the launchers pass them
    (int32 below 2**31, int64 above), and the interpreter wraps int32 as a GPU does."""
    n, c, s = geo.n, geo.c, geo.s
    tiles_s = 1 if geo.channels_last else -(-s // tile.block_b)
    off = torch.empty(tile.block_a * tile.block_b, dtype=torch.int64)
    mask = torch.empty(tile.block_a * tile.block_b, dtype=torch.bool)
    with triton_ops._INTERPRETER_LOCK:
        _tile_offsets_kernel[(1,)](off, mask, t, c0, n, c, s, n * s, c * s, tiles_s,
                                   geo.channels_last, tile.channel_rows, tile.block_a,
                                   tile.block_b)
    return off.view(tile.block_a, tile.block_b), mask.view(tile.block_a, tile.block_b)


def _expected_tile_offsets(geo, tile, t, c0):
    """The same in exact Python integers (layouts of the module docstring)."""
    a = torch.arange(tile.block_a, dtype=torch.int64)[:, None]
    b = torch.arange(tile.block_b, dtype=torch.int64)[None, :]
    n, c, s = geo.n, geo.c, geo.s
    if geo.channels_last:
        r, ch = t * tile.block_a + a, c0 + b
        return r * c + ch, (r < n * s) & (ch < c)
    tiles_s = -(-s // tile.block_b)
    pos = (t % tiles_s) * tile.block_b + b
    if tile.channel_rows:
        img, ch = t // tiles_s, c0 + a
        return (img * c + ch) * s + pos, (ch < c) & (pos < s)
    img = (t // tiles_s) * tile.block_a + a
    return (img * c + c0) * s + pos, (img < n) & (pos < s)


@pytest.mark.skipif(not P.INTERPRET, reason="reads addresses through the interpreter")
@pytest.mark.parametrize("geo, tile, t, c0", [
    # One plane past 2**31 elements: the last tile's positions (s0 was int32).
    (P._Geometry(False, 1, 1, 2**31 + 100), P.Tile(1, 2048), (2**31 + 100) // 2048, 0),
    (P._Geometry(False, 2, 3, 2**31 + 100), P.Tile(1, 2048), 2 * 1048577 - 1, 2),
    # The whole tensor past 2**31 (and 2**32), each plane small: image and channel offsets.
    (P._Geometry(False, 2**20, 5, 1000), P.Tile(32, 64), 32767 * 16 + 15, 4),
    (P._Geometry(False, 3, 2**12, 2**20 + 3), P.Tile(1, 2048), 2 * 513 + 512, 4095),
    # Rows of channels: the last image's planes, the last channel block.
    (P._Geometry(False, 2**20, 70, 49), P.Tile(32, 64, True), 2**20 - 1, 64),
    # channels_last: rows past 2**31 / C, the last channel block.
    (P._Geometry(True, 2**16, 70, 2**16), P.Tile(32, 64), 2**27 - 1, 64),
    (P._Geometry(True, 7, 2**24, 33), P.Tile(128, 16), 1, 2**24 - 16),
], ids=["plane", "plane-last-channel", "batch-nchw", "batch-long-run", "batch-channel-rows",
        "batch-last",
        "many-channels"])
def test_tile_addresses_past_2_31_elements(geo, tile, t, c0):
    """Every element offset ``nth_tile`` computes for tensors past 2**31 elements, against exact
    integers, through the kernels' own index code (int32 wraps in the interpreter as on a
    GPU: with the plane's position offset in int32 the first case gives negative offsets)."""
    assert P._offsets_fit(geo, tile)
    offsets, mask = _tile_offsets(geo, tile, t, c0)
    want_offsets, want_mask = _expected_tile_offsets(geo, tile, t, c0)
    assert torch.equal(mask, want_mask)
    assert torch.equal(offsets[mask], want_offsets[want_mask])
    assert int(want_offsets[want_mask].max()) >= 2**31


def test_elu_inverse_clamp_matches_reference():
    # Outputs at or just above -alpha (rounding can put y / alpha below -1): clamped, finite.
    alpha = 1.3
    for dtype in (torch.float64, torch.float32):
        y = torch.tensor([-alpha, -alpha * (1 - 1e-9), -alpha * (1 - 1e-5), -0.5, 0.0, 2.0],
                         dtype=torch.float64).to(dtype).view(1, 6)
        dy = torch.ones_like(y)
        ones = torch.ones(6, dtype=torch_ops.stats_dtype(dtype))
        zeros = torch.zeros_like(ones)
        args = (y.to(DEVICE), dy.to(DEVICE), *(v.to(DEVICE) for v in (zeros, ones, ones, zeros)),
                "elu", alpha, True)
        coefs = (ones.to(DEVICE), ones.to(DEVICE), zeros.to(DEVICE))
        got = T.backward_dx(*args, *coefs)
        ref = R.backward_dx(y, dy, zeros, ones, ones, zeros, "elu", alpha, True,
                                    ones, ones, zeros)
        assert torch.isfinite(got.cpu()).all()
        assert_close(got, ref, dtype)


def test_argument_errors():
    x = make_input((2, 3, 4), torch.float32)
    params = make_params(3, torch.float32)
    with pytest.raises(ValueError, match="cannot be inverted"):
        T.backward_reduce(x, x, *params, "relu", 0.0, True)
    with pytest.raises(ValueError, match="unknown activation"):
        T.normalize_act(x, *params, "swish", 0.0, torch.empty_like(x))
    with pytest.raises(ValueError, match="cannot be inverted"):
        T.backward_dx(x, x, *params, "gelu", 0.0, True, *params[1:])
    with pytest.raises(TypeError, match="unsupported dtype"):
        T.channel_stats(x.to(torch.int32))


def test_launch_plans_are_memoised_per_geometry_and_choice():
    """The host path plans an op once per (shape, strides, dtype, target, activation, ...):
    later calls are one memo lookup; a new stride or activation is a new plan."""
    x = make_input((4, 3, 5, 5), torch.float64)
    params = make_params(3, torch.float64)
    P.plan_op_memo.cache_clear()
    for _ in range(3):
        T.channel_stats(x)
        T.backward_reduce(x, x, *params, "leaky_relu", 0.1, True)
    info = P.plan_op_memo.cache_info()
    assert (info.misses, info.hits) == (2, 4)
    T.backward_reduce(x, x, *params, "elu", 1.0, True)
    T.channel_stats(x.contiguous(memory_format=torch.channels_last))
    assert P.plan_op_memo.cache_info().misses == 4


def test_empty_backward():
    """The separate backward ops on an empty input: zero sums, a dx of its shape, no launch
    (their plans are None); the activation is checked all the same, as for any input."""
    x = torch.empty(0, 3, 4, device=DEVICE)
    params = make_params(3, torch.float32)
    sums = T.backward_reduce(x, x, *params, "leaky_relu", 0.1, True)
    assert all(torch.equal(s.cpu(), torch.zeros(3)) for s in sums)
    assert T.backward_dx(x, x, *params, "leaky_relu", 0.1, True, *params[:3]).shape == x.shape
    for activation, saved_is_output, refusal in (("swish", False, "unknown activation"),
                                                 ("relu", True, "cannot be inverted")):
        with pytest.raises(ValueError, match=refusal):
            T.backward_reduce(x, x, *params, activation, 0.1, saved_is_output)
        with pytest.raises(ValueError, match=refusal):
            T.backward_dx(x, x, *params, activation, 0.1, saved_is_output, *params[:3])


@pytest.mark.parametrize("shape", [(0, 3, 4, 4), (2, 3, 0)])
def test_empty_input_through_the_direct_ops(shape):
    """An empty input plans no launch (its plan is None: no ``numel()`` asked first): the
    direct ops answer as the torch backend does, fold the batch into the running statistics
    as it does (strided buffers included), and still refuse an unknown activation (as the
    kernels' ops always did)."""
    from encoding_syncbn import kernels

    x = torch.empty(shape, device=DEVICE)
    mean, invstd, weight, bias = make_params(3, torch.float32)
    results = {}
    for name, backend in (("triton", triton_ops.EAGER), ("torch", kernels.TORCH)):
        running = kernels.RunningStats(torch.full((3, 2), 2.0, device=DEVICE)[:, 0],
                                       torch.full((3,), 3.0, device=DEVICE),
                                       torch.zeros((), dtype=torch.long, device=DEVICE), None)
        stats = backend.batch_stats(x, 1e-5, running, kernels.GammaCheck(weight, bias, 0.01))
        params = kernels.NormParams(mean, invstd, weight, bias, "leaky_relu", 0.1)
        out = backend.normalize_act(x, params, torch.empty_like(x))
        results[name] = (stats[0], stats[1], stats[2].bool(), out, *running[:3])
    with pytest.raises(ValueError, match="unknown activation"):  # checked, though empty
        triton_ops.EAGER.normalize_act(x, params._replace(activation="swish"), x)
    torch.testing.assert_close(results["triton"], results["torch"], rtol=0, atol=0,
                               equal_nan=True)
    # (No backward of an empty batch in the torch backend: the layer answers it itself.)
    dx, sum_dz, sum_dz_xhat = triton_ops.EAGER.batch_backward(x, x, params, True, 0)
    assert dx.shape == x.shape
    assert sum_dz.tolist() == sum_dz_xhat.tolist() == [0.0] * 3


# ------------------------------------------------------------------------------------------
# batch_stats: the statistics, then invstd, running statistics and small-gamma flags
# ------------------------------------------------------------------------------------------

# Running buffers' dtypes: None (not tracked) or the module's dtype.
RUNNING_DTYPES = [None, torch.float16, torch.bfloat16, torch.float32, torch.float64]


def finalize_inputs(c, acc, running_dtype, counter, momentum, check, seed):
    """Buffers and parameters for ``batch_stats``: gammas around the check's limit (some
    exactly on it), zero and huge biases, a counter some batches in."""
    g = torch.Generator().manual_seed(seed)
    running = None
    if running_dtype is not None:
        batches = (torch.tensor(int(torch.randint(0, 50, (), generator=g)))
                   if counter else None)
        running = (torch.randn(c, generator=g, dtype=torch.float64).to(running_dtype),
                   (torch.rand(c, generator=g, dtype=torch.float64) + 0.5).to(running_dtype),
                   batches, momentum)
    weight = bias = None
    limit = 0.016
    if check:
        bias = (torch.randn(c, generator=g, dtype=torch.float64)
                * torch.tensor([0.0, 1.0, 100.0], dtype=torch.float64)[torch.arange(c) % 3]
                ).to(acc)
        bound = bias.abs().clamp_min(1.0) * limit
        factor = torch.tensor([0.0, 0.5, 1.0, 1.5, 10.0], dtype=torch.float64)
        sign = torch.where(torch.rand(c, generator=g) < 0.5, -1.0, 1.0).to(torch.float64)
        weight = (bound.double() * factor[torch.arange(c) % 5] * sign).to(acc)
        weight[torch.arange(c) % 5 == 2] = bound[torch.arange(c) % 5 == 2] * sign[
            torch.arange(c) % 5 == 2].to(acc)  # exactly on the limit: flagged
    return running, weight, bias, limit


def check_batch_stats(x, running, weight, bias, limit, momentum):
    """``T.batch_stats`` against ``T.channel_stats`` then the ATen ``finalize_stats``: the mean
    and invstd to the last bit (the same partials merged the same way; both invstd steps
    correctly rounded; float64's in double-double, the same ops on both sides), the
    running statistics within the buffers' rounding (ATen rounds after
    each of its two calls, the kernel once), the counter, the flags exactly (boundary values
    included)."""
    def copied():
        return None if running is None else (
            *(None if t is None else t.clone() for t in running[:3]), momentum)

    got_running, ref_running = copied(), copied()
    no_running = (None, None, None, None)
    mean, invstd, small = T.batch_stats(x, 1e-5, *(got_running or no_running), weight, bias,
                                        limit)
    ref_mean, ref_m2, count = T.channel_stats(x)
    ref_invstd, ref_small = torch_ops.finalize_stats(
        ref_mean, ref_m2, count, 1e-5, ref_running and RunningStats(*ref_running),
        None if weight is None else GammaCheck(weight, bias, limit))
    acc = torch_ops.stats_dtype(x.dtype)
    assert mean.dtype == invstd.dtype == acc
    torch.testing.assert_close(mean, ref_mean, rtol=0, atol=0)
    torch.testing.assert_close(invstd, ref_invstd, rtol=0, atol=0)
    if weight is not None:
        assert small.dtype == torch.uint8 and small.tolist() == ref_small.int().tolist()
    else:
        assert small is None and ref_small is None
    if running is not None:
        # Within the coarser of the buffers' and the statistics' rounding (ATen divides M2 in
        # the statistics dtype for the cumulative average, the kernel in the wider one).
        tols = {torch.float16: 1e-3, torch.bfloat16: 8e-3, torch.float32: 1e-6,
                torch.float64: 1e-14}
        rtol = max(tols[running[0].dtype], tols[acc])
        for mine, theirs in zip(got_running[:2], ref_running[:2]):
            torch.testing.assert_close(mine, theirs, rtol=rtol, atol=rtol)
        if running[2] is not None:
            assert got_running[2].item() == ref_running[2].item() == running[2].item() + 1


@settings(max_examples=24, deadline=None, derandomize=True)
@given(c=st.sampled_from([1, 3, 7, 128, 300]), fmt=st.sampled_from(["nchw", "last"]),
       dtype=st.sampled_from([torch.float16, torch.float32, torch.float64]),
       running_dtype=st.sampled_from(RUNNING_DTYPES), counter=st.booleans(),
       momentum=st.sampled_from([0.1, 0.5, 1.0, None]), check=st.booleans(),
       seed=st.integers(0, 2**16))
@example(c=300, fmt="nchw", dtype=torch.float32, running_dtype=torch.float32, counter=True,
         momentum=None, check=True, seed=0)
@example(c=3, fmt="nchw", dtype=torch.float64, running_dtype=torch.float16, counter=False,
         momentum=0.1, check=True, seed=1)
def test_batch_stats(c, fmt, dtype, running_dtype, counter, momentum, check, seed):
    """Two launches, split or not (few channels over many rows: the partials of several
    programs merged by the finalising kernel), against the statistics and the ATen step."""
    if momentum is None and not counter:
        counter = True  # a cumulative average needs the counter (nn.BatchNorm's rule too)
    acc = torch_ops.stats_dtype(dtype)
    running, weight, bias, limit = finalize_inputs(c, acc, running_dtype, counter, momentum,
                                                   check, seed)
    # Few channels get many rows, so that the reduction splits; many channels a few.
    shape = (150, c, 9, 15) if c < 16 else (2, c, 3, 5)
    x = make_input(shape, dtype, fmt, seed=seed)
    check_batch_stats(x, running, weight, bias, limit, momentum)


@settings(max_examples=16, deadline=None, derandomize=True)
@given(c=st.sampled_from([5, 10, 130]), fmt=st.sampled_from(["nchw", "last"]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32, torch.float64]),
       seed=st.integers(0, 2**16))
def test_batch_stats_flags_near_constant_channels(c, fmt, dtype, seed):
    """The small-gamma flags against xhat's spread s = sqrt(var / (var + eps)): channels of
    batch std from 1e-4 to 1 (eps 1e-5), gammas of |beta| / s times 0.5, 1 and 2 at the limit
    1 (flagged below 1, not above; on it, either, as long as the kernel's flag is the ATen
    step's to the bit), beta up to 100."""
    g = torch.Generator().manual_seed(seed)
    acc = torch_ops.stats_dtype(dtype)
    shape = (40, c, 3, 5) if c < 16 else (2, c, 3, 5)
    stds = torch.tensor([1e-4, 3e-4, 1e-3, 3e-3, 1.0], dtype=torch.float64)[torch.arange(c) % 5]
    per_channel = (1, c, 1, 1)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * stds.view(per_channel)
    x = layout((x + stds.view(per_channel)).to(dtype), fmt).to(DEVICE)
    var = x.double().var((0, 2, 3), correction=0)
    spread = (var / (var + 1e-5)).sqrt()
    bias = (torch.randn(c, generator=g, dtype=torch.float64) * 100).to(acc)
    factor = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)[torch.arange(c) % 3]
    weight = (bias.double().abs() / spread * factor).to(acc).to(DEVICE)
    bias = bias.to(DEVICE)
    check_batch_stats(x, None, weight, bias, 1.0, None)
    small = T.batch_stats(x, 1e-5, None, None, None, None, weight, bias, 1.0)[2]
    assert small.bool()[factor == 0.5].all() and not small.bool()[factor == 2.0].any()


@pytest.mark.parametrize("fmt", ["nchw", "last"])
def test_batch_stats_merges_split_partials(fmt):
    shape = (64, 2, 33, 9) if fmt == "nchw" else (64, 3, 17, 11)
    x = make_input(shape, torch.float32, fmt)
    launches, (_, _, _) = TS.plan_batch_stats(x, 1e-5, None, None, None, None, None, None,
                                              0.0, P.launch_target(x.device))
    assert [launch.kernel for launch in launches] == [TS._batch_stats_kernel]
    assert launches[0].grid[1] > 1 and launches[0].constexprs["SPLIT"]
    running = (torch.zeros(shape[1]), torch.ones(shape[1]), torch.tensor(0), None)
    check_batch_stats(x, running, *make_params(shape[1], torch.float32)[2:], 0.016, None)


@pytest.mark.parametrize("groups", [False, True], ids=["one-level", "groups"])
@pytest.mark.parametrize("shape,fmt", [((64, 1, 30, 30), "nchw"), ((250, 3, 9, 9), "last")])
def test_reductions_planned_for_a_gpu_merge_many_partials(shape, fmt, groups, monkeypatch):
    """Planned for a 132-SM GPU (small tiles, a few programs per SM), few channels split over
    more programs than a merge step takes (BLOCK_P rows, made small here): every merge by the
    last program (statistics, batch statistics, the backward sums) loops over several steps,
    or (``groups``) each group's last merges its rows and the last group the groups' rows,
    the last group with fewer rows than a step. Every counter is back at 0 after them. Run
    here by the interpreter (or the GPU)."""
    from encoding_syncbn.kernels.triton.partials import split_counters

    monkeypatch.setattr(P, "_MAX_MERGE_ROWS", 8)
    monkeypatch.setattr(P, "_MERGE_IN_GROUPS", groups)
    forget_plans()
    x = make_input(shape, torch.float32, fmt)
    c, target = shape[1], P.Target(False, 132)
    weight, bias = make_params(c, torch.float32)[2:]
    try:
        stats, (mean, m2) = TS.plan_channel_stats(x, target)
        running = (torch.zeros(c, device=x.device), torch.ones(c, device=x.device), None, 0.1)
        fused, (fused_mean, invstd, small) = TS.plan_batch_stats(x, 1e-5, *running, weight,
                                                                 bias, 0.016, target)
        params = (mean, invstd, weight, bias)
        reduce, sums = TB.plan_backward_reduce(x, x, *params, "leaky_relu", 0.1, False, target)
        for launches in (stats, fused, reduce):
            assert len(launches) == 1
            (launch,) = launches
            rows = launch.constexprs["BLOCK_P"]
            assert launch.grid[1] > 2 * rows and launch.constexprs["GROUPS"] == groups
            assert launch.grid[1] % rows != 0  # a last group smaller than the others
            triton_ops._run(launches, x.device)
        assert not split_counters(x.device, 1).any()
    finally:
        monkeypatch.undo()
        forget_plans()
    ref_mean, ref_m2, count = reference_stats(x)
    assert_close(mean, ref_mean.float(), torch.float32)
    assert_close(m2, ref_m2.float(), torch.float32)
    torch.testing.assert_close(fused_mean, mean, rtol=0, atol=0)
    ref_invstd, ref_small = torch_ops.finalize_stats(mean, m2, count, 1e-5, None,
                                                     GammaCheck(weight, bias, 0.016))
    torch.testing.assert_close(invstd, ref_invstd, rtol=0, atol=0)
    assert small.tolist() == ref_small.int().tolist()
    ref_sums = R.backward_reduce(x.cpu().double(), x.cpu().double(),
                                         *(v.cpu().double() for v in params), "leaky_relu", 0.1,
                                         False)
    for got, want in zip(sums, ref_sums):
        assert_close(got, want.float(), torch.float32, sum_terms=x[:, 0].numel())


@settings(max_examples=16, deadline=None, derandomize=True)
@given(shape=st.sampled_from([(16, 32, 8, 8), (2, 32, 8, 8), (8, 64, 16, 16), (4, 24, 8, 8),
                              (64, 8, 16, 16), (761, 5, 1, 1)]),
       fmt=st.sampled_from(["nchw", "last"]), dtype=st.sampled_from([torch.float32,
                                                                      torch.float16]),
       gpu_tiles=st.booleans(), groups=st.booleans(), seed=st.integers(0, 2**16))
# Split more ways than a merge step takes, for the merge in groups to take two levels.
@example(shape=(8, 64, 16, 16), fmt="last", dtype=torch.float32, gpu_tiles=True, groups=True,
         seed=1)
@example(shape=(64, 8, 16, 16), fmt="last", dtype=torch.float16, gpu_tiles=True, groups=True,
         seed=2)
# A channel whose mean errs by more than a tenth of an eps of its standard deviation.
@example(shape=(2, 32, 8, 8), fmt="nchw", dtype=torch.float32, gpu_tiles=False, groups=False,
         seed=358)
def test_float32_statistics_round_once(shape, fmt, dtype, gpu_tiles, groups, seed):
    """float32 statistics (of float32 and half inputs) close to a sum in float64 rounded once,
    as ATen's CPU BatchNorm takes them: invstd within 0.8 eps of the exact one (its own
    rounding, M2's, and a few hundredths of an eps from the lanes' float32 sums of squares),
    the mean within half an ulp plus a fifth of an eps of a standard deviation (a float32
    input's deviations from the shift and the lanes' sums round in float32: their errors
    average out over a channel's values, to above a tenth in rare channels), with the tiles
    planned for a 132-SM GPU (lanes summing several values, split over programs, merged in
    one level or in groups) and for the interpreter. Summing the squares across a tile in
    float32 misses invstd's bound by several eps (the input gradient carries invstd's error
    twice)."""
    x = make_input(shape, dtype, fmt, seed=seed)
    target = P.Target(False, 132) if gpu_tiles else P.launch_target(x.device)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(P, "_MERGE_IN_GROUPS", groups)
        forget_plans()
        try:
            launches, (mean, invstd, _) = TS.plan_batch_stats(
                x, 1e-5, None, None, None, None, None, None, 0.0, target)
            triton_ops._run(launches, x.device)
        finally:
            forget_plans()
    # float64's reference errs far below float32's eps: exact at these bounds.
    exact_mean, exact_m2, count = reference_stats(x)
    exact_std = (exact_m2 / count).sqrt()
    exact_invstd = (exact_std.square() + 1e-5).rsqrt()
    eps = torch.finfo(torch.float32).eps
    invstd_error = (invstd.cpu().double() / exact_invstd - 1).abs() / eps
    rounded = exact_mean.abs().float()
    half_ulp = (torch.nextafter(rounded, torch.tensor(math.inf)) - rounded).double() / 2
    mean_error = (mean.cpu().double() - exact_mean).abs() / (half_ulp + eps * exact_std / 5)
    assert invstd_error.max() <= 0.8, f"invstd: {float(invstd_error.max()):.2f} eps"
    assert mean_error.max() <= 1.0, f"mean: {float(mean_error.max()):.2f}x the bound"


@settings(max_examples=12, deadline=None, derandomize=True)
@given(shape=st.sampled_from([(8, 64, 16, 16), (64, 8, 16, 16), (3, 40, 33, 5), (761, 5, 1, 1),
                              (2, 16, 130, 70)]),
       fmt=st.sampled_from(["nchw", "last"]),
       dtype=st.sampled_from([torch.float16, torch.bfloat16]),
       sm_count=st.sampled_from([None, 1, 3, 132]), loads=st.integers(2, 5),
       seed=st.integers(0, 2**16))
# Split 6 ways, 6 tiles a program but the last's 2, 4 a step: steps that end past the range.
@example(shape=(8, 64, 16, 16), fmt="nchw", dtype=torch.float16, sm_count=3, loads=4, seed=3)
# Not split: tile 0 from the shift's registers, then 7 tiles in steps of 4.
@example(shape=(64, 8, 16, 16), fmt="nchw", dtype=torch.bfloat16, sm_count=1, loads=4, seed=4)
# Channels-last, 143 tiles split 4 ways: 36 tiles a program, 35 the last's, steps of 5.
@example(shape=(2, 16, 130, 70), fmt="last", dtype=torch.float16, sm_count=1, loads=5, seed=5)
def test_statistics_do_not_depend_on_the_tiles_a_step_loads(shape, fmt, dtype, sm_count, loads,
                                                             seed):
    """The statistics' loop loads ``LOADS`` tiles a step before it sums them, each summed in
    tile order and a step's tiles past the program's range masked out: the same bits as one
    tile a step, for both statistics kernels, with the tiles planned for a GPU of
    ``sm_count`` SMs (None: for the interpreter), whatever the range's length (a tile past
    the range counted, or one skipped, changes the sums)."""
    x = make_input(shape, dtype, fmt, seed=seed)
    target = P.launch_target(x.device) if sm_count is None else P.Target(False, sm_count)
    found = {}
    with pytest.MonkeyPatch.context() as patch:
        for step in (1, loads):
            patch.setattr(P, "_STATS_LOADS", step)
            forget_plans()
            try:
                stats, moments = TS.plan_channel_stats(x, target)
                batch, (mean, invstd, _) = TS.plan_batch_stats(
                    x, 1e-5, None, None, None, None, None, None, 0.0, target)
                assert stats[0].constexprs["LOADS"] == batch[0].constexprs["LOADS"] == step
                triton_ops._run(stats + batch, x.device)
            finally:
                forget_plans()
            found[step] = (*moments, mean, invstd)
    for one, several in zip(found[1], found[loads]):
        torch.testing.assert_close(several, one, rtol=0, atol=0)
    # The values vary in every channel (M2 > 0): a tile counted twice or skipped shows.
    assert found[1][1].min() > 0


@pytest.mark.parametrize("fmt", ["nchw", "last"])
def test_merging_programs_rearm_their_counters(fmt):
    """The last program of each split channel block, and the last block of a cumulative
    average (which counts the batch once every block has read the counter), set their
    counters back to 0: the next launch finds them as the first did, and the batch counter
    goes up by one, whatever the number of channel blocks."""
    from encoding_syncbn.kernels.triton.partials import split_counters

    shape = (40, 70, 9, 5) if fmt == "nchw" else (40, 150, 9, 5)
    x = make_input(shape, torch.float32, fmt)
    c = shape[1]
    counters = split_counters(x.device, 1)
    for _ in range(2):
        running = (torch.zeros(c), torch.ones(c), torch.tensor(3), None)
        check_batch_stats(x, running, None, None, 0.0, None)
        assert not counters.any()
    T.channel_stats(x[:, :3])
    T.backward_reduce(x[:, :3], x[:, :3], *make_params(3, torch.float32), "elu", 1.0, False)
    assert not counters.any()


def test_batch_stats_cumulative_average_needs_the_counter():
    x = make_input((2, 3, 4), torch.float32)
    with pytest.raises(ValueError, match="num_batches_tracked"):
        T.batch_stats(x, 1e-5, torch.zeros(3), torch.ones(3), None, None, None, None, 0.0)


# ------------------------------------------------------------------------------------------
# torch.library registration
# ------------------------------------------------------------------------------------------


def test_opcheck():
    for fmt in ("nchw", "last"):
        x = make_input((3, 4, 5, 6), torch.float32, fmt)
        params = make_params(4, torch.float32)
        coefs = make_params(4, torch.float32, seed=5)[1:]
        y = R.normalize_act(x, *params, "leaky_relu", 0.1, torch.empty_like(x))
        ops = torch.ops.encoding_syncbn
        torch.library.opcheck(ops.channel_stats.default, (x,))
        torch.library.opcheck(ops.normalize_act_.default,
                              (x, *params, "elu", 1.0, torch.empty_like(x)))
        torch.library.opcheck(ops.normalize_running_.default,
                              (x, params[0], params[1], 1e-5, *params[2:], "elu", 1.0,
                               torch.empty_like(x)))
        torch.library.opcheck(ops.backward_reduce.default,
                              (y, x, *params, "leaky_relu", 0.1, True))
        running = (torch.zeros(4), torch.ones(4), torch.tensor(3), None)
        torch.library.opcheck(ops.batch_stats.default, (x, 1e-5, *running, *params[2:], 0.01))
        # The coefficients given, or derived from a batch's sums (sums_count > 0).
        for dx_args in ((*coefs, 0), (params[2], *coefs[1:], 57)):
            torch.library.opcheck(ops.backward_dx.default,
                                  (y, x, *params, "leaky_relu", 0.1, True, *dx_args))


def test_eager_calls_skip_the_dispatcher_and_tracers_still_see_the_ops():
    """A plain eager call runs the implementation directly (the dispatcher's overhead is
    paid under the GIL); under a dispatch mode, as while tracing, the registered op runs."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(str(func.overloadpacket))
            return func(*args, **(kwargs or {}))

    x = make_input((3, 4, 5, 6), torch.float32, "nchw")
    params = make_params(4, torch.float32)
    coefs = make_params(4, torch.float32, seed=5)[1:]

    def every_op():
        T.channel_stats(x)
        T.batch_stats(x, 1e-5, None, None, None, None, *params[2:], 0.01)
        y = T.normalize_act(x, *params, "leaky_relu", 0.1, torch.empty_like(x))
        T.normalize_running(x, *params[:2], 1e-5, *params[2:], "leaky_relu", 0.1,
                            torch.empty_like(x))
        T.backward_reduce(y, x, *params, "leaky_relu", 0.1, True)
        T.backward_dx(y, x, *params, "leaky_relu", 0.1, True, *coefs)

    ours = {f"encoding_syncbn::{name}" for name in
            ("channel_stats", "batch_stats", "normalize_act_", "normalize_running_",
             "backward_reduce", "backward_dx")}
    with torch.profiler.profile() as profile:  # sees dispatched ops, is no dispatch mode
        every_op()
    assert ours.isdisjoint(event.name for event in profile.events())
    with Recorder() as recorder:
        every_op()
    assert {name.replace(".", "::", 1) for name in recorder.ops} >= ours


# ------------------------------------------------------------------------------------------
# Launches per layer call
# ------------------------------------------------------------------------------------------


# (shape, layout, split): reductions split over programs and not, each tiling of the
# interpreter's plans (NCHW rows of images, NCHW rows of channels, channels_last).
# Each of two replicas with values a channel enough to compute in its own dtype, in the
# kernels (inplace_policy.MIN_OWN_PRECISION_COUNT; fewer compute in float64 in ATen ops).
LAUNCH_CASES = [((64, 3, 16, 16), "nchw", True), ((128, 16, 3, 5), "nchw", False),
                ((6, 8, 3, 5), "nchw", True), ((96, 3, 8, 12), "last", True),
                ((6, 70, 3, 5), "last", False)]


@pytest.mark.parametrize("shape,fmt,split", LAUNCH_CASES,
                         ids=[f"{'x'.join(map(str, s))}-{f}" for s, f, _ in LAUNCH_CASES])
@pytest.mark.parametrize("inplace", [True, False])
def test_launches_per_layer_call(shape, fmt, split, inplace):
    """One replica's training forward in 2 launches (statistics finished by the last program
    of a split channel block: running statistics, small-gamma flags; then normalise), its
    backward in 2 (reduction, its split partials merged by the last program; then dx, each
    program deriving its coefficients), an evaluating forward in 1 (invstd from the running
    variance inside the normalising kernel); synchronised over 2 replicas, each replica the same
    2 + 2 (the exchange between statistics and normalisation, and between reduction and dx,
    forces them): no launch of its own for the finishing work."""
    import encoding_syncbn
    from encoding_syncbn.testing import SimulatedDataParallel

    x0 = make_input(shape, torch.float32, fmt)
    launches, _ = TS.plan_channel_stats(x0, P.launch_target(x0.device))
    assert (launches[0].grid[1] > 1) == split  # the cases split as named
    encoding_syncbn.set_backend("triton")
    try:
        layer = encoding_syncbn.SyncBatchNorm(shape[1], activation="leaky_relu",
                                              inplace=inplace).to(DEVICE)
        for replicas in (1, 2):
            model = SimulatedDataParallel(layer, replicas) if replicas > 1 else layer
            x = x0.clone().requires_grad_()
            with counted_launches() as forward:
                y = model(x * 1)
            with counted_launches() as backward:
                y.backward(torch.ones_like(y))
            # (Replicas' launches interleave: compared as sets of launches.)
            stats = "_batch_stats_kernel" if replicas == 1 else "_channel_stats_kernel"
            assert sorted(forward) == sorted([stats, "_normalize_act_kernel"] * replicas)
            assert sorted(backward) == sorted(["_backward_reduce_kernel",
                                               "_backward_dx_kernel"] * replicas)
        layer.eval()
        with counted_launches() as evaluation:
            y = layer(x0.clone().requires_grad_() * 1)
        assert evaluation == ["_normalize_running_kernel"]
        with torch.no_grad(), counted_launches() as evaluation:
            layer(x0.clone())
        assert evaluation == ["_normalize_running_kernel"]
    finally:
        encoding_syncbn.set_backend("auto")


# ------------------------------------------------------------------------------------------
# The AOT check (real compiles for sm_90, no GPU needed)
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("registers,num_warps,programs", [
    (32, 8, 8), (64, 8, 4), (65, 8, 3), (72, 8, 3), (128, 8, 2), (136, 8, 1), (255, 8, 1),
    (32, 4, 16), (64, 4, 8), (168, 4, 3)])
def test_programs_an_sm_holds(registers, num_warps, programs):
    """An SM's 65,536 registers go to a warp 256 at a time (8 a thread) and hold at most 64
    warps: CUDA's occupancy table for sm_80 and sm_90."""
    assert P.programs_per_sm(registers, num_warps) == programs


def test_check_compiles_every_kernel():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "tools/check_kernels.py", "--arch", "90", "--limit", "1"],
        capture_output=True, text=True, env=env, timeout=300, cwd=root,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    for name in ("_channel_stats_kernel", "_batch_stats_kernel", "_normalize_act_kernel",
                 "_backward_reduce_kernel", "_backward_dx_kernel"):
        assert name in proc.stdout
    assert "per SM" in proc.stdout.splitlines()[0]


# Run in a process of its own, as CI runs the check: compiled kernels, not interpreted ones.
_COVERAGE_SCRIPT = """
import itertools, json, sys
sys.path.insert(0, "tools")
import check_kernels as check
specs = check.specialisations(90)
chosen = check.covering(specs)
def pairs(group):
    return {(s.kernel.__name__, p) for s in group
            for p in itertools.combinations(check._choices(s), 2)}
print(json.dumps({"all": len(specs), "chosen": len(chosen),
                  "kernels": len({s.kernel.__name__ for s in specs}),
                  "covered": pairs(chosen) == pairs(specs),
                  "planned": all(any(c is s for s in specs) for c in chosen),
                  "twice": len(check.covering(specs + specs)) == len(chosen)}))
"""


def test_check_pairs_cover_every_planned_pair_of_choices():
    """CI's representative set (``--pairs``): every pair of argument typings that some planned
    specialisation of a kernel makes occurs in a chosen one of that kernel; the set is a small
    part of the whole, and planning every shape twice does not grow it."""
    found = run_fresh(_COVERAGE_SCRIPT, env={"TRITON_INTERPRET": None})
    assert found["covered"] and found["planned"] and found["twice"], found
    assert found["kernels"] == 6
    assert found["chosen"] * 10 < found["all"], found


# Compiled for sm_90 in a process of its own: the statistics' loop at the bandwidth shapes of
# half inputs, its loads before its sums (the loop as kernel_instructions.py finds it).
_STATS_LOADS_SCRIPT = """
import json, sys
sys.path.insert(0, "benchmarks")
import torch
import kernel_instructions as sass
import check_kernels as check
from encoding_syncbn.kernels.triton import plan
from encoding_syncbn.kernels.triton.channel_stats import plan_batch_stats

target = plan.Target(False, 132)
found = {}
for layout in (torch.contiguous_format, torch.channels_last):
    x = torch.empty((8, 256, 128, 128), dtype=torch.float16, device="meta",
                    memory_format=layout)
    vec = torch.empty(256, device="meta")
    (launch,), _ = plan_batch_stats(x, 1e-5, vec, vec, None, 0.1, vec, vec, 0.016, target)
    compiled = check.compile_spec(check.launch_spec("batch_stats", launch), 90)
    registers, spills, _ = check._resources(compiled.asm["cubin"])
    loop = sass._tile_loop(sass._instructions(check.cuobjdump(compiled.asm["cubin"], "-sass")))
    first_sum = loop.index("HADD2.F32")
    lane_bytes = (launch.constexprs["BLOCK_A"] * launch.constexprs["BLOCK_B"] * x.itemsize
                  // (launch.num_warps * 32))
    found[str(layout)] = {"loads": launch.constexprs["LOADS"], "spills": spills,
                          "lane_bytes": lane_bytes,
                          "programs": plan.programs_per_sm(registers, launch.num_warps),
                          "planned": plan._REDUCE_PROGRAMS_PER_SM,
                          "in_flight": [op for op in loop[:first_sum] if op.startswith("LDG")],
                          "loaded": [op for op in loop if op.startswith("LDG")]}
print(json.dumps(found))
"""


def test_the_statistics_loop_keeps_its_loads_in_flight():
    """Compiled for sm_90 at (8, 256, 128, 128) float16, NCHW and channels-last: each step of
    the statistics' loop issues every load of its ``LOADS`` tiles, 16 bytes each, before it
    sums any (a lane's tile is 16 bytes in NCHW, 32 in channels-last), without spilling and
    with the registers for the programs an SM the grid is planned at."""
    found = run_fresh(_STATS_LOADS_SCRIPT, env={"TRITON_INTERPRET": None})
    assert len(found) == 2
    for layout in found.values():
        assert layout["loads"] > 1 and layout["spills"] == 0, layout
        assert layout["programs"] >= layout["planned"], layout
        assert layout["in_flight"] == layout["loaded"], layout
        assert layout["loaded"] == ["LDG.E.128"] * (layout["loads"] * layout["lane_bytes"]
                                                     // 16), layout
