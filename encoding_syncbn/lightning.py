"""A PyTorch Lightning plugin: ``Trainer(strategy="ddp", plugins=[SyncBatchNormPlugin()])``.

Lightning's DDP strategies ("ddp", "ddp_spawn", "ddp_fork", ...) hand the LightningModule to
their ``LayerSync`` plugin's ``apply`` before wrapping it, and to its ``revert`` when fitting
ends; ``Trainer(sync_batchnorm=True)`` is that with ``torch.nn.SyncBatchNorm``. This plugin
converts with this package instead. It subclasses the ``LayerSync`` of each Lightning package
installed (``lightning`` and ``pytorch_lightning`` define one each), so that the Trainer of
either accepts it. Neither is a dependency of the package: only this module imports them
(``pip install lightning``).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch.distributed as dist
from torch import nn

from .conversions.convert import convert_sync_batchnorm
from .conversions.fuse import convert_inplace_abn

# The Lightning packages whose Trainer may be given the plugin, each with its own LayerSync.
_PACKAGES = ("lightning.pytorch", "pytorch_lightning")


def _layer_sync_classes() -> tuple[type, ...]:
    classes = []
    for package in _PACKAGES:
        try:
            plugins = importlib.import_module(f"{package}.plugins")
        except ModuleNotFoundError as error:
            # Only the package itself may be missing: a broken install says so.
            if error.name != package.split(".")[0]:
                raise
            continue
        classes.append(plugins.LayerSync)
    if not classes:
        raise ImportError(
            "encoding_syncbn.lightning needs PyTorch Lightning, which is not installed: "
            "pip install lightning (`pytorch_lightning` works too)",
            name="lightning",
        )
    return tuple(classes)


class SyncBatchNormPlugin(*_layer_sync_classes()):
    """Synchronised BatchNorm (or In-Place ABN) for Lightning's DDP strategies.

    ``Trainer(strategy="ddp", plugins=[SyncBatchNormPlugin()])`` takes the place of
    ``Trainer(sync_batchnorm=True)`` (Lightning refuses both at once). When fitting starts,
    ``apply`` converts the LightningModule with ``convert_sync_batchnorm``, or with
    ``convert_inplace_abn`` when ``inplace_abn=True``; the checkpoints Lightning writes load
    into the unconverted model. When fitting ends, ``revert`` puts back the modules ``apply``
    replaced, the model's own objects, holding the trained Parameters and buffers: the
    activations that In-Place ABN fused, too (``revert_sync_batchnorm`` alone would leave
    ``BatchNormAct`` layers and ``nn.Identity`` there).

    Args:
        inplace_abn: convert with ``convert_inplace_abn`` (In-Place ABN where the model's
            graph allows it) instead of ``convert_sync_batchnorm``.
        process_group: the group to synchronise over. None: every rank. Lightning starts the
            processes and initialises ``torch.distributed`` itself, after this plugin is
            made, so a group is best given as a function that creates it, e.g.
            ``lambda: torch.distributed.new_group([0, 1])``, which ``apply`` calls on every
            rank (with ``ddp_spawn``, a function defined at module level: the plugin is
            pickled). A group object must exist in the process when ``apply`` runs.
    """

    def __init__(self, inplace_abn: bool = False, process_group: Any = None) -> None:
        if not isinstance(inplace_abn, bool):
            raise TypeError(
                f"SyncBatchNormPlugin: inplace_abn must be a bool, got "
                f"{type(inplace_abn).__name__} {inplace_abn!r}"
            )
        self.inplace_abn = inplace_abn
        self.process_group = process_group
        # What the last ``apply`` replaced, for ``revert``: the converted model and, by path,
        # the modules it held before.
        self._converted: nn.Module | None = None
        self._originals: dict[str, nn.Module] = {}

    def apply(self, model: nn.Module) -> nn.Module:
        """``model`` with its norm layers synchronised over ``process_group``."""
        group = self._resolve_group()
        before = dict(model.named_modules(remove_duplicate=False))
        convert = convert_inplace_abn if self.inplace_abn else convert_sync_batchnorm
        converted = convert(model, group)
        after = dict(converted.named_modules(remove_duplicate=False))
        replaced = [path for path, module in before.items() if after.get(path) is not module]
        # A replaced module's children went with it: only the outermost ones are put back.
        self._originals = {
            path: before[path] for path in replaced
            if not any(_inside(path, other) for other in replaced if other != path)
        }
        self._converted = converted
        return converted

    def revert(self, model: nn.Module) -> nn.Module:
        """``model`` with the modules ``apply`` replaced put back, each holding the
        Parameters and buffers of the module now in its place. Any other module than the
        one the last ``apply`` returned (Lightning reverts after a fit that failed before
        ``apply``) comes back as it is."""
        if model is not self._converted:
            return model
        originals, self._originals, self._converted = self._originals, {}, None
        if "" in originals:
            return _restored(originals[""], model)
        for path, original in originals.items():
            parent_path, _, name = path.rpartition(".")
            parent = model.get_submodule(parent_path)
            parent.register_module(name, _restored(original, parent.get_submodule(name)))
        return model

    def _resolve_group(self) -> Any:
        group = self.process_group() if callable(self.process_group) else self.process_group
        if group is None or group == dist.GroupMember.NON_GROUP_MEMBER:
            return group
        problem = "torch.distributed is not initialised"
        if dist.is_available() and dist.is_initialized():
            try:
                # Raises for a group torch.distributed does not hold: destroyed, or made by
                # an earlier initialisation.
                dist.get_rank(group)
                return group
            except ValueError as error:
                problem = str(error)
        raise ValueError(
            f"SyncBatchNormPlugin: process_group {group!r} is not a process group of this "
            f"process when Lightning applies the plugin ({problem}). Pass a function that "
            f"creates it, e.g. SyncBatchNormPlugin(process_group=lambda: "
            f"torch.distributed.new_group(ranks)), which the plugin calls on every rank once "
            f"Lightning has initialised torch.distributed; or None, for every rank"
        )


def _inside(path: str, ancestor: str) -> bool:
    return ancestor == "" or path.startswith(ancestor + ".")


def _restored(original: nn.Module, current: nn.Module) -> nn.Module:
    """``original``, re-pointed at ``current``'s Parameters and buffers of the same names
    (the converters share them, but Lightning may have replaced them since: ``.to()``,
    a precision's conversion)."""
    for name, _ in list(original.named_parameters(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        setattr(original.get_submodule(owner), attr, current.get_parameter(name))
    for name, _ in list(original.named_buffers(remove_duplicate=False)):
        owner, _, attr = name.rpartition(".")
        setattr(original.get_submodule(owner), attr, current.get_buffer(name))
    return original


__all__ = ["SyncBatchNormPlugin"]
