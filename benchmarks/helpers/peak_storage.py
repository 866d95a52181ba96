"""The most bytes of tensor storages alive at once inside a dispatch mode."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def _storages(tree) -> dict[int, torch.UntypedStorage]:
    """The storages of the tensors in ``tree`` (of any nesting), by their data pointer."""
    return {t.untyped_storage().data_ptr(): t.untyped_storage()
            for t in tree_flatten(tree)[0]
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes()}


class PeakStorage(TorchDispatchMode):
    """``peak``: the most bytes of storages made inside the mode alive at once; the storages
    of ``inputs`` (which their views share) are not counted.

    Counts storages, not tensors, so views cost nothing; a storage counts from the op that
    made it (one of its results whose storage none of its arguments has: a view, an in-place
    or an ``out=`` op hands back one it was given, such as a tensor the backward saved in the
    forward) until it is freed (``weakref.finalize``)."""

    def __init__(self, *inputs: torch.Tensor) -> None:
        super().__init__()
        self.live = {t.untyped_storage().data_ptr(): 0 for t in inputs}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = _storages((args, kwargs))
        for key, storage in _storages(out).items():
            if key not in self.live and key not in given:
                self.live[key] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._freed, key)
        return out
