"""Opt-in checks of in-place layers' misuse, at the operation that misuses them.

An in-place layer (``SyncBatchNorm(..., inplace=True)``) writes its output over its input
and keeps only the output for backward. Two misuses follow:

- the **input used again** after the layer (``abn(x) + x``): ``x`` now holds the output, so
  the result is silently wrong (no error ever comes);
- the **output modified in place** after the layer (``out += identity``, or a second
  in-place layer fed the output directly): backward cannot rebuild the input; without
  checks the layer's backward raises, naming the layer (see ``functional._unpack``).

With checks on (``with encoding_syncbn.check_inplace():``, or ``ENCODING_SYNCBN_CHECK=1`` in
the environment for the whole process), each in-place call

- turns the tensor it overwrote into an ``OverwrittenTensor``: any later torch operation on
  it raises, naming the layer (metadata such as ``.shape`` still works);
- returns its output as an ``InPlaceOutput``: an in-place operation on it (``+=``, ``add_``,
  ``out=``, ``inplace=True``, an in-place layer), or any use after a write through another
  alias (its version counter moved), raises while the output's gradient is still needed.

Checks cost a Python-level hook per operation on those tensors: a debugging mode, off by
default. What they cannot see: writes through a view taken before the misuse (``out[:, :2]
+= 1``; backward still names the layer), and tensors that share the input's memory under
another name (``y = x.view(...)`` before ``abn(x)``; ``y`` is silently overwritten too).
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .. import compat

# Whole process, every thread: DataParallel's replicas run the layers on threads of their own.
_ENV = "ENCODING_SYNCBN_CHECK"
_lock = threading.Lock()
_active = 0
# Read once, at import: the check runs on every in-place call.
_FROM_ENV = os.environ.get(_ENV, "0") not in ("", "0")


def checking() -> bool:
    """Whether in-place calls are checked now (``check_inplace`` or ENCODING_SYNCBN_CHECK)."""
    return (_active > 0 or _FROM_ENV) and not torch.compiler.is_compiling()


@contextlib.contextmanager
def check_inplace() -> Iterator[None]:
    """Check every in-place layer's misuse while the block runs, in every thread.

    See this module's docstring for what is checked. Nestable.
    """
    global _active
    with _lock:
        _active += 1
    try:
        yield
    finally:
        with _lock:
            _active -= 1


# Tensor attributes that read no values: allowed on an overwritten tensor.
_METADATA = frozenset({
    "shape", "size", "dim", "ndim", "dtype", "device", "layout", "numel", "stride",
    "storage_offset", "is_contiguous", "requires_grad", "is_leaf", "grad_fn", "data_ptr",
    "names", "is_cuda", "is_sparse", "is_quantized", "is_meta", "element_size",
    "nelement", "__class__", "__len__",
})
_INPLACE_OPERATORS = frozenset({
    "__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__imod__",
    "__ipow__", "__iand__", "__ior__", "__ixor__", "__ilshift__", "__irshift__",
    "__imatmul__", "__setitem__",
})


def _name(func: Any) -> str:
    """``func``'s name; for a property getter (``Tensor.shape.__get__``) the property's."""
    name = getattr(func, "__name__", "")
    if name in ("__get__", "__set__"):
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


def _writes_first_argument(func: Any, args: tuple, kwargs: dict) -> bool:
    """Whether ``func(*args, **kwargs)`` writes its first argument (or writes to ``out=``)."""
    name = _name(func)
    if name in _INPLACE_OPERATORS or (name.endswith("_") and not name.startswith("__")):
        return True
    if kwargs.get("inplace") is True:
        return True
    # torch.nn.functional's activations take ``inplace`` positionally too.
    return any(arg is True for arg in args[1:]) and name in _POSITIONAL_INPLACE


_POSITIONAL_INPLACE = frozenset({
    "relu", "leaky_relu", "elu", "celu", "selu", "hardtanh", "relu6", "silu", "mish",
    "hardswish", "hardsigmoid", "rrelu", "threshold",
})


class _Checked(torch.Tensor):
    """Both checked kinds: one ``__torch_function__`` sees every tensor of a call, whichever
    kind torch asks first."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        with compat.disable_torch_function_subclass():
            for arg in (*args, *kwargs.values()):
                if isinstance(arg, OverwrittenTensor):
                    _check_overwritten_use(arg, func)
                elif isinstance(arg, InPlaceOutput) and arg.requires_grad:
                    _check_output_use(arg, func, args, kwargs)
            return func(*args, **kwargs)


class OverwrittenTensor(_Checked):
    """A tensor an in-place layer overwrote (checks on): using it again is an error."""

    _overwritten_by: str


class InPlaceOutput(_Checked):
    """An in-place layer's output (checks on): writing it while backward needs it is an
    error, raised at the write."""

    _written_by: str
    _expected_version: int


def _check_overwritten_use(stale: OverwrittenTensor, func: Any) -> None:
    name = _name(func)
    # Private attributes are autograd's bookkeeping (``_backward_hooks`` when a view of the
    # tensor is written), not a read of its values.
    private = name.startswith("_") and not name.startswith("__")
    if name in _METADATA or private or func is torch.Tensor.__repr__:
        return
    raise RuntimeError(
        f"{stale._overwritten_by} (inplace=True) overwrote this tensor with its output, and "
        f"it was used again after the layer ({_name(func)}; e.g. `abn(x) + x`, which silently "
        "adds the output to itself). Use the value the layer returned, keep a copy of the "
        "input before the layer, or use inplace=False for that layer"
    )


def _check_output_use(out: InPlaceOutput, func: Any, args: tuple, kwargs: dict) -> None:
    if out._version != out._expected_version:
        raise RuntimeError(_output_written_message(out._written_by, "through another alias"))
    if out is kwargs.get("out") or (out is args[0] and _writes_first_argument(func, args, kwargs)):
        raise RuntimeError(_output_written_message(out._written_by, f"by {_name(func)}"))


def _output_written_message(layer: str, how: str) -> str:
    return (
        f"{layer} (inplace=True): its output is modified in place {how} while its backward "
        "still needs it to rebuild the input (`out += identity` after the layer, or another "
        "in-place layer fed this output directly). Fix: write `out = out + identity` instead "
        "of `out += identity`, or use inplace=False for that layer"
    )


def before_write(x: torch.Tensor, layer: str) -> None:
    """Raise if ``x``, which ``layer`` is about to overwrite, is an in-place layer's output
    that its backward still needs."""
    with compat.disable_torch_function_subclass():
        if isinstance(x, InPlaceOutput) and x.requires_grad:
            raise RuntimeError(_output_written_message(x._written_by, f"by {layer}"))


def after_write(x: torch.Tensor, out: torch.Tensor, layer: str) -> torch.Tensor:
    """Mark ``x`` (overwritten by ``layer``) stale; return ``out`` as a checked alias."""
    with compat.disable_torch_function_subclass():
        result = out.as_subclass(InPlaceOutput)
        result._written_by, result._expected_version = layer, out._version
    # Only plain tensors change class: a user's own subclass keeps its behaviour.
    if type(x) in (torch.Tensor, InPlaceOutput):
        x.__class__ = OverwrittenTensor
        x._overwritten_by = layer
    return result
