"""Plain-PyTorch references the tests compare against: nn.BatchNorm*d on the whole batch."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from encoding_syncbn import SyncBatchNorm

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
