"""The ``"torch"`` backend: ``torch_ops`` as a table of ops, eager (:data:`TORCH`) and as
``torch.compile`` traces it (:data:`COMPILED`).

``torch_ops`` walks tensors in slabs with ``out=`` calls and compares ``data_ptr()``s: fast
eagerly, but not traceable. While compiling, the layer calls the registered ops instead: each
runs the very same ``torch_ops`` function on real tensors (so compiled and eager results agree
bitwise) and is opaque to the tracer, which sees only its fake (shape) implementation.
Eagerly the layer never dispatches through them (see ``kernels.reference_ops``).
"""

from __future__ import annotations

import torch

from . import torch_ops
from .backend import NormParams
from .custom_ops import Op, OpsBackend, channel_vectors, implementations, register


def _channel_stats(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean, m2, _ = torch_ops.channel_stats(x)
    return mean, m2


def _normalize_act(x: torch.Tensor, params: NormParams, out: torch.Tensor) -> None:
    """A registered op returns no alias of its input: ``out`` is written, not returned."""
    torch_ops.normalize_act(x, params, out)


def _dx_like_saved(saved: torch.Tensor, *_) -> torch.Tensor:
    """``torch_ops.backward_dx``'s dx: in saved's own layout."""
    return torch.empty_like(saved)


# No batch_stats: ``channel_stats``, then ``finalize_stats`` (``torch_ops.batch_stats`` itself).
OPS = {
    "channel_stats": Op(_channel_stats, channel_vectors),
    "normalize_act": Op(_normalize_act, mutates_args=("out",)),
    "normalize_running": Op(torch_ops.normalize_running, channel_vectors, mutates_args=("out",)),
    "backward_reduce": Op(torch_ops.backward_reduce, channel_vectors),
    "backward_dx": Op(torch_ops.backward_dx, _dx_like_saved),
}

#: ``torch_ops``' ATen calls, any device.
TORCH = OpsBackend("torch", implementations(OPS), batch_backward=torch_ops.batch_backward,
                   scratches_saved=True)
#: What ``torch.compile`` traces in place of ``TORCH`` (the same functions as opaque ops).
COMPILED = OpsBackend("compiled", register(OPS, prefix="aten_"))
