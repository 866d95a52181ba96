"""Swap every BatchNorm of a model for ``SyncBatchNorm`` and back."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .modules import SyncBatchNorm

# In place where torch can differentiate that: not for leaky_relu or elu with slope <= 0.
_ACTIVATION_MODULES = {
    "relu": lambda slope: nn.ReLU(inplace=True),
    "leaky_relu": lambda slope: nn.LeakyReLU(slope, inplace=slope > 0),
    "elu": lambda slope: nn.ELU(slope, inplace=slope > 0),
}
_BATCHNORM_BY_INPUT_DIM = {
    2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d
}
# What a converted layer remembers as its input's rank until it sees one (1d: 3-D).
_INPUT_DIM_BY_BATCHNORM = {cls: dim for dim, cls in _BATCHNORM_BY_INPUT_DIM.items()}


def _share_state(source: _BatchNorm, target: _BatchNorm) -> _BatchNorm:
    """Make ``target`` use ``source``'s Parameter objects, buffers and training flag."""
    for name in ("weight", "bias"):
        setattr(target, name, getattr(source, name))
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        target._buffers[name] = source._buffers.get(name)
    target.train(source.training)
    return target


def convert_sync_batchnorm(module: nn.Module, process_group: Any = None) -> nn.Module:
    """Return ``module`` with every ``_BatchNorm`` in it replaced by a ``SyncBatchNorm``.

    The new layers reuse the old ones' Parameter objects and buffers (so an optimizer built
    before the conversion keeps working), and their device, dtype and training flag. Works on
    a model already wrapped in ``nn.DataParallel``.
    """
    if isinstance(module, _BatchNorm) and not isinstance(module, SyncBatchNorm):
        converted = SyncBatchNorm(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            process_group,
            device="meta",
            bias=module.bias is not None or not module.affine,
        )
        converted._last_input_dim[0] = _INPUT_DIM_BY_BATCHNORM.get(type(module))
        return _share_state(module, converted)
    for name, child in module.named_children():
        new_child = convert_sync_batchnorm(child, process_group)
        if new_child is not child:
            module.add_module(name, new_child)
    return module


def revert_sync_batchnorm(module: nn.Module) -> nn.Module:
    """Return ``module`` with every ``SyncBatchNorm`` replaced by plain ``nn.BatchNorm*d``.

    The class follows the last input the layer saw (1d for 2-D and 3-D inputs, 3d for 5-D,
    2d otherwise), or before any, the class it was converted from. A fused activation comes
    back as its own module after the BatchNorm, in an ``nn.Sequential``. Parameters and
    buffers are shared, not copied.
    """
    if isinstance(module, SyncBatchNorm):
        cls = _BATCHNORM_BY_INPUT_DIM.get(module.last_input_dim, nn.BatchNorm2d)
        plain = cls(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
            device="meta",
            bias=module.bias is not None or not module.affine,
        )
        plain = _share_state(module, plain)
        make_activation = _ACTIVATION_MODULES.get(module.activation)
        if make_activation is None:
            return plain
        return nn.Sequential(plain, make_activation(module.slope))
    for name, child in module.named_children():
        new_child = revert_sync_batchnorm(child)
        if new_child is not child:
            module.add_module(name, new_child)
    return module
