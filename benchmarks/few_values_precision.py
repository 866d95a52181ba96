"""How far an in-place layer's input gradient is from the README's bound, by the count of values
a channel and |beta| / |gamma|, in float32 and float64.

    python benchmarks/few_values_precision.py [--rule off | --inplace off] [--backend triton]
        [--mean-over-std M] [--dy-along-xhat NOISE] [--compile inductor] [--record]

The bound (README, Limits): per channel, dx's error <= 3 max(nn.BatchNorm2d + the activation's
error in the same dtype, half an ulp of the channel's largest |dx|, tau A), errors against an
exact (long double) reference, A the size of dx's xhat term and tau nn.BatchNorm2d's largest
error relative to max(|dx|, A) over the layer's channels (helpers/rebuild_error.py's
``allowed_errors``). In place, backward rebuilds the input from
the rounded output, an error of up to half an ulp times |xhat| + |beta| / |gamma|, which few
values a channel do not average out.

Each cell: ``--trials`` generated layers of ``--channels`` channels, each layer with its own
activation (identity, leaky_relu, elu), replica count (1 to 4 simulated DataParallel replicas,
at most the batch), gammas (|gamma| log-uniform in [0.1, 10], either sign) and data; beta is
|beta| / |gamma| times |gamma|, either sign (ELU: |gamma| up to 1 and beta >= 0, keeping z
above about -4; its deep saturation is a limit of its own, README). A cell gives the largest
ratio of error to bound over its channels, and in brackets how many of them are over 1 (of the
cell's ``--trials`` times ``--channels``: a rare exceedance shows, however many channels).
``--rule off`` rebuilds every channel at every count (the layer's policy switched off: no
count rule, every channel with |gamma| > 1e-3 max(1, |beta|) rebuilt; a call over fewer than
``MIN_OWN_PRECISION_COUNT`` values still computes in float64); ``on``: the layer as shipped.
``--inplace off``: the layer with ``inplace=False``, for the error of its arithmetic alone.
``--mean-over-std``: each channel's mean over its standard deviation (0.25 by default): a
rounded mean shifts every normalised value of its channel alike, by its error over the
standard deviation, which grows with this ratio. Elements whose z lies within its rounding of
the activation's kink are moved off it first (helpers/rebuild_error.py's ``off_kink``: there
the slope is a draw of the roundings, nn.BatchNorm2d's too). ``--dy-along-xhat``: output
gradients ``xhat + NOISE * N(0, 1)`` (as a squared loss on the layer's output gives) instead of
``N(0, 1)``: the exact input gradient is then a difference of terms about 1 / NOISE times its
size, whose roundings the bound allows for through ``tau A`` (README, Limits).
``--compile``: the layer under ``torch.compile`` (its formula in ATen ops), measured at its
second call, on one replica.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # the Triton backend on a CPU: its interpreter

import torch  # noqa: E402
from helpers import results  # noqa: E402

COUNTS = (3, 4, 6, 8, 12, 16, 23, 32, 64, 256, 1024, 4096)
RATIOS = (0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 62.0, 250.0, 900.0)
ACTIVATIONS = ("identity", "leaky_relu", "elu")
SLOPES = {"leaky_relu": 0.1, "elu": 0.7}


def shape_for(count: int, channels: int) -> tuple[int, ...]:
    """An input of ``count`` values a channel: (N, C, 1, 1) up to 64, then 4x4 images."""
    return (count, channels, 1, 1) if count <= 64 else (count // 16, channels, 4, 4)


def switch_rule_off() -> None:
    """Rebuild every channel whatever the count, and every channel of |gamma| > 1e-3 max(1,
    |beta|) (no margin)."""
    from encoding_syncbn.layer import inplace_policy

    inplace_policy.rebuilds_from_count = lambda count, dtype: True
    inplace_policy.gamma_limit = lambda with_margin=False: 1e-3


def cell(dtype: torch.dtype, count: int, ratio: float, args: argparse.Namespace,
         gen: torch.Generator) -> tuple[float, int]:
    """The largest ratio to the bound over the cell's channels, and how many are over 1."""
    from helpers.rebuild_error import off_kink, ratios_to_bound

    worst, over = 0.0, 0
    shape = shape_for(count, args.channels)
    for _ in range(args.trials):
        pick = torch.randint(0, 1 << 30, (2,), generator=gen).tolist()
        activation = ACTIVATIONS[pick[0] % len(ACTIVATIONS)]
        # Compiled, a synchronised call runs the eager layer (``modules.COMPILE_AS_FORMULA``).
        replicas = 1 if args.compile else 1 + pick[1] % min(4, shape[0])
        # ELU's inverse amplifies the output's rounding by exp(-z): kept to z >= -1 - 3|gamma|
        # (its deep saturation is a limit of its own, README).
        largest, beta_sign = (1.0, 1.0) if activation == "elu" else (10.0, None)
        size = torch.empty(args.channels).uniform_(math.log(0.1), math.log(largest),
                                                   generator=gen).exp()
        gamma = size * torch.randn(args.channels, generator=gen).sign()
        signs = torch.randn(args.channels, generator=gen).sign()
        beta = ratio * size * (signs.abs() if beta_sign else signs)
        x = ((torch.randn(shape, generator=gen, dtype=torch.float64) + args.mean_over_std)
             * 2).to(dtype)
        dy = torch.randn(shape, generator=gen, dtype=torch.float64)
        if args.dy_along_xhat is not None:
            wide = x.double()
            dims = [0, 2, 3]
            xhat = (wide - wide.mean(dims, keepdim=True)) / wide.std(dims, keepdim=True)
            dy = xhat + args.dy_along_xhat * dy
        dy = dy.to(dtype)
        x = off_kink(x, gamma.to(dtype), beta.to(dtype), activation)
        ratios, _ = ratios_to_bound(x, dy, gamma, beta, activation,
                                    SLOPES.get(activation, 0.01), replicas,
                                    args.inplace == "on", args.compile)
        worst = max(worst, float(ratios.max()))
        over += int((ratios > 1).sum())
    return worst, over


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rule", choices=("on", "off"), default="on")
    parser.add_argument("--inplace", choices=("on", "off"), default="on")
    parser.add_argument("--backend", choices=("torch", "triton"), default="torch")
    parser.add_argument("--dtypes", nargs="+", default=["float32", "float64"])
    parser.add_argument("--counts", nargs="+", type=int, default=list(COUNTS))
    parser.add_argument("--ratios", nargs="+", type=float, default=list(RATIOS))
    parser.add_argument("--trials", type=int, default=4)
    parser.add_argument("--channels", type=int, default=32)
    parser.add_argument("--mean-over-std", type=float, default=0.25)
    parser.add_argument("--dy-along-xhat", type=float, metavar="NOISE",
                        help="output gradients xhat + NOISE * N(0, 1) (default: N(0, 1))")
    parser.add_argument("--compile", metavar="BACKEND",
                        help="run the layer under torch.compile with this backend (inductor, "
                             "aot_eager), one replica")
    results.add_arguments(parser)
    args = parser.parse_args()
    import encoding_syncbn

    encoding_syncbn.set_backend(args.backend)
    if args.rule == "off":
        switch_rule_off()
    gen = torch.Generator().manual_seed(0)
    tables = []
    for name in args.dtypes:
        dtype = getattr(torch, name)
        rows = []
        for count in args.counts:
            row = [str(count)]
            for ratio in args.ratios:
                worst, over = cell(dtype, count, ratio, args, gen)
                row.append(f"{worst:.3g}" + (f" ({over})" if over else ""))
            rows.append(row)
            print(name, row, flush=True)
        tables.append(f"{name}, {args.backend} backend:\n\n" +
                      results.markdown_table(
                          ["values a channel"] + [f"b/g {r:g}" for r in args.ratios], rows))
    table = "\n\n".join(tables)
    notes = (f"In-place dx error over the README's bound (3 max(nn.BatchNorm2d's error, half an "
             f"ulp of the channel's largest |dx|, tau A: A the size of dx's xhat term, tau "
             f"nn.BatchNorm2d's largest error relative to max(|dx|, A) over the layer's "
             f"channels)), against a long-double reference; per cell "
             f"the largest over {args.trials} generated layers of {args.channels} channels "
             f"(activation, {'1 replica' if args.compile else '1-4 replicas'}, "
             f"|gamma| in [0.1, 10] (ELU: [0.1, 1], beta >= 0), "
             f"data drawn, mean / std {args.mean_over_std:g}"
             + ("" if args.dy_along_xhat is None else
                f", dy = xhat + {args.dy_along_xhat:g} N(0, 1)")
             + f"), in brackets how many of the cell's {args.trials * args.channels} "
             "channels are over 1; columns |beta| / |gamma|. "
             + (f"In place, rule {args.rule}." if args.inplace == "on" else "inplace=False.")
             + (f" Under torch.compile(backend={args.compile!r})." if args.compile else ""))
    print(notes + "\n\n" + table)
    variant = f"rule {args.rule}" if args.inplace == "on" else "inplace=False"
    if args.compile:
        variant += f", compiled by {args.compile}"
    if args.dy_along_xhat is not None:
        variant += f", dy along xhat (noise {args.dy_along_xhat:g})"
    results.record(args, f"few_values_precision.py ({args.backend}, {variant})", table, notes)


if __name__ == "__main__":
    main()
