"""What ``torch.compile`` traces in place of the eager-only steps of the ATen path.

``torch_ops`` walks tensors in slabs with ``out=`` calls and compares ``data_ptr()``s: fast
eagerly, but not traceable. While compiling, the layer calls these custom ops instead: each runs
the very same ``torch_ops`` function on real tensors (so compiled and eager results agree
bitwise) and is opaque to the tracer, which sees only its fake (shape) implementation.

``aside_channels`` picks the channels whose gamma is too small to rebuild ``xhat`` from the
output. Their number depends on the data; its fake implementation returns a tensor of an
unbacked (data-dependent) size, so the graph needs no ``nonzero`` (which Dynamo would refuse
without ``capture_dynamic_output_shape_ops``) and no branch on the count.

Eagerly the layer never dispatches through these ops (see ``kernels.reference_ops``).
"""

from __future__ import annotations

import torch

from . import torch_ops
from .torch_ops import stats_dtype


@torch.library.custom_op("encoding_syncbn::aside_channels", mutates_args=())
def _aside_channels(weight: torch.Tensor, bias: torch.Tensor, min_gamma: float) -> torch.Tensor:
    return torch_ops.small_gamma(weight, bias, min_gamma).nonzero().flatten()


@_aside_channels.register_fake
def _(weight: torch.Tensor, bias: torch.Tensor, min_gamma: float) -> torch.Tensor:
    channels = weight.shape[0]  # a bound only if it is a plain int (not a symbolic size)
    count = torch.library.get_ctx().new_dynamic_size(
        max=channels if isinstance(channels, int) else None)
    return weight.new_empty(count, dtype=torch.long)


@torch.library.custom_op("encoding_syncbn::aten_channel_stats", mutates_args=())
def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, m2, _ = torch_ops.channel_stats(x)
    return mean, m2


@_channel_stats.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc = stats_dtype(x.dtype)
    return x.new_empty(x.shape[1], dtype=acc), x.new_empty(x.shape[1], dtype=acc)


# Mutates ``out`` and returns nothing: torch derives its fake implementation.
@torch.library.custom_op("encoding_syncbn::aten_normalize_act_", mutates_args=("out",))
def _normalize_act(x: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                   weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                   out: torch.Tensor) -> None:
    torch_ops.normalize_act(x, mean, invstd, weight, bias, activation, slope, out)


@torch.library.custom_op("encoding_syncbn::aten_normalize_running_", mutates_args=("out",))
def _normalize_running(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor,
                       eps: float, weight: torch.Tensor, bias: torch.Tensor, activation: str,
                       slope: float, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_ops.normalize_running(x, running_mean, running_var, eps, weight, bias,
                                       activation, slope, out)


@_normalize_running.register_fake
def _(x: torch.Tensor, running_mean: torch.Tensor, running_var: torch.Tensor, eps: float,
      weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
      out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    acc = stats_dtype(x.dtype)
    return x.new_empty(x.shape[1], dtype=acc), x.new_empty(x.shape[1], dtype=acc)


@torch.library.custom_op("encoding_syncbn::aten_backward_reduce", mutates_args=())
def _backward_reduce(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor,
                     invstd: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                     activation: str, slope: float, saved_is_output: bool
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_ops.backward_reduce(saved, dy, mean, invstd, weight, bias, activation, slope,
                                     saved_is_output)


@_backward_reduce.register_fake
def _(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
      weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
      saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(mean), torch.empty_like(mean)


@torch.library.custom_op("encoding_syncbn::aten_backward_dx", mutates_args=())
def _backward_dx(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
                 weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
                 saved_is_output: bool, coef_dz: torch.Tensor, coef_xhat: torch.Tensor,
                 coef_const: torch.Tensor) -> torch.Tensor:
    return torch_ops.backward_dx(saved, dy, mean, invstd, weight, bias, activation, slope,
                                 saved_is_output, coef_dz, coef_xhat, coef_const)


@_backward_dx.register_fake
def _(saved: torch.Tensor, dy: torch.Tensor, mean: torch.Tensor, invstd: torch.Tensor,
      weight: torch.Tensor, bias: torch.Tensor, activation: str, slope: float,
      saved_is_output: bool, coef_dz: torch.Tensor, coef_xhat: torch.Tensor,
      coef_const: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(saved)


# ---- torch_ops' signatures --------------------------------------------------------------


def aside_channels(weight: torch.Tensor, bias: torch.Tensor, min_gamma: float) -> torch.Tensor:
    """Indices of the channels ``torch_ops.small_gamma`` flags."""
    return torch.ops.encoding_syncbn.aside_channels(weight, bias, float(min_gamma))


def channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    mean, m2 = torch.ops.encoding_syncbn.aten_channel_stats(x)
    channels = x.shape[1]
    return mean, m2, (x.numel() // channels if channels else 0)


def batch_stats(x, eps: float, running_mean, running_var, batches, momentum, weight, bias,
                gamma_limit: float):
    """``torch_ops.batch_stats``: the statistics as an opaque op, then ``finalize_stats``
    (plain ATen on per-channel vectors and buffers: traceable as it is)."""
    mean, m2, count = channel_stats(x)
    invstd, small = torch_ops.finalize_stats(mean, m2, count, eps, running_mean, running_var,
                                             batches, momentum, weight, bias, gamma_limit)
    return mean, invstd, small


def normalize_act(x, mean, invstd, weight, bias, activation: str, slope: float, out):
    torch.ops.encoding_syncbn.aten_normalize_act_(x, mean, invstd, weight, bias, activation,
                                                  float(slope), out)
    return out


def normalize_running(x, running_mean, running_var, eps: float, weight, bias, activation: str,
                      slope: float, out):
    return torch.ops.encoding_syncbn.aten_normalize_running_(
        x, running_mean, running_var, float(eps), weight, bias, activation, float(slope), out)


def backward_reduce(saved, dy, mean, invstd, weight, bias, activation: str, slope: float,
                    saved_is_output: bool):
    return torch.ops.encoding_syncbn.aten_backward_reduce(
        saved, dy, mean, invstd, weight, bias, activation, float(slope), bool(saved_is_output))


def backward_dx(saved, dy, mean, invstd, weight, bias, activation: str, slope: float,
                saved_is_output: bool, coef_dz, coef_xhat, coef_const):
    return torch.ops.encoding_syncbn.aten_backward_dx(
        saved, dy, mean, invstd, weight, bias, activation, float(slope), bool(saved_is_output),
        coef_dz, coef_xhat, coef_const)
