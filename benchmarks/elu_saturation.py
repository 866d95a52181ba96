"""How much precision in-place ELU loses near saturation (the README's known limit).

    python benchmarks/elu_saturation.py

An in-place ``SyncBatchNorm(activation="elu")`` keeps only y = elu(z) and rebuilds
z = log1p(y / alpha) in backward; as y -> -alpha that inverse amplifies y's rounding. The
input: 4 channels of 4096 values, ``randn * 8``, gamma 6, beta -8, so that z = 6 xhat - 8
reaches deep into saturation (down to about -30). Prints, per dtype, the largest error of
the input gradient of the in-place layer and of the out-of-place one against float64
``nn.BatchNorm2d`` + ``F.elu``, and the largest |input gradient|. (In float16 and bfloat16 an
in-place ELU layer runs out of place: the two agree.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

from encoding_syncbn import SyncBatchNorm


def input_grad(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, plain: bool) -> torch.Tensor:
    leaf = x.clone().requires_grad_()
    out = layer(leaf * 1)
    if plain:
        out = F.elu(out, 1.0)
    out.backward(dy)
    return leaf.grad.double()


def main() -> None:
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 8, 8, generator=gen, dtype=torch.float64) * 8
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    reference = nn.BatchNorm2d(4, dtype=torch.float64)
    with torch.no_grad():
        reference.weight.fill_(6.0)
        reference.bias.fill_(-8.0)
    expected = input_grad(reference, x, dy, plain=True)
    for dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        errors = {}
        for inplace in (True, False):
            layer = SyncBatchNorm(4, activation="elu", slope=1.0, inplace=inplace, dtype=dtype)
            layer.load_state_dict(reference.state_dict())
            got = input_grad(layer, x.to(dtype), dy.to(dtype), plain=False)
            errors[inplace] = (got - expected).abs().max().item()
        print(f"{str(dtype):14s} in place: max |dx error| {errors[True]:.3g}   "
              f"out of place: {errors[False]:.3g}   max |dx| {expected.abs().max().item():.3g}")


if __name__ == "__main__":
    main()
