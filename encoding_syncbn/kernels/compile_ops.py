"""What ``torch.compile`` traces in place of the eager-only steps of the ATen path.

``torch_ops`` walks tensors in slabs with ``out=`` calls and compares ``data_ptr()``s: fast
eagerly, but not traceable. While compiling, the layer calls these custom ops instead
(:data:`BACKEND`): each runs the very same ``torch_ops`` function on real tensors (so compiled
and eager results agree bitwise) and is opaque to the tracer, which sees only its fake (shape)
implementation.

Eagerly the layer never dispatches through these ops (see ``kernels.reference_ops``).
"""

from __future__ import annotations

import torch

from . import torch_ops
from .backend import BatchSums, DxCoefs, GammaCheck, NormParams, RunningParams, RunningStats
from .custom_ops import OpsBackend, channel_count, channel_vectors, custom_op


@custom_op("aten_channel_stats")
def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, m2, _ = torch_ops.channel_stats(x)
    return mean, m2


_channel_stats.register_fake(channel_vectors)


def _batch_stats(x: torch.Tensor, eps: float, running: RunningStats | None,
                 check: GammaCheck | None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``torch_ops.batch_stats``: the statistics as an opaque op, then ``finalize_stats``
    (plain ATen on per-channel vectors and buffers: traceable as it is)."""
    mean, m2 = _channel_stats(x)
    invstd, small = torch_ops.finalize_stats(mean, m2, channel_count(x), eps, running, check)
    return mean, invstd, small


# Mutates ``out`` and returns nothing: torch derives its fake implementation.
@custom_op("aten_normalize_act_", mutates_args=("out",))
def _normalize_act(x: torch.Tensor, params: NormParams, out: torch.Tensor) -> None:
    torch_ops.normalize_act(x, params, out)


@custom_op("aten_normalize_running_", mutates_args=("out",))
def _normalize_running(x: torch.Tensor, running: RunningParams,
                       out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_ops.normalize_running(x, running, out)


_normalize_running.register_fake(channel_vectors)


@custom_op("aten_backward_reduce")
def _backward_reduce(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                     saved_is_output: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return torch_ops.backward_reduce(saved, dy, params, saved_is_output)


_backward_reduce.register_fake(channel_vectors)


@custom_op("aten_backward_dx")
def _backward_dx(saved: torch.Tensor, dy: torch.Tensor, params: NormParams,
                 saved_is_output: bool, coefs: DxCoefs | BatchSums) -> torch.Tensor:
    return torch_ops.backward_dx(saved, dy, params, saved_is_output, coefs)


@_backward_dx.register_fake
def _(saved: torch.Tensor, *_) -> torch.Tensor:
    return torch.empty_like(saved)


#: ``torch_ops`` as ``torch.compile`` traces it.
BACKEND = OpsBackend("compiled", channel_stats=_channel_stats, batch_stats=_batch_stats,
                        normalize_act=_normalize_act, normalize_running=_normalize_running,
                        backward_reduce=_backward_reduce, backward_dx=_backward_dx)
