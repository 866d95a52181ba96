"""What every conversion must keep: the converted model computes what the original does."""

from __future__ import annotations

import copy

import torch
from reference import assert_close
from torch import nn

from encoding_syncbn import convert_sync_batchnorm, revert_sync_batchnorm
from encoding_syncbn.convert import _conversion_for
from encoding_syncbn.testing import SimulatedDataParallel


def tensors(out) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, or a dict / tuple / list of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out
    return [t for item in items for t in tensors(item)]


def run(model: nn.Module, x: torch.Tensor, seed: int = 0):
    """Output, input gradient and parameter gradients (by name) of one forward/backward with a
    fixed random output gradient."""
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    outs = tensors(model(x))
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outs]
    torch.autograd.backward(outs, grads)
    params = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], x.grad, params


def assert_same_run(actual, expected, what: str) -> None:
    (outs, dx, params), (ref_outs, ref_dx, ref_params) = actual, expected
    assert len(outs) == len(ref_outs)
    for out, ref in zip(outs, ref_outs):
        assert_close(out, ref, what=f"{what}: output")
    assert_close(dx, ref_dx, what=f"{what}: input gradient")
    assert params.keys() == ref_params.keys(), what
    for name, grad in params.items():
        assert_close(grad, ref_params[name], what=f"{what}: gradient of {name}")


def assert_same_state(actual: nn.Module, expected: nn.Module, what: str) -> None:
    state, ref_state = actual.state_dict(), expected.state_dict()
    assert list(state) == list(ref_state), what
    for name, value in state.items():
        assert_close(value, ref_state[name], what=f"{what}: {name}")


def per_replica_norms(model: nn.Module) -> list[str]:
    """Paths of the modules the converter would still replace: per-replica normalisation."""
    return [name for name, m in model.named_modules() if _conversion_for(m, name) is not None]


def check_conversion(original: nn.Module, x: torch.Tensor, replicas: int = 0) -> nn.Module:
    """Convert a copy of ``original`` and check, in float64:

    - nothing per-replica is left, and ``original``'s ``state_dict`` loads with strict=True;
    - train mode: the same outputs, input and parameter gradients, then the same state
      (running statistics after the step); eval mode: the same again;
    - with ``replicas``, the converted model under ``SimulatedDataParallel`` matches the
      original on the whole batch (train-mode forward);
    - revert gives back the original classes, the same state and the same outputs.

    Returns the converted model.
    """
    original = original.double()
    converted = convert_sync_batchnorm(copy.deepcopy(original))
    assert per_replica_norms(converted) == []
    converted.load_state_dict(original.state_dict(), strict=True)
    for training in (True, False):
        original.train(training)
        converted.train(training)
        mode = "train" if training else "eval"
        assert_same_run(run(converted, x), run(original, x), f"converted, {mode}")
        assert_same_state(converted, original, f"converted, after a {mode} step")
    if replicas:
        original.train()
        converted.train()
        with torch.no_grad():
            expected = tensors(original(x))
            got = tensors(SimulatedDataParallel(converted, replicas)(x))
        for out, ref in zip(got, expected):
            assert_close(out, ref, what=f"{replicas} replicas")
    reverted = revert_sync_batchnorm(copy.deepcopy(converted))
    assert [type(m) for m in reverted.modules()] == [type(m) for m in original.modules()]
    assert_same_state(reverted, original, "reverted")
    for training in (True, False):
        original.train(training)
        reverted.train(training)
        assert_same_run(run(reverted, x), run(original, x), "reverted")
    return converted
