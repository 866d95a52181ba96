"""``SimulatedDataParallel``: ``nn.DataParallel``'s semantics on one device, replicas in threads.

It scatters, replicates, runs and gathers the way ``nn.DataParallel`` does, so that the
synchronisation of ``SyncBatchNorm`` (and any user model that contains it) can be tested on a
machine without GPUs:

- scatter: every tensor argument is split with ``torch.chunk`` along dim 0, so a batch of 6
  over 4 replicas gives 3 chunks, and one replica is made per chunk; each chunk is a copy,
  as the per-device copies of ``nn.DataParallel``'s scatter are (not a view of the batch);
- replicate: ``_replicate_for_data_parallel()`` is called for every submodule and replica in
  the order ``torch.nn.parallel.replicate`` uses; parameters are shared (each replica sees a
  non-leaf view whose gradient flows to the original); replica 0 keeps the original buffers,
  the others get copies whose updates are discarded;
- run: one thread per replica, with the caller's grad mode and autocast (mixed precision) on
  the inputs' device type: both are thread-local, and ``parallel_apply`` sets them again in
  its replica threads;
- gather: ``torch.cat`` along dim 0, through tuples, lists and dicts.

If a replica fails, the call raises that replica's exception, not the ``SyncError`` it caused
in its peers. With a single chunk the module is called directly.
"""

from __future__ import annotations

import threading
import warnings
from contextlib import nullcontext
from typing import Any

import torch
from torch import nn

from .sync.group import SyncError


def _scatter(obj: Any, chunks: int) -> list[Any]:
    """Split every tensor in ``obj`` into ``chunks`` pieces along dim 0."""
    if isinstance(obj, torch.Tensor):
        pieces = torch.chunk(obj, chunks, dim=0)
        if len(pieces) != chunks:
            raise ValueError(
                f"tensor arguments must split into the same number of chunks: expected "
                f"{chunks}, got {len(pieces)} for a batch of {obj.shape[0]}"
            )
        return [piece.clone() for piece in pieces]
    if isinstance(obj, (tuple, list)) and obj:
        columns = [_scatter(item, chunks) for item in obj]
        return [type(obj)(column[j] for column in columns) for j in range(chunks)]
    if isinstance(obj, dict) and obj:
        columns = {key: _scatter(value, chunks) for key, value in obj.items()}
        return [{key: column[j] for key, column in columns.items()} for j in range(chunks)]
    return [obj] * chunks


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj
    items = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (tuple, list)) else ()
    for item in items:
        found = _first_tensor(item)
        if found is not None:
            return found
    return None


def _gather(outputs: list[Any]) -> Any:
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if all(output.dim() == 0 for output in outputs):  # a loss per replica
            warnings.warn("Was asked to gather along dimension 0, but all input tensors were "
                          "scalars; will instead unsqueeze and return a vector.", stacklevel=3)
            outputs = [output.view(1) for output in outputs]  # as nn.DataParallel's gather
        return torch.cat(outputs, dim=0)
    if isinstance(first, dict):
        return type(first)((key, _gather([o[key] for o in outputs])) for key in first)
    if isinstance(first, (tuple, list)):
        return type(first)(_gather(list(column)) for column in zip(*outputs))
    return first


def replicate(network: nn.Module, num_replicas: int) -> list[nn.Module]:
    """``torch.nn.parallel.replicate`` on the network's own device (see the module doc)."""
    modules = list(network.modules())
    index = {module: i for i, module in enumerate(modules)}
    copies = [[None] * len(modules) for _ in range(num_replicas)]
    for i, module in enumerate(modules):
        for j in range(num_replicas):
            copies[j][i] = module._replicate_for_data_parallel()
    for i, module in enumerate(modules):
        for j in range(num_replicas):
            replica = copies[j][i]
            for key, child in module._modules.items():
                replica._modules[key] = None if child is None else copies[j][index[child]]
            for key, param in module._parameters.items():
                # A non-leaf view, as replicate's broadcast copies are non-leaf tensors.
                value = None if param is None else param.view_as(param)
                replica._parameters.pop(key, None)
                object.__setattr__(replica, key, value)
            for key, buf in module._buffers.items():
                replica._buffers[key] = buf if (j == 0 or buf is None) else buf.clone()
    return [copies[j][0] for j in range(num_replicas)]


def _refuse_compiled(module: nn.Module) -> None:
    """Refuse a module compiled on its own inside the one to replicate: ``torch.compile``'s
    wrapper, or a module compiled in place (``module.compile()``). Replication copies a
    module's attributes, the compiled call among them, which runs the original module in
    every replica: its statistics per replica, unsynchronised."""
    for name, child in module.named_modules():
        if ("_torchdynamo_orig_callable" in vars(child)
                or getattr(child, "_compiled_call_impl", None) is not None):
            where = f"module '{name}'" if name else "the module"
            raise TypeError(
                f"SimulatedDataParallel: expected modules to replicate, got {where} compiled "
                f"on its own ({type(child).__name__}), which every replica would run as the "
                "original module; compile the wrapper instead: "
                "torch.compile(SimulatedDataParallel(model, num_replicas))")


class SimulatedDataParallel(nn.Module):
    """Run ``module`` like ``nn.DataParallel`` over ``num_replicas`` devices, in threads."""

    def __init__(self, module: nn.Module, num_replicas: int) -> None:
        super().__init__()
        if not isinstance(num_replicas, int) or num_replicas < 1:
            raise ValueError(f"num_replicas must be a positive int, got {num_replicas!r}")
        _refuse_compiled(module)
        self.module = module
        self.num_replicas = num_replicas

    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        first = _first_tensor((inputs, kwargs))
        if first is None:
            raise ValueError("SimulatedDataParallel needs at least one tensor argument")
        if first.dim() == 0:
            # A 0-D tensor has no batch dim to split: let the module say what it expected,
            # rather than torch.chunk's error.
            return self.module(*inputs, **kwargs)
        chunks = len(torch.chunk(first, self.num_replicas, dim=0))
        if chunks <= 1:
            return self.module(*inputs, **kwargs)
        _refuse_compiled(self.module)  # (``module.compile()`` may come after construction)
        scattered_inputs = _scatter(inputs, chunks)
        scattered_kwargs = _scatter(kwargs, chunks)
        replicas = replicate(self.module, chunks)
        outputs: list[Any] = [None] * chunks
        errors: list[BaseException | None] = [None] * chunks
        grad_enabled = torch.is_grad_enabled()
        device_type = first.device.type
        # (Devices autocast does not know, such as meta, run without it.)
        autocast = (device_type, torch.get_autocast_dtype(device_type),
                    torch.is_autocast_enabled(device_type)
                    ) if torch.amp.is_autocast_available(device_type) else None

        def run(j: int) -> None:
            try:
                # A context of its own per thread: autocast's keeps the state it replaces.
                autocasting = torch.amp.autocast(*autocast) if autocast else nullcontext()
                with torch.set_grad_enabled(grad_enabled), autocasting:
                    outputs[j] = replicas[j](*scattered_inputs[j], **scattered_kwargs[j])
            except BaseException as error:  # re-raised in the caller's thread below
                errors[j] = error

        threads = [threading.Thread(target=run, args=(j,), daemon=True) for j in range(chunks)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        failures = [error for error in errors if error is not None]
        if failures:
            original = [error for error in failures if not isinstance(error, SyncError)]
            first = (original or failures)[0]
            # Hold no exception in this frame: the traceback holds the frame, so that would be
            # a cycle keeping the failed step's replicas and graphs alive until a gc pass.
            errors.clear()
            del failures, original
            try:
                raise first
            finally:
                first = None
        return _gather(outputs)
