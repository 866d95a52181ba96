"""What the double-double input gradient costs a float64 training call over few values a channel.

    python benchmarks/float64_few_values_cost.py [--turns 30] [--record]

Below ``inplace_policy.MIN_FLOAT64_REBUILT_COUNT`` values a channel (the whole synchronised
batch) a float64 call trains out of place and takes its input gradient in double-double
(``kernels/double_double.py``, ``layer/whole_batch.py``). For each shape, an in-place
``SyncBatchNorm(C, activation="leaky_relu")`` step (forward, then backward of the input
gradient) three ways, taking turns:

- ``double-double``: the layer as shipped;
- ``float64``: the same layer with the double-double gradient switched off at those counts
  (``inplace_policy.takes_double_double_gradient`` answering as below
  ``MIN_OWN_PRECISION_COUNT`` only): float64's own arithmetic, out of place;
- ``nn.BatchNorm2d``: ``nn.BatchNorm2d(C)`` + ``nn.LeakyReLU``, the layer a user replaces.

Per variant: the step's milliseconds (median [first, third quartile] over the turns; one
replica, or ``--replicas`` simulated DataParallel replicas), and the backward's peak memory:
the most bytes of storages that the backward made alive at once (its temporaries and the
gradient; counted exactly by a dispatch mode tracking each new storage until it is freed,
one replica, whatever the allocator caches), over the input's bytes.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import time

from helpers import results

SHAPES = ((38, 256, 1, 1), (64, 256, 1, 1), (111, 256, 1, 1), (2, 2048, 7, 7))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--turns", type=int, default=30,
                        help="timed turns of each variant (default: %(default)s)")
    parser.add_argument("--replicas", type=int, default=2,
                        help="simulated DataParallel replicas of the second timing "
                             "(default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default: %(default)s)")
    results.add_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    import torch
    from helpers.peak_storage import PeakStorage
    from helpers.timing import median_iqr, take_turns
    from torch import nn

    from encoding_syncbn import SyncBatchNorm
    from encoding_syncbn.layer import inplace_policy
    from encoding_syncbn.testing import SimulatedDataParallel

    torch.set_num_threads(args.threads)
    shipped = inplace_policy.takes_double_double_gradient

    def own_arithmetic(dtype: torch.dtype, count: int, inplace: bool) -> bool:
        return shipped(dtype, count, inplace) and count < inplace_policy.MIN_OWN_PRECISION_COUNT

    def model(variant: str, channels: int, replicas: int) -> nn.Module:
        if variant == "nn.BatchNorm2d":
            net = nn.Sequential(nn.BatchNorm2d(channels, dtype=torch.float64),
                                nn.LeakyReLU(0.01))
        else:
            net = SyncBatchNorm(channels, activation="leaky_relu", dtype=torch.float64)
        return SimulatedDataParallel(net, replicas) if replicas > 1 else net

    def step(variant: str, net: nn.Module, x: torch.Tensor, dy: torch.Tensor,
             peak: PeakStorage | None = None) -> tuple[float]:
        """Seconds of one training step of ``variant``; ``peak``: its backward counted."""
        inplace_policy.takes_double_double_gradient = (
            own_arithmetic if variant == "float64" else shipped)
        try:
            started = time.perf_counter()
            out = net(x.clone().requires_grad_() * 1)
            with peak or contextlib.nullcontext():
                out.backward(dy)
            return (time.perf_counter() - started,)
        finally:
            inplace_policy.takes_double_double_gradient = shipped

    variants = ("double-double", "float64", "nn.BatchNorm2d")
    rows = []
    gen = torch.Generator().manual_seed(0)
    for shape in SHAPES:
        count = shape[0] * shape[2] * shape[3]
        x = torch.randn(shape, generator=gen, dtype=torch.float64) * 2 + 0.5
        dy = torch.randn(shape, generator=gen, dtype=torch.float64)
        row = [f"{tuple(shape)}: {count}"]
        for replicas in (1, args.replicas):
            nets = {v: model(v, shape[1], replicas) for v in variants}
            measured = take_turns(
                {v: functools.partial(step, v, nets[v], x, dy) for v in variants}, args.turns)
            for v in variants:
                row.append(median_iqr([1e3 * m[0] for m in measured[v]], 2))
        for v in variants:
            peak = PeakStorage()
            step(v, model(v, shape[1], 1), x, dy, peak)
            row.append(f"{peak.peak / (x.numel() * x.element_size()):.1f}")
        rows.append(row)
        print(row, flush=True)
    header = (["shape: values a channel"]
              + [f"{v} ms" for v in variants]
              + [f"{v} ms x{args.replicas}" for v in variants]
              + [f"{v} backward peak / input" for v in variants])
    table = results.markdown_table(header, rows)
    notes = ("A float64 training step (forward + input gradient) of an in-place "
             "SyncBatchNorm(C, activation='leaky_relu') below MIN_FLOAT64_REBUILT_COUNT values "
             "a channel (out of place there), as shipped (double-double input gradient) and "
             "with float64's own arithmetic, against nn.BatchNorm2d + nn.LeakyReLU; "
             f"milliseconds, median [quartiles] over {args.turns} turns, one replica and "
             f"{args.replicas} simulated DataParallel replicas; the backward's peak bytes of "
             f"live storages it made, over the input's bytes (one replica). "
             f"{args.threads} intra-op thread(s).")
    print(notes + "\n\n" + table)
    results.record(args, "float64_few_values_cost.py (cpu)", table, notes)


if __name__ == "__main__":
    main()
