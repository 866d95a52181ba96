"""Plain-PyTorch references the tests compare against: nn.BatchNorm*d on the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.testing import SimulatedDataParallel

ACTIVATIONS = ("none", "identity", "leaky_relu", "elu", "relu")
# Fused out of place only (not invertible); tested on their own (tests/test_activations.py).
SMOOTH_ACTIVATIONS = ("silu", "gelu", "gelu_tanh")
# Non-default slopes, so that a slope mix-up cannot pass.
SLOPES = {"leaky_relu": 0.1, "elu": 0.7}
_BATCHNORM_BY_DIM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def activate(z: torch.Tensor, activation: str, slope: float) -> torch.Tensor:
    if activation == "leaky_relu":
        return F.leaky_relu(z, slope)
    if activation == "elu":
        return F.elu(z, slope)
    if activation == "relu":
        return F.relu(z)
    if activation == "silu":
        return F.silu(z)
    if activation in ("gelu", "gelu_tanh"):
        return F.gelu(z, approximate="tanh" if activation == "gelu_tanh" else "none")
    return z


def plain_twin(layer: SyncBatchNorm, ndim: int, dtype: torch.dtype = torch.float64
               ) -> nn.Module:
    """An nn.BatchNorm*d with the layer's options and a copy of its state (in its dtype;
    ``dtype`` for a layer without state: affine=False, track_running_stats=False)."""
    cls = _BATCHNORM_BY_DIM[ndim]
    state = layer.state_dict()
    twin = cls(
        layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats,
        bias=layer.bias is not None or not layer.affine,
    ).to(dtype=next(iter(state.values())).dtype if state else dtype)
    twin.load_state_dict(state)
    twin.train(layer.training)
    return twin


def reference_step(twin: nn.Module, x: torch.Tensor, grad: torch.Tensor, activation: str,
                   slope: float):
    """Output and input gradient of BatchNorm + activation on the whole batch."""
    x = x.detach().clone().requires_grad_()
    out = activate(twin(x), activation, slope)
    out.backward(grad)
    return out.detach(), x.grad


def assert_close(actual, expected, dtype=torch.float64, what=""):
    tolerances = {
        torch.float64: dict(rtol=1e-10, atol=1e-10),
        torch.float32: dict(rtol=1e-4, atol=1e-4),
        torch.bfloat16: dict(rtol=2e-2, atol=2e-2),
        torch.float16: dict(rtol=4e-3, atol=4e-3),
    }[dtype]
    torch.testing.assert_close(actual.to(expected.dtype), expected, msg=lambda m: f"{what}: {m}",
                               **tolerances)


#: What ``check_nonfinite_gradients`` injects. Not an infinite weight: nn.BatchNorm2d on the
#: CPU computes z = x * (w * invstd) + (b - mean * w * invstd), whose inf - inf makes such a
#: channel's outputs NaN; the layer computes (x - mean) * invstd * w + b, as ATen's CUDA kernel
#: does (+-inf): different outputs, whose gradients are not comparable.
NONFINITE = (float("nan"), float("inf"), -float("inf"))


def batchnorm_grads(ref: nn.Module, x: torch.Tensor, dy: torch.Tensor, activation: str,
                    elu_from_output: bool) -> tuple[torch.Tensor, ...]:
    """``(dx, dw, db)`` of nn.BatchNorm2d + the activation, ELU's derivative NaN at a NaN z
    (the convention of ``activations.py``: ATen's vectorised ELU backward, which its scalar
    tail does not follow on small tensors).

    ``elu_from_output``: in evaluation, for an in-place ELU layer, whose output saturates at
    -alpha: a z of -inf leaves the output of any z below about -37 (float64), which is what
    the layer rebuilds; there dz is 0, and so is its term of dw = sum(dz * xhat), where
    nn.BatchNorm2d's (x - mean) * dz is -inf * 0 = NaN. Such a channel (finite weight and
    bias: not kept aside) gets that dw, with the terms where dz is 0 left out.
    """
    leaf = x.detach().clone().requires_grad_()
    z = ref(leaf)
    nan_z, seen = z.detach().isnan(), {}

    def at_z(grad: torch.Tensor) -> torch.Tensor:
        if activation == "elu":
            grad = grad.masked_fill(nan_z, float("nan"))
        seen["dz"] = grad
        return grad

    z.register_hook(at_z)
    activate(z, activation, SLOPES.get(activation, 0.01)).backward(dy)
    dw = ref.weight.grad
    if elu_from_output:
        dims, view = (0, 2, 3), (1, -1, 1, 1)
        dz = seen["dz"]
        dotp = torch.where(dz == 0, 0.0, (x - ref.running_mean.view(view)) * dz).sum(dims)
        saturated = (torch.isneginf(z).any(dim=0).flatten(1).any(dim=1)
                     & ref.weight.isfinite() & ref.bias.isfinite())
        dw = torch.where(saturated, dotp * torch.rsqrt(ref.running_var + ref.eps), dw)
    return leaf.grad, dw, ref.bias.grad


def assert_same_nonfinite(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    """The same NaN and inf elements (infinities of the same sign), the finite ones close."""
    got = got.cpu()
    for name, mask in (("NaN", torch.isnan), ("inf", torch.isposinf), ("-inf", torch.isneginf)):
        same = torch.equal(mask(got), mask(want))
        assert same, (f"{what}: {name} at {mask(got).nonzero().tolist()}, nn.BatchNorm2d's "
                      f"at {mask(want).nonzero().tolist()}")
    torch.testing.assert_close(got, want, equal_nan=True, rtol=1e-9, atol=1e-9,
                               msg=lambda m: f"{what}: {m}")


def check_nonfinite_gradients(activation: str, inplace: bool, training: bool,
                              channels_last: bool,
                              injections: list[tuple[str, float, int, int]],
                              replicas: int | None, seed: int, device: str = "cpu",
                              compiled: bool = False) -> None:
    """A (19, 3, 2, 3) float64 layer (values a channel enough to train in place:
    ``inplace_policy.rebuilds_from_count``), with ``injections`` put into it: each ``(target,
    value, channel, element)`` writes ``value`` into x (``element``: 0-23 of that channel) or into
    the channel's entry of a parameter or buffer (``target``: its name). Its input, weight and
    bias gradients, on ``device`` under ``replicas`` simulated replicas (None: called
    directly), have NaN and inf where nn.BatchNorm2d + the activation has them (on the CPU),
    and the same finite values elsewhere. ``compiled``: the layer under ``torch.compile``
    (aot_eager), checked at its second step (the first counts, in place, the channels it
    keeps aside), its state put back after the first."""
    gen = torch.Generator().manual_seed(seed)
    layer = SyncBatchNorm(3, activation=activation, slope=SLOPES.get(activation, 0.01),
                          inplace=inplace, dtype=torch.float64)
    ref = nn.BatchNorm2d(3, dtype=torch.float64)
    x = torch.randn(19, 3, 2, 3, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        # Gammas of either sign, above the limit under which in place keeps channels aside
        # (|beta| < |gamma| / 1.25).
        state = {"weight": (torch.rand(3, generator=gen, dtype=torch.float64) + 0.5)
                 * torch.randn(3, generator=gen, dtype=torch.float64).sign(),
                 "bias": torch.rand(3, generator=gen, dtype=torch.float64) * 0.6 - 0.3,
                 "running_mean": torch.randn(3, generator=gen, dtype=torch.float64),
                 "running_var": torch.rand(3, generator=gen, dtype=torch.float64) + 0.5}
        for target, value, channel, element in injections:
            if target == "x":
                x[element // 6, channel, element % 6 // 3, element % 3] = value
            else:
                state[target][channel] = value
        for module in (layer, ref):
            for name, value in state.items():
                getattr(module, name).copy_(value)
    layer.train(training).to(device)
    ref.train(training)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    leaf = x.to(device, copy=True).requires_grad_()
    runner = SimulatedDataParallel(layer, replicas) if replicas else layer
    if compiled:
        runner = torch.compile(runner, backend="aot_eager")
        runner(leaf * 1).backward(dy.to(device))
        assert layer._compiled_keep_aside is not None  # counted: the next call keeps y only
        with torch.no_grad():
            for name, value in state.items():
                getattr(layer, name).copy_(value)
        layer.zero_grad(set_to_none=True)
        leaf.grad = None
    runner(leaf * 1).backward(dy.to(device))  # a non-leaf: in place, really overwritten
    expected = batchnorm_grads(ref, x, dy, activation,
                               elu_from_output=activation == "elu" and inplace and not training)
    for what, got, want in zip(("dx", "dw", "db"), (leaf.grad, layer.weight.grad,
                                                    layer.bias.grad), expected):
        assert_same_nonfinite(got, want, what)


def assign_or_refused(layer: SyncBatchNorm, options: tuple[str, ...], name: str, value,
                      named: bool) -> bool:
    """``setattr(layer, name, value)``: True where taken; where refused, the ValueError names
    the layer (with its model path exactly when ``named``) and ``options`` and the layer's
    configuration are as before."""
    before = ({key: getattr(layer, key) for key in options}, layer._config)
    try:
        setattr(layer, name, value)
    except ValueError as error:
        assert layer._label() in str(error)
        assert ("model path '1'" in layer._label()) is named
        assert ({key: getattr(layer, key) for key in options}, layer._config) == before
        return False
    return True
