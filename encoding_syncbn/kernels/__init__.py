"""Backend choice for the layer's ops (see ``torch_ops`` for what they compute, ``backend``
for the protocol a backend implements).

``"torch"``: ATen calls, any device. ``"triton"``: the Triton kernels; CUDA tensors, or CPU
tensors under Triton's interpreter (``TRITON_INTERPRET=1`` set before triton is imported).
``"auto"`` (the default): Triton for CUDA tensors when triton imports, ATen otherwise.
The initial choice comes from ``ENCODING_SYNCBN_BACKEND``. Asking for ``"triton"`` never
falls back silently: where it cannot run, the call raises and says why.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import torch

from .backend import (
    Backend,
    BatchSums,
    DxCoefs,
    GammaCheck,
    NormParams,
    RunningParams,
    RunningStats,
    Spread,
    batch_spread,
    channel_vector,
    dx_coefs,
    variance_spread,
)
from .torch_backend import COMPILED, TORCH

__all__ = ["Backend", "BatchSums", "DxCoefs", "GammaCheck", "NormParams", "RunningParams",
           "RunningStats", "Spread", "batch_spread", "channel_vector", "dx_coefs",
           "get_backend", "key_ops", "ops_for", "reference_ops", "set_backend",
           "variance_spread"]

BACKENDS = ("auto", "torch", "triton")
BACKEND_ENV = "ENCODING_SYNCBN_BACKEND"


def _validated(name: str) -> str:
    if name not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {name!r}")
    return name


_backend = _validated(os.environ.get(BACKEND_ENV, "auto") or "auto")
_triton_ops: ModuleType | None = None
_triton_import_error: str | None = None


def set_backend(name: str) -> None:
    """Select ``"auto"``, ``"torch"`` or ``"triton"`` for every layer of this process.

    ``"triton"`` raises, and keeps the current backend, when the kernels cannot be imported.
    """
    global _backend
    _validated(name)
    if name in ("auto", "triton"):
        _load_triton()  # now, not inside a traced (torch.compile) call
    if name == "triton" and _triton_ops is None:
        raise RuntimeError(f"set_backend('triton'): triton cannot be imported: "
                           f"{_triton_import_error}; the 'torch' backend works without it")
    _backend = name


def get_backend() -> str:
    """The backend selected by ``set_backend`` or ``ENCODING_SYNCBN_BACKEND``."""
    return _backend


def _load_triton() -> ModuleType | None:
    """Import the Triton kernels once; remember why not if that fails."""
    global _triton_ops, _triton_import_error
    if _triton_ops is None and _triton_import_error is None:
        try:
            _triton_ops = importlib.import_module(f"{__name__}.triton.ops")
        # Not only ImportError: a Triton release that moved an API fails with AttributeError
        # and the like, and must leave the torch backend working.
        except Exception as error:
            _triton_import_error = f"{type(error).__name__}: {error}"
    return _triton_ops


def triton_available() -> bool:
    """Whether the Triton kernels import here."""
    return _load_triton() is not None


def _imports_triton_with_the_package(name: str) -> bool:
    """Whether the kernels import with the package under the backend ``name``: where it may
    take them (``"auto"`` in a torch built for GPUs). Imported at a first call instead, they
    would be imported inside ``torch.compile``'s trace where that call is compiled, which
    breaks the graph there."""
    return name == "triton" or (name == "auto" and torch.backends.cuda.is_built())


def key_ops(backend: Backend) -> Backend:
    """``backend`` as the calls of one layer key use it (``layer.call_memo``): the Triton
    kernels' eager ops as a ``TrainingStep`` of their own, which keeps each op's launches for
    the calls after it; any other backend as it is."""
    triton_ops = _triton_ops
    if triton_ops is not None and backend is triton_ops.EAGER:
        return triton_ops.TrainingStep()
    return backend


def reference_ops() -> Backend:
    """``TORCH``; while ``torch.compile`` traces, ``COMPILED`` (the same ops as opaque custom
    ops: ``torch_ops`` is not traceable, it walks slabs with ``out=`` calls).

    The check is one flag read, so the eager path keeps calling ATen directly.
    """
    return COMPILED if torch.compiler.is_compiling() else TORCH


def ops_for(x: torch.Tensor) -> Backend:
    """The backend for tensors like ``x`` under the current choice.

    Bitwise agreement between two calls (the checkpoint recompute's lookup) needs the same
    backend for both: callers that must agree keep the backend this returned.
    """
    name = _backend
    if name == "torch":
        return reference_ops()
    # The kernels' module once imported, without a call to ask for it.
    triton_ops = _triton_ops
    if name == "auto":
        if x.is_cuda and (triton_ops := triton_ops or _load_triton()) is not None:
            return triton_ops.backend_for(x)
        return reference_ops()
    if triton_ops is None:
        triton_ops = _load_triton()
    # Where the kernels imported, they know whether they are interpreted (no environment read).
    if triton_ops is not None and (x.is_cuda or triton_ops.INTERPRET or x.is_meta):
        return triton_ops.backend_for(x)  # meta: the ops' fake implementations
    if triton_ops is None:
        raise RuntimeError(f"backend 'triton' was asked for but triton cannot be imported: "
                           f"{_triton_import_error}")
    raise RuntimeError(
        f"backend 'triton' runs on CUDA tensors, got a {x.device.type} tensor; on the CPU it "
        "runs only under Triton's interpreter (set TRITON_INTERPRET=1 before triton is "
        "imported), or choose set_backend('torch')"
    )


if _imports_triton_with_the_package(_backend):
    _load_triton()
