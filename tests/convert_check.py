"""What every conversion must keep: the converted model computes what the original does."""

from __future__ import annotations

import copy

import torch
from reference import assert_close
from torch import nn

from encoding_syncbn import convert_sync_batchnorm, revert_sync_batchnorm
from encoding_syncbn.conversions.convert import _conversion_for
from encoding_syncbn.testing import SimulatedDataParallel


def tensors(out) -> list[torch.Tensor]:
    """The tensors of a model's output (a tensor, or a dict / tuple / list of them)."""
    if isinstance(out, torch.Tensor):
        return [out]
    items = out.values() if isinstance(out, dict) else out
    return [t for item in items for t in tensors(item)]


def run(model: nn.Module, x: torch.Tensor, seed: int = 0):
    """Output, input gradient and parameter gradients (by name) of one forward/backward with a
    fixed random output gradient (and the same draws for dropout)."""
    x = x.detach().clone().requires_grad_()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    outs = tensors(model(x))
    generator = torch.Generator().manual_seed(seed)
    grads = [torch.randn(o.shape, dtype=o.dtype, generator=generator) for o in outs]
    torch.autograd.backward(outs, grads)
    params = {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
    return [o.detach() for o in outs], x.grad, params


def assert_all_close(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor],
                     what: str) -> None:
    """Every tensor within 1e-9 of the largest magnitude among ``expected``'s.

    Float64 round-off through a whole network stays below 1e-10 of that scale on the models
    here (elementwise tolerances fail on gradients that are zero but for round-off, such as a
    bias followed by another BatchNorm); a conversion that changes what a layer computes is
    off by a fair fraction of it. One pass over all tensors: torch.testing's per-tensor check
    takes seconds on a whole model.
    """
    assert list(actual) == list(expected), what
    names = [name for name in expected if not torch.equal(actual[name], expected[name])]
    if not names:
        return
    scale = max(expected[name].detach().double().abs().max().item() for name in expected
                if expected[name].numel() > 0)
    for name in names:
        error = (actual[name].double() - expected[name].double()).abs().max().item()
        assert error <= 1e-9 * scale, (
            f"{what}: {name} differs by {error:.3g}, scale {scale:.3g}")


def assert_same_run(actual, expected, what: str) -> None:
    (outs, dx, params), (ref_outs, ref_dx, ref_params) = actual, expected
    assert len(outs) == len(ref_outs), what
    assert_all_close(dict(enumerate(outs)), dict(enumerate(ref_outs)), f"{what}: output")
    assert_all_close({"x": dx}, {"x": ref_dx}, f"{what}: input gradient")
    assert_all_close(params, ref_params, f"{what}: gradient")


def assert_same_state(actual: nn.Module, expected: nn.Module, what: str) -> None:
    assert_all_close(actual.state_dict(), expected.state_dict(), what)


def per_replica_norms(model: nn.Module) -> list[str]:
    """Paths of the modules the converter would still replace: per-replica normalisation."""
    return [name for name, m in model.named_modules() if _conversion_for(m, name) is not None]


def check_conversion(original: nn.Module, x: torch.Tensor, replicas: int = 0) -> nn.Module:
    """Convert a copy of ``original`` with ``convert_sync_batchnorm`` and check, in float64:

    - nothing per-replica is left, and ``original``'s ``state_dict`` loads with strict=True;
    - train mode: the same outputs, input gradients and gradients of the replaced layers'
      parameters, then the same state (running statistics after the step); eval mode: the
      same again (the other parameters are frozen: their gradients follow from the input
      gradients of the replaced layers, and take most of the time);
    - with ``replicas``, the converted model under ``SimulatedDataParallel`` matches the
      original on the whole batch (see ``check_replicas``);
    - revert gives back the original classes, the same state and the same outputs (in
      eval mode).

    Returns the converted model.
    """
    original = original.double()
    replaced = {id(p) for name, m in original.named_modules() if _conversion_for(m, name)
                for p in m.parameters()}
    for p in original.parameters():
        p.requires_grad_(id(p) in replaced)
    converted = convert_sync_batchnorm(copy.deepcopy(original))
    check_converted(converted, original, x, replicas)
    reverted = check_reverted(converted, original, x)
    assert [type(m) for m in reverted.modules()] == [type(m) for m in original.modules()]
    return converted


def check_converted(converted: nn.Module, original: nn.Module, x: torch.Tensor,
                    replicas: int = 0, same_run=assert_same_run) -> None:
    """What every converter must keep (float64 ``original``, ``converted`` a copy of it):
    nothing per-replica left; ``original``'s ``state_dict`` loads strictly; in train then
    eval mode, ``same_run`` of one step each and the same state after it; with ``replicas``,
    ``check_replicas``."""
    assert per_replica_norms(converted) == []
    converted.load_state_dict(original.state_dict(), strict=True)
    for training in (True, False):
        original.train(training)
        converted.train(training)
        mode = "train" if training else "eval"
        same_run(run(converted, x), run(original, x), f"converted, {mode}")
        assert_same_state(converted, original, f"converted, after a {mode} step")
    if replicas:
        check_replicas(converted, original, x, replicas)


def check_replicas(converted: nn.Module, original: nn.Module, x: torch.Tensor,
                   replicas: int) -> None:
    """``converted`` under ``SimulatedDataParallel`` computes ``original``'s train-mode output
    on the whole batch (the model must not draw random numbers, such as dropout, whose draws
    differ between replicas). The input is a non-leaf copy: in-place layers may overwrite it."""
    original.train()
    converted.train()
    with torch.no_grad():
        expected = tensors(original(x))
        got = tensors(SimulatedDataParallel(converted, replicas)(x * 1))
    assert len(got) == len(expected)
    for out, ref in zip(got, expected):
        assert_close(out, ref, what=f"{replicas} replicas")


def check_reverted(converted: nn.Module, original: nn.Module, x: torch.Tensor) -> nn.Module:
    """``revert_sync_batchnorm`` of a copy of ``converted`` keeps the state and, in eval
    mode, computes what ``original`` does. Returns the reverted copy."""
    reverted = revert_sync_batchnorm(copy.deepcopy(converted))
    assert_same_state(reverted, original, "reverted")
    assert_same_run(run(reverted.eval(), x), run(original.eval(), x), "reverted")
    return reverted
