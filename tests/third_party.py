"""Import torchvision, timm and segmentation_models_pytorch for the real-model tests.

The torchvision this registry holds is a CUDA build, installed beside the CPU torch: its
compiled ops (``torchvision::nms``, ...) cannot load, and ``import torchvision`` then fails at
its ``torch.library.register_fake("torchvision::...")`` calls, which need those ops to exist.
Its models are pure Python and need none of them, so while importing it (timm and smp import it
too) a registration for a ``torchvision::`` op that does not exist is let fail quietly; every
other registration, before and after, goes through as usual. With a torchvision whose ops load,
nothing is skipped.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch


@contextlib.contextmanager
def quiet_torchvision_fakes():
    register_fake = torch.library.register_fake

    @functools.wraps(register_fake)
    def quiet(op, func=None, /, *args, **kwargs):
        if not (isinstance(op, str) and op.startswith("torchvision::")):
            return register_fake(op, func, *args, **kwargs)

        def register(function):
            try:
                return register_fake(op, function, *args, **kwargs)
            except RuntimeError:  # "operator torchvision::nms does not exist"
                return function

        return register if func is None else register(func)

    torch.library.register_fake = quiet
    try:
        yield
    finally:
        torch.library.register_fake = register_fake


def import_or_skip(name: str):
    """``pytest.importorskip(name)``, with torchvision's op registrations let fail quietly."""
    with quiet_torchvision_fakes():
        return pytest.importorskip(name)
