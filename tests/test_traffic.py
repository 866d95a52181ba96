"""Element traffic of the torch backend, counted: the bytes of element-sized tensors that each
ATen op of one in-place layer's forward and backward reads and writes, in units of the
activation's size, against the plan (as ``benchmarks/traffic.py`` counts the Triton kernels'
loads and stores).

A ``TorchDispatchMode`` sees every ATen op: per op, each element-sized operand (more elements
than channels: per-channel vectors and scalars are free) counts once as read, where the op
reads it, and once as written, where it writes it. A fused op (ATen's BatchNorm backward)
counts its operands once, whatever passes it makes over them inside; ops in a piece walk count
the pieces. Each element-sized tensor an op allocates (an allocation, or a functional op's
result) counts as fresh. The counts are exact, so the test fails on one element pass or one
allocation more than the plan.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

import encoding_syncbn
from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.kernels import BatchSums, DxCoefs, NormParams, torch_ops

SHAPE = (4, 8, 16, 16)
CHANNELS = SHAPE[1]
# Ops that allocate their result.
_ALLOCATIONS = {"empty_like", "empty_strided", "empty", "new_empty", "new_empty_strided",
                "zeros_like", "ones_like", "full_like"}
# Ops that move no element: views, allocations.
_NO_TRAFFIC = _ALLOCATIONS | {"_to_copy", "lift_fresh", "set_", "resize_"}
# In-place ops that overwrite their ``self`` without reading it.
_OVERWRITE = {"copy_", "fill_", "zero_"}


class Traffic(TorchDispatchMode):
    """Bytes of element-sized tensors read and written by the ATen ops run under it, and how
    many element-sized tensors they allocate (``fresh``: a fresh buffer costs memory and, on
    the CPU, page faults, which no byte count shows)."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.channels = channels
        self.bytes = 0
        self.fresh = 0
        self.ops: list[tuple[str, int]] = []

    def _size(self, t: object) -> int:
        if isinstance(t, torch.Tensor) and t.numel() > self.channels:
            return t.numel() * t.element_size()
        return 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if func.is_view or name.startswith("_foreach"):
            return out
        if name in _ALLOCATIONS:
            self.fresh += sum(self._size(t) > 0 for t in tree_leaves(out))
        if name in _NO_TRAFFIC:
            return out
        moved = 0
        written_args = False
        bound = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
        for argument in func._schema.arguments:
            value = bound.get(argument.name)
            writes = argument.alias_info is not None and argument.alias_info.is_write
            if writes:
                written_args = True
                # An in-place op reads its self as well; an out= argument is only written.
                reads = not argument.kwarg_only and name not in _OVERWRITE
                moved += sum(self._size(t) for t in tree_leaves(value)) * (1 + reads)
            else:
                moved += sum(self._size(t) for t in tree_leaves(value))
        if not written_args:  # a functional op: its results are written, into fresh tensors
            moved += sum(self._size(t) for t in tree_leaves(out))
            self.fresh += sum(self._size(t) > 0 for t in tree_leaves(out))
        self.bytes += moved
        self.ops.append((name, moved))
        return out


def _activations(run, activation_bytes: int) -> tuple[float, int]:
    """The element passes of ``run``'s ATen ops, in activations, and the element-sized
    tensors they allocate."""
    with Traffic(CHANNELS) as traffic:
        run()
    return traffic.bytes / activation_bytes, traffic.fresh


# The plan, in activations, per element pass of the ops (y: the output, dy its gradient):
# - forward, training: the statistics read x once (var_mean: 1); the normalisation writes y
#   over x in sub, mul, add and leaky_relu (4 x read + write: 8). 9.
# - forward far from 0 (25 standard deviations here: over ``functional.FAR_MEAN``): those,
#   and the mean's residual (``torch_ops.residual_mean``): x - mean into a scratch buffer (2),
#   its sum (1). 12.
# - backward, training (one replica): dz and z rebuilt from y (leaky_relu's backward: read y,
#   dy, write dz: 3; its inverse: read y, write z: 2), ATen's fused BatchNorm backward (read
#   dz, z, write dx: 3). 8. The same where nothing holds the output after backward, z
#   rebuilt over it.
# - backward_reduce: dz and z (5), z - b (2), sum(dz) (1), (z - b) * dz (3), its sum (1). 12.
# - backward_dx with an xhat term in every channel (synchronised training): dz and z (5),
#   z - b, times coef, plus const (3 x 2), + coef_dz * dz written into dx (3). 14.
# - backward_dx with none (evaluation): dz and z (5), z - b (2), dz * coef_dz (2), + const
#   written into dx (2). 11.
# Larger than a slab, the statistics are taken around a shift (the first slab's mean: that
# slab's share of x), whose distance from 0 the first slab's norm estimates (another share):
# in one fused call reading x as its gradient and its input (2 instead of 1), where x suits
# it; else walked in slabs (the input far from 0 here), per slab x - shift (2), its sum (1),
# its square (3), that sum (1): 7 instead of 1.
PLAN = {"forward": 9, "forward, far from 0": 12, "training backward": 8,
        "training backward, output dropped": 8, "backward_reduce": 12,
        "backward_dx, xhat term": 14, "backward_dx, no xhat term": 11}
FUSED_STATISTICS = 2 - 1
SLAB_STATISTICS = 7 - 1
# The element-sized tensors each case allocates:
# - forward: none (y is x); far from 0, the residual's scratch; where the statistics walk
#   slabs, theirs too.
# - backward, training: dz, z and dx; where nothing holds the output, dz and dx (z is
#   rebuilt over y).
# - backward_reduce: the walk's three scratch buffers (one piece each; whole tensors on one
#   slab); backward_dx: dx and two of those (its centred term is written into dx's piece).
FRESH = {"forward": 0, "forward, far from 0": 1, "training backward": 3,
         "training backward, output dropped": 2, "backward_reduce": 3,
         "backward_dx, xhat term": 3, "backward_dx, no xhat term": 3}


@pytest.fixture(params=["whole", "slabs"])
def walk(request, monkeypatch):
    """The ATen path on one slab, or in slabs (``torch_ops._SLAB_ELEMENTS``)."""
    if request.param == "slabs":
        monkeypatch.setattr(torch_ops, "_SLAB_ELEMENTS", 300)
    encoding_syncbn.set_backend("torch")
    yield request.param
    encoding_syncbn.set_backend("auto")


def _measured(walk: str) -> dict[str, tuple[float, int]]:
    """Per case of the plan, ``(element passes, fresh element-sized tensors)``."""
    torch.manual_seed(0)
    x = torch.randn(SHAPE) * 2 + 0.5
    dy = torch.randn(SHAPE)
    size = x.numel() * x.element_size()
    layer = SyncBatchNorm(CHANNELS, activation="leaky_relu", slope=0.1)
    inner = x.clone().requires_grad_() * 1  # a non-leaf: the layer overwrites it
    outs = []
    found = {}
    found["forward"] = _activations(lambda: outs.append(layer(inner)), size)
    assert outs[0] is inner  # in place
    far = (x + 50).requires_grad_() * 1
    found["forward, far from 0"] = _activations(lambda: layer(far), size)
    # The layer's own backward node alone (not the gradients' accumulation into leaves).
    found["training backward"] = _activations(
        lambda: torch.autograd.grad(outs[0], [inner, layer.weight, layer.bias], dy), size)
    # An output that nothing holds once the next op has read it (clone's backward hands the
    # gradient on as it is); the parameters' gradients alone, so that the op making the
    # layer's input is not run backward.
    loss = layer(x.clone().requires_grad_() * 1).clone()
    found["training backward, output dropped"] = _activations(
        lambda: torch.autograd.grad(loss, [layer.weight, layer.bias], dy), size)

    params = NormParams(*(torch.randn(CHANNELS) for _ in range(2)), torch.rand(CHANNELS) + 0.5,
                        torch.randn(CHANNELS), "leaky_relu", 0.1)
    y = torch.empty_like(x)
    torch_ops.normalize_act(x, params, y)
    sums = torch_ops.backward_reduce(y, dy, params, True)
    found["backward_reduce"] = _activations(
        lambda: torch_ops.backward_reduce(y, dy, params, True), size)
    found["backward_dx, xhat term"] = _activations(
        lambda: torch_ops.backward_dx(y, dy, params, True, BatchSums(*sums, 1024)), size)
    zeros = torch.zeros(CHANNELS)
    found["backward_dx, no xhat term"] = _activations(
        lambda: torch_ops.backward_dx(y, dy, params, True, DxCoefs(params.weight, zeros, zeros)),
        size)
    return found


def _first_slab_share() -> float:
    """The first slab's elements, in activations (the statistics' shift is its mean)."""
    x = torch.empty(SHAPE)
    return torch_ops._pieces(torch_ops._as_rows(x))[0][0].numel() / x.numel()


def test_element_traffic_of_one_layer_is_the_plan(walk):
    """Forward, backward (an output held after it, and one nothing holds), and the two
    backward ops of the synchronised and evaluation paths: at most the plan's element passes
    (exactly, in these counts) and its allocations, on one slab and in slabs."""
    measured = _measured(walk)
    found = {what: passes for what, (passes, _) in measured.items()}
    fresh = {what: count for what, (_, count) in measured.items()}
    plan, plan_fresh = dict(PLAN), dict(FRESH)
    if walk == "slabs":
        plan["forward"] += FUSED_STATISTICS + 2 * _first_slab_share()
        plan["forward, far from 0"] += SLAB_STATISTICS + 2 * _first_slab_share()
        plan_fresh["forward, far from 0"] += 1
    for what, activations in found.items():
        assert activations <= plan[what] + 0.5, (what, activations, plan[what])
    assert found == pytest.approx(plan, abs=0.01), found
    assert fresh == plan_fresh


def test_an_extra_pass_is_counted(walk, monkeypatch):
    """The count is not blind to an element pass more (a masked select over dx's terms, as a
    regression once added): backward_dx with one more ``torch.where`` over its pieces."""
    plain_addcmul = torch.addcmul

    def addcmul_then_where(*args, **kwargs):
        term = plain_addcmul(*args, **kwargs)
        return torch.where(torch.zeros(term.shape[-1], dtype=torch.bool), term.new_zeros(()),
                           term, out=term)

    monkeypatch.setattr(torch_ops.torch, "addcmul", addcmul_then_where)
    passes, _ = _measured(walk)["backward_dx, xhat term"]
    assert passes >= PLAN["backward_dx, xhat term"] + 2
