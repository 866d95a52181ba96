"""How fast a DataParallel call fails when one replica fails (docs/failures.md).

    python benchmarks/failure_latency.py

Four simulated replicas, ENCODING_SYNCBN_TIMEOUT=60 s, two sync layers. "inside": one replica
gets a chunk with the wrong channel count, so it raises inside the first sync layer. "between":
one replica raises in user code between the two sync layers, after it joined. Prints the time
from the call to the exception reaching the caller, median and worst of ``--tries`` tries
(``--record``: the table into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import os
import time

import torch
from helpers import results
from torch import nn

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.testing import SimulatedDataParallel

MARK = 1234.0


class FailsInside(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = SyncBatchNorm(4), SyncBatchNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if (x[:, 0, 0] == MARK).any():
            x = x[:, :3]  # this replica's chunk reaches the layer with 3 channels, not 4
        return self.second(self.first(x))


class FailsBetween(FailsInside):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.first(x)
        if x.shape[0] == 3:  # the replica with the short last chunk
            raise RuntimeError("user code failed between two sync layers")
        return self.second(x)


def latency(model: nn.Module, x: torch.Tensor, tries: int = 5) -> tuple[str, list[float]]:
    seconds, error = [], ""
    for _ in range(tries):
        start = time.perf_counter()
        try:
            SimulatedDataParallel(model, 4)(x)
        except Exception as failure:  # the point: which one arrives, and when
            error = type(failure).__name__
        seconds.append(time.perf_counter() - start)
    return error, sorted(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tries", type=int, default=5,
                        help="failing calls per case (default: %(default)s)")
    results.add_arguments(parser)
    args = parser.parse_args()
    os.environ["ENCODING_SYNCBN_TIMEOUT"] = "60"
    inside = torch.randn(10, 4, 3)  # chunks of 3, 3, 3, 1 rows
    inside[6, 0, 0] = MARK  # in the third chunk
    between = torch.randn(15, 4, 3)  # chunks of 4, 4, 4, 3 rows: the last one raises
    rows = []
    for name, model, x in (("inside a sync layer", FailsInside(), inside),
                           ("between two sync layers", FailsBetween(), between)):
        error, seconds = latency(model, x, args.tries)
        print(f"a replica fails {name}: the call raises {error} after "
              f"{seconds[len(seconds) // 2] * 1e3:.0f} ms (median), {seconds[-1] * 1e3:.0f} ms "
              f"(worst of {len(seconds)})")
        rows.append([f"a replica fails {name}", error, round(seconds[len(seconds) // 2] * 1e3),
                     round(seconds[-1] * 1e3)])
    table = results.markdown_table(
        ["what happens", "the call raises", "after ms (median)", "ms (worst)"], rows)
    results.record(args, "failure_latency.py (cpu)", table,
                   f"4 simulated replicas, ENCODING_SYNCBN_TIMEOUT=60 s, two sync layers: the "
                   f"time from the call to the exception reaching the caller, {args.tries} tries.")


if __name__ == "__main__":
    main()
