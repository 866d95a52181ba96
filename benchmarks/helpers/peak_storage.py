"""The most bytes of tensor storages alive at once inside a dispatch mode."""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


class PeakStorage(TorchDispatchMode):
    """``peak``: the most bytes of storages made inside the mode alive at once; the storages
    of ``inputs`` (which their views share) are not counted.

    Counts storages, not tensors, so views cost nothing; a storage stops counting when it
    is freed (``weakref.finalize``)."""

    def __init__(self, *inputs: torch.Tensor) -> None:
        super().__init__()
        self.live = {t.untyped_storage().data_ptr(): 0 for t in inputs}
        self.now = self.peak = 0

    def _freed(self, key: int) -> None:
        self.now -= self.live.pop(key)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().nbytes():
                storage = t.untyped_storage()
                key = storage.data_ptr()
                if key not in self.live:
                    self.live[key] = storage.nbytes()
                    self.now += storage.nbytes()
                    self.peak = max(self.peak, self.now)
                    weakref.finalize(storage, self._freed, key)
        return out
