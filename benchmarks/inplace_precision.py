"""What in place costs in precision, per dtype: the gradients of an in-place layer against
nn.BatchNorm2d + the activation in the same dtype, both against float64.

    python benchmarks/inplace_precision.py [--spread S] [--record]

In place, backward rebuilds the input from the output (xhat = (z - beta) / gamma), which
multiplies the output's rounding by up to |beta| / |gamma|; the layer keeps aside the channels
where its dtype cannot afford that (``encoding_syncbn.layer.inplace_policy``). Per dtype
(float64, float32, and float16 / bfloat16 under ``torch.autocast`` with float32 parameters) and
per |beta| / |gamma| (gamma 1, beta of either sign), one training step of ``SyncBatchNorm(8,
activation="leaky_relu")`` on a (16, 8, 8, 8) input. An error is per channel, relative to the
gradient's size there (dx: its largest |value|; dw = sum(dz * xhat): the root of the sum of
its squared terms), the largest over the channels.

``--spread``: the input's standard deviation, its mean half that (default 2). Below about
sqrt(eps) = 0.003 (a near-constant channel: xhat's spread s = sqrt(var / (var + eps)) well
under 1) the output y = gamma * xhat + beta carries xhat in its low digits, and a channel
rebuilt would lose it in dw: the layer keeps aside the channels where |beta| / (|gamma| * s)
exceeds the limit, which this run shows.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from helpers import results
from torch import nn

RATIOS = (0.0, 0.75, 3.0, 10.0, 50.0, 900.0)
DTYPES = ("float64", "float32", "bfloat16", "float16")
SHAPE = (16, 8, 8, 8)
SLOPE = 0.1


def gradients(norm: nn.Module, x: torch.Tensor, dy: torch.Tensor, autocast: bool
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """dx and dw of ``norm`` (+ leaky_relu where it fuses none) on ``x``."""
    leaf = x.clone().requires_grad_()
    with torch.autocast("cpu", dtype=x.dtype, enabled=autocast):
        out = norm(leaf * 1)
        if isinstance(norm, nn.BatchNorm2d):
            out = F.leaky_relu(out, SLOPE)
    out.backward(dy)
    return leaf.grad.double(), norm.weight.grad.double()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spread", type=float, default=2.0,
                        help="the input's standard deviation (default: 2)")
    results.add_arguments(parser)
    args = parser.parse_args()
    from encoding_syncbn import SyncBatchNorm
    from encoding_syncbn.kernels import variance_spread
    from encoding_syncbn.layer.inplace_policy import gamma_limit, small_gamma_mask

    gen = torch.Generator().manual_seed(0)
    x64 = torch.randn(SHAPE, generator=gen, dtype=torch.float64) * args.spread + args.spread / 2
    dy64 = torch.randn(SHAPE, generator=gen, dtype=torch.float64)
    signs = torch.tensor([1.0, -1.0] * (SHAPE[1] // 2), dtype=torch.float64)
    rows = []
    for name in DTYPES:
        dtype = getattr(torch, name)
        autocast = dtype in (torch.float16, torch.bfloat16)
        params = torch.float32 if autocast else dtype
        x, dy = x64.to(dtype), dy64.to(dtype)
        for ratio in RATIOS:
            gamma, beta = torch.ones(SHAPE[1]), ratio * signs
            norms = {}
            for key, norm in (("reference", nn.BatchNorm2d(SHAPE[1], dtype=torch.float64)),
                              ("torch", nn.BatchNorm2d(SHAPE[1], dtype=params)),
                              ("ours", SyncBatchNorm(SHAPE[1], activation="leaky_relu",
                                                     slope=SLOPE, dtype=params))):
                with torch.no_grad():
                    norm.weight.copy_(gamma)
                    norm.bias.copy_(beta)
                norms[key] = norm
            # The reference on the very values the half-precision layers see.
            leaf = x.double().clone().requires_grad_()
            z = norms["reference"](leaf)
            z.retain_grad()
            F.leaky_relu(z, SLOPE).backward(dy.double())
            xhat = F.batch_norm(x.double(), None, None, training=True)
            dims = [0, 2, 3]
            sizes = (leaf.grad.abs().amax(dims), (z.grad * xhat).square().sum(dims).sqrt())
            want = (leaf.grad, norms["reference"].weight.grad)

            def error(got, want=want, sizes=sizes, dims=dims):
                dx = ((got[0] - want[0]).abs().amax(dims) / sizes[0]).max().item()
                dw = ((got[1] - want[1]).abs() / sizes[1]).max().item()
                return dx, dw

            ours = error(gradients(norms["ours"], x, dy, autocast))
            theirs = error(gradients(norms["torch"], x, dy, autocast))
            # As this single-replica layer chooses them: the limit with its margin, against
            # the batch's spread.
            var = x.double().var(dims, correction=0)
            spread = variance_spread(var, 1e-5)
            kept = int(small_gamma_mask(gamma.double(), beta, gamma_limit(True), spread).sum())
            rows.append([name + (" (autocast)" if autocast else ""), f"{ratio:g}",
                         f"{kept} / {SHAPE[1]}", f"{ours[1]:.2g}", f"{theirs[1]:.2g}",
                         f"{ours[0]:.2g}", f"{theirs[0]:.2g}"])
    table = results.markdown_table(
        ["dtype", "abs(beta) / abs(gamma)", "channels kept aside", "dw error in place",
         "dw error nn.BatchNorm2d", "dx error in place", "dx error nn.BatchNorm2d"], rows)
    notes = ("One training step of SyncBatchNorm(8, activation='leaky_relu', slope=0.1), in "
             f"place, input {SHAPE} of std {args.spread:g} (eps 1e-5), gamma 1, beta +-ratio; "
             "errors against float64 "
             "nn.BatchNorm2d + F.leaky_relu, per channel relative to the gradient's size "
             "there (dx: its largest |value|; dw: the root of the sum of its squared terms), "
             "the largest over the channels; nn.BatchNorm2d + F.leaky_relu in the same dtype "
             "beside. Half precision: under torch.autocast, float32 parameters.")
    print(notes + "\n\n" + table)
    heading = "inplace_precision.py" + (f" --spread {args.spread:g}" if args.spread != 2 else "")
    results.record(args, heading, table, notes)


if __name__ == "__main__":
    main()
