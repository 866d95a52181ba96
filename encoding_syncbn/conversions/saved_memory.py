"""How many bytes of activations a model keeps for backward, from shapes alone.

A copy of the model whose parameters and buffers are meta tensors (no data, no copy of the
model's own) runs one training forward on a meta input of the given shape, and a
saved-tensors hook collects every distinct storage autograd packs, the parameters' excluded:
what ``benchmarks/bench_inplace_memory.py`` measures on real tensors, with nothing computed
and the model's own state untouched. The norm layers' input shapes come from the same run.
Synchronised layers run as one replica's (``sync=False``): they keep the same tensors, and
start no collective with processes that are not measuring.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Sequence

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from ..layer.modules import SyncBatchNorm


@dataclasses.dataclass(frozen=True)
class SavedMemory:
    """What one meta forward in ``dtype`` kept: ``bytes`` in all, and each norm layer's input
    size in bytes (by its path; a layer called several times: its first call)."""

    bytes: int
    norm_inputs: dict[str, int]
    dtype: torch.dtype


def measure(model: nn.Module, input_shape: Sequence[int], dtype: torch.dtype,
            norm_paths: Sequence[str]) -> SavedMemory:
    """One training forward of a meta copy of ``model`` on an input of ``input_shape`` and
    ``dtype``; ``norm_paths``: the norm layers whose input sizes to record. Raises what the
    model's forward raises on meta tensors (a data-dependent branch, an input of the wrong
    shape)."""
    memo: dict[int, object] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (nn.Parameter(meta, tensor.requires_grad)
                            if isinstance(tensor, nn.Parameter) else meta)
    shadow = copy.deepcopy(model, memo)
    shadow.train()
    for module in shadow.modules():
        if isinstance(module, SyncBatchNorm):
            # One replica's batch alone: the same tensors kept, and no collective with
            # processes that are not measuring.
            module.sync = False
        if isinstance(module, _BatchNorm) and module.momentum is None:
            # nn.BatchNorm's cumulative average reads its batch count on the host, which a
            # meta tensor has not: any factor keeps the same tensors.
            module.momentum = 0.1
    # DataParallel would scatter to its devices, where the meta copy is not.
    run = shadow.module if isinstance(shadow, nn.DataParallel) else shadow
    parameters = {_storage_key(p) for p in shadow.parameters()}
    sizes: dict[str, int] = {}
    def record(path: str):
        def hook(module: nn.Module, args: tuple) -> None:
            sizes.setdefault(path, _nbytes(args[0]) if args else 0)
        return hook

    handles = [shadow.get_submodule(path).register_forward_pre_hook(record(path))
               for path in norm_paths]
    kept: dict[int, int] = {}
    saved: list[torch.Tensor] = []  # alive until counted: storage addresses stay unique

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in parameters:
            kept[key] = tensor.untyped_storage().nbytes()
            saved.append(tensor)
        return tensor

    x = torch.empty(tuple(input_shape), device="meta", dtype=dtype)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            run(x * 1)  # a fresh tensor, as a layer's output: in-place layers may write it
    finally:
        for handle in handles:
            handle.remove()
    return SavedMemory(sum(kept.values()), sizes, dtype)


def measure_for(converter: str, model: nn.Module, input_shape: Sequence[int],
                norm_paths: Sequence[str]) -> SavedMemory:
    """``measure`` in the dtype of ``model``'s floating parameters (else torch's default), a
    ValueError naming ``converter`` where the shape is not one or the model fails on it."""
    if (isinstance(input_shape, (str, bytes)) or not isinstance(input_shape, Sequence)
            or len(input_shape) < 2
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0
                       for n in input_shape)):
        raise ValueError(f"{converter}: input_shape must be the shape of one input batch, "
                         f"(N, C, ...) of positive ints, got {input_shape!r}")
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()),
                 torch.get_default_dtype())
    try:
        return measure(model, input_shape, dtype, norm_paths)
    except Exception as error:
        raise ValueError(
            f"{converter}: cannot estimate the memory kept for backward on input_shape="
            f"{tuple(input_shape)}: a training forward of the model's copy on meta tensors of "
            f"that shape failed ({type(error).__name__}: {str(error)[:200]}); give the shape "
            "of an input it takes, or leave input_shape out (a model that reads its data's "
            "values to choose its path has no estimate)"
        ) from error


def _storage_key(tensor: torch.Tensor) -> int:
    """The identity of ``tensor``'s storage (meta tensors have no data address to tell
    them apart)."""
    return tensor.untyped_storage()._cdata


def _nbytes(value: object) -> int:
    return value.numel() * value.element_size() if isinstance(value, torch.Tensor) else 0
