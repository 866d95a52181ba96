"""How the layers meet torch's graph capture other than ``torch.compile`` (which traces the
registered custom ops: the Triton kernels stay):

- ``torch.fx`` symbolic tracing (torchvision's ``create_feature_extractor``, timm's FX feature
  extraction, quantisation prep): a layer records itself as one ``call_module`` node, a leaf,
  as FX records ``torch.nn``'s own modules. Running the traced module calls the layer itself,
  synchronised and in place as before.
- ``torch.export`` and ``torch.jit.trace`` (TorchScript, the TorchScript-based ONNX
  exporter) of an evaluating layer: the layer computes in ATen ops, the same formula as its
  kernels (``functional.norm_act_composite``), so that the captured program needs neither this
  package nor Triton to run (ONNX, AOTInductor, ExecuTorch). Of a training layer both are
  refused, naming the layer: a captured program cannot exchange statistics with the
  DataParallel replicas or processes it will run beside, so it would normalise each one's
  batch alone, silently (``nn.SyncBatchNorm`` exports outside torch.distributed as such a
  plain BatchNorm).
  ``revert_sync_batchnorm`` gives that per-replica model in plain modules, to capture
  knowingly.
- ``torch.jit.script``: refused, naming the layer; ``revert_sync_batchnorm`` gives the
  equivalent plain modules, which script.
- ``torch.func`` transforms (``grad``, ``vjp``, ``jacrev``, ``jvp``, ``vmap``: meta-learning,
  per-sample gradients) and forward-mode AD (inside ``torch.autograd.forward_ad``'s
  ``dual_level``), which run no custom autograd Function written as the layer's are:
  the layer computes in differentiable ATen ops, in training too (its batch's statistics,
  the running statistics updated as ``nn.BatchNorm`` updates them: a transform refuses that
  in-place update of buffers it did not get as inputs, as it refuses nn.BatchNorm's), out of
  place and unsynchronised (a synchronised training call is refused).
"""

from __future__ import annotations

import torch

from .. import compat

_REVERT = (
    "encoding_syncbn.revert_sync_batchnorm(model) gives the same model with plain torch "
    "modules (the same parameters and statistics)"
)


def is_fx_proxy(value: object) -> bool:
    """Whether ``value`` is what ``torch.fx`` passes through a module while tracing."""
    return isinstance(value, torch.fx.Proxy)


def fx_leaf_call(layer: torch.nn.Module, label: str, proxy: torch.fx.Proxy) -> torch.fx.Proxy:
    """Record ``layer(proxy)`` as a ``call_module`` node of the graph being traced (``label``:
    how errors name the layer).

    Called first thing by the ``forward`` of each class that defines one (a subclass's
    ``forward`` that calls its base's after some work of its own must check first itself,
    else the node would stand for the whole module and that work would be traced twice).
    """
    tracer = proxy.tracer
    path = tracer.path_of_module(layer)
    if not path:
        raise TypeError(
            f"{label}: torch.fx records this layer as one call of the model that contains it, "
            "and cannot trace it as the root of a trace; trace that model instead"
        )
    return tracer.create_proxy("call_module", path, (proxy,), {})


def in_forward_ad() -> bool:
    """Whether a ``torch.autograd.forward_ad.dual_level`` is open (its dual tensors may reach
    the layer as its input or its parameters)."""
    return compat.forward_ad_level() >= 0


def in_aten_ops() -> bool:
    """Whether the layer computes in ATen ops, its kernels' formula
    (``functional.norm_act_composite``): its call is being captured for a program that must
    run without this package (``torch.jit.trace``, ``torch.export``: both refuse a training
    layer, see ``capture_of_training``), or differentiated by a ``torch.func`` transform or in
    forward mode."""
    return compat.transformed_or_jit_traced() or in_forward_ad() or compat.exporting()


def capture_of_training(training: bool) -> str | None:
    """Which capture records a training layer now (``torch.jit.trace``,
    ``torch.export``), refused by ``refuse_training_capture``; None: none."""
    if not training:
        return None
    if torch.jit.is_tracing():
        return "torch.jit.trace"
    if compat.exporting():
        return "torch.export"
    return None


def refuse_training_capture(label: str, capture: str) -> None:
    """``torch.jit.trace`` or ``torch.export`` (``capture``) of a training layer."""
    raise RuntimeError(
        f"{label}: {capture} records the layer in evaluation only (model.eval() first): a "
        "captured training step cannot synchronise the batch statistics across DataParallel "
        "replicas or processes, and would normalise each one's batch alone; to capture that "
        f"per-replica training step knowingly, capture the reverted model: {_REVERT}"
    )


def refuse_synced_transform(label: str) -> None:
    """A synchronised training call under a ``torch.func`` transform."""
    raise RuntimeError(
        f"{label}: under a torch.func transform the layer computes in ATen ops, with its own "
        "replica's batch statistics only, and cannot synchronise them across replicas or "
        "processes; apply the transform inside each replica to an unsynchronised layer "
        "(sync=False), or outside torch.func"
    )


def refuse_script(label: str) -> None:
    """``torch.jit.script`` of a model holding the layer (``__prepare_scriptable__``)."""
    raise TypeError(
        f"{label}: torch.jit.script cannot compile a synchronised layer (Triton kernels, "
        f"autograd Functions, replica threads); {_REVERT}, which script. "
        "torch.export.export and torch.jit.trace (in evaluation) take the layer as it is"
    )
