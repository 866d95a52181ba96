"""How much precision in-place ELU loses near saturation (the README's known limit).

    python benchmarks/elu_saturation.py [--record]

An in-place ``SyncBatchNorm(activation="elu")`` keeps only y = elu(z) and rebuilds
z = log1p(y / alpha) in backward; as y -> -alpha that inverse amplifies y's rounding by
exp(-z), which the |beta| / |gamma| limit on the channels it rebuilds does not see. The input:
4 channels of 4096 values, ``randn * 8``, gamma 6, beta -3 (a channel the layer rebuilds), so
that z = 6 xhat - 3 reaches deep into saturation (down to about -27). Per dtype, the largest
error of the input gradient, relative to the largest |input gradient|, against BatchNorm + ELU
in long double (``helpers.rebuild_error.exact_input_gradient``): the in-place layer's, the
out-of-place one's, and ``nn.BatchNorm2d`` + ``F.elu``'s in that dtype. (In float16 and
bfloat16 an in-place ELU layer runs out of place: the two agree.)
"""

from __future__ import annotations

import argparse

import numpy as np
import torch
import torch.nn.functional as F
from helpers import results
from helpers.rebuild_error import EPS, exact_input_gradient
from torch import nn

from encoding_syncbn import SyncBatchNorm

GAMMA, BETA = 6.0, -3.0


def input_grad(layer: nn.Module, x: torch.Tensor, dy: torch.Tensor, plain: bool) -> np.ndarray:
    leaf = x.clone().requires_grad_()
    out = layer(leaf * 1)
    if plain:
        out = F.elu(out, 1.0)
    out.backward(dy)
    return leaf.grad.double().numpy().astype(np.longdouble)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    results.add_arguments(parser)
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 4, 8, 8, generator=gen, dtype=torch.float64) * 8
    dy = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    gamma, beta = torch.full((4,), GAMMA), torch.full((4,), BETA)
    rows = []
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        xd, dyd = x.to(dtype), dy.to(dtype)
        # On the values this dtype's layers see.
        exact, _ = exact_input_gradient(xd, dyd, gamma, beta, "elu", 1.0)
        size = np.abs(exact).max()
        errors = []
        for inplace in (True, False, None):  # None: nn.BatchNorm2d + F.elu
            layer = (nn.BatchNorm2d(4, eps=EPS, dtype=dtype) if inplace is None else
                     SyncBatchNorm(4, eps=EPS, activation="elu", slope=1.0, inplace=inplace,
                                   dtype=dtype))
            with torch.no_grad():
                layer.weight.fill_(GAMMA)
                layer.bias.fill_(BETA)
            got = input_grad(layer, xd, dyd, plain=inplace is None)
            errors.append(float(np.abs(got - exact).max() / size))
        rows.append([str(dtype).removeprefix("torch."), *(f"{e:.2g}" for e in errors)])
    table = results.markdown_table(
        ["dtype", "dx error in place", "dx error out of place", "dx error nn.BatchNorm2d"], rows)
    notes = (f"One training step of SyncBatchNorm(4, activation='elu'), gamma {GAMMA:g}, beta "
             f"{BETA:g}, input (64, 4, 8, 8) of randn * 8 (z down to about -27); the largest "
             "input-gradient error relative to the largest |dx|, against long double.")
    print(notes + "\n\n" + table)
    results.record(args, "elu_saturation.py", table, notes)


if __name__ == "__main__":
    main()
