"""Process-wide caches of small read-only tensors built from host values (index tensors,
constants, counts): built once, shared by every later call of every layer."""

from __future__ import annotations

import functools
from typing import Callable, TypeVar

import torch

_Build = TypeVar("_Build", bound=Callable[..., object])


def tensor_cache(maxsize: int) -> Callable[[_Build], _Build]:
    """``functools.lru_cache(maxsize)`` for a function that builds tensors from its (hashable)
    arguments, building them outside inference mode.

    A tensor made under ``torch.inference_mode`` (a validation pass) is an inference tensor:
    autograd refuses to save it for backward, and any later training call that got it from
    the cache would fail. A normal tensor serves calls in and out of inference mode alike.
    """

    def decorate(build: _Build) -> _Build:
        @functools.lru_cache(maxsize=maxsize)
        @functools.wraps(build)
        def cached(*args):
            with torch.inference_mode(False):
                return build(*args)

        return cached  # type: ignore[return-value]

    return decorate
