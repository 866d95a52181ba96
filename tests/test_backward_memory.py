"""The backward's peak memory, counted: the most bytes of storages one layer's backward makes
alive at once (``benchmarks/helpers/peak_storage.py``), in units of the input's size.

Out of place the layer's backward keeps one input-sized temporary beside the gradient it
returns (dz; ATen's fused BatchNorm backward, or the backend's two passes, whose centred term
goes into dx's piece); in place, two (z and dz, rebuilt from the output). That holds where
the backward corrects its sums for the mean's rounding between its two passes (float64, and
float32 far from zero: ``functional._mean_offset``), which must not cost the whole-tensor
scratch buffers of a walk over one slab. The counts are exact: no timing.
"""

from __future__ import annotations

import torch
from backends import each_backend
from helpers.peak_storage import PeakStorage
from hypothesis import given, settings
from hypothesis import strategies as st

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.layer.inplace_policy import MIN_FLOAT64_REBUILT_COUNT
from encoding_syncbn.testing import SimulatedDataParallel

pytestmark = each_backend

# The input-sized temporaries beside the gradient (see the module docstring).
TEMPORARIES = {False: 1, True: 2}
# Per-channel vectors (the sums, the coefficients, their float64 and double-double steps,
# the Triton kernels' partial sums): a few dozen alive at once, each 1 / count of the input,
# with at least MIN_FLOAT64_REBUILT_COUNT values a channel.
VECTORS = 0.25


def _backward_peak(x: torch.Tensor, dy: torch.Tensor, activation: str, inplace: bool,
                   replicas: int) -> float:
    """The most bytes of storages that one training step's backward of the layer (on
    ``replicas`` simulated DataParallel replicas) makes alive at once, the input gradient
    included, over the input's bytes."""
    layer = SyncBatchNorm(x.shape[1], activation=activation, inplace=inplace, dtype=x.dtype)
    model = SimulatedDataParallel(layer, replicas) if replicas > 1 else layer
    leaf = x.clone().requires_grad_()
    # A non-leaf the in-place layer may write over; clone's backward hands the gradient on
    # as it is, so that only the layer's backward (and the replicas' gather) allocates.
    h = leaf.clone()
    out = model(h)
    peak = PeakStorage(h, out, dy)
    with peak:
        (grad,) = torch.autograd.grad(out, leaf, dy)
    assert torch.isfinite(grad).all()
    return peak.peak / (x.numel() * x.element_size())


@settings(max_examples=10, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(["float64", "float64 far from zero", "float32 far from zero"]),
    activation=st.sampled_from(["leaky_relu", "elu", "identity"]),
    inplace=st.booleans(),
    replicas=st.integers(1, 2),
    channels=st.integers(1, 6),
    spatial=st.sampled_from([(8, 8), (5, 7), (16,)]),
    channels_last=st.booleans(),
    data=st.data(),
)
def test_backward_keeps_at_most_its_planned_temporaries(kind, activation, inplace, replicas,
                                                        channels, spatial, channels_last,
                                                        data):
    """One layer's backward, float64 near and far from zero and float32 far from zero (the
    calls whose sums are corrected for the mean's rounding), in place and out of place, on
    one or two replicas: the gradient and ``TEMPORARIES`` input-sized tensors at most, and
    the per-channel vectors' share."""
    area = 1
    for side in spatial:
        area *= side
    samples = data.draw(st.integers(-(-MIN_FLOAT64_REBUILT_COUNT // area) * replicas,
                                    -(-4 * MIN_FLOAT64_REBUILT_COUNT // area) * replicas),
                        label="samples")
    dtype = torch.float32 if kind.startswith("float32") else torch.float64
    gen = torch.Generator().manual_seed(data.draw(st.integers(0, 2**16), label="seed"))
    shape = (samples, channels, *spatial)
    centre = 10.0 ** data.draw(st.floats(1.5, 4.0), label="decades") if "far" in kind else 0.5
    x = (torch.randn(shape, generator=gen, dtype=torch.float64) + centre).to(dtype)
    dy = torch.randn(shape, generator=gen, dtype=dtype)
    if channels_last and len(spatial) == 2:
        x = x.contiguous(memory_format=torch.channels_last)
        dy = dy.contiguous(memory_format=torch.channels_last)
    peak = _backward_peak(x, dy, activation, inplace, replicas)
    # ELU's derivative keeps a mask of its NaN inputs (``activations._elu_derivative``).
    mask = 1 / x.element_size() if activation == "elu" else 0
    planned = 1 + TEMPORARIES[inplace] + mask
    assert peak <= planned + VECTORS, (
        f"{kind} {activation} inplace={inplace} x{replicas} {tuple(x.shape)}: the backward "
        f"peaked at {peak:.2f} input sizes, planned {planned:.3g} and per-channel vectors")
