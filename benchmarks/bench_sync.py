"""What a synchronised layer call costs with k replicas, against the same call unsynchronised.

    python benchmarks/bench_sync.py                    # 4 simulated replicas, CPU

k replicas are k threads (``encoding_syncbn.testing.SimulatedDataParallel``: stock
nn.DataParallel's semantics on the CPU) calling one layer ``--calls`` times in a row on a tiny
input (2 samples per replica, 8 channels, 2x2), forward then backward, so that the layer's own
arithmetic is negligible and what is left is the fixed cost of a call. Per layer call, in
microseconds, each row saying what it is relative to:

1. what a user pays for a synchronised call: ``SyncBatchNorm(8, activation="leaky_relu")``
   under k replicas (absolute);
2. the same layer with ``sync=False`` under the same k replicas (absolute);
3. the layer a user replaces, ``nn.BatchNorm2d(8)`` + ``nn.LeakyReLU(inplace=True)``, under
   the same k replicas (absolute);
4. the synchronised layer on 1 replica (absolute: the cost of a call with nothing to meet);
5. the synchronisation's cost as a user sees it: (1) minus (2), and (1) minus (3);
6. the synchronisation's own work, without threads: the same k replicas' layer calls run one
   after the other in one thread (every replica's statistics, the master's merge, every
   replica's normalisation), minus k unsynchronised calls in one thread.

And where the difference between (5) and (6) goes: one meeting of k threads that do nothing
else (this package's protocol, and ``threading.Barrier``), and 30 tiny ATen calls in each of
1 and of k threads (each ATen call releases the GIL: a hand-off between threads).

In a round the variants take turns, ``--turns`` times, and the round's figure is the median
over its turns; there are ``--rounds`` rounds, because the threads' scheduling drifts over
tens of seconds. Each figure shown is the median round [min, max over the rounds]. Prints the
tables (``--record``: into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable

from helpers import results

# torch, encoding_syncbn and the timing helpers are imported inside the functions, after the
# flags are read, so that --help needs no torch.


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=int, default=4,
                        help="simulated replicas k (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=50,
                        help="layer calls per forward (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=40,
                        help="turns of each variant per round (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=5,
                        help="rounds; the median round is shown (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads (default: %(default)s)")
    results.add_arguments(parser)
    return parser.parse_args()


PerCall = dict[str, tuple[float, float]]  # variant: (forward, backward) microseconds per call


def _per_call_medians(losses: dict[str, Callable], calls: int, turns: int) -> PerCall:
    """Median microseconds per layer call, ``(forward, backward)``, of each variant's
    ``loss()`` (a forward through ``calls`` layer calls) and its backward, in turns."""
    from helpers.timing import forward_backward, take_turns

    measured = take_turns({name: lambda loss=loss: forward_backward(loss)
                           for name, loss in losses.items()}, turns)
    return {name: (statistics.median(f for f, _ in values) / calls * 1e6,
                   statistics.median(b for _, b in values) / calls * 1e6)
            for name, values in measured.items()}


def threaded_calls_us(replicas: int, calls: int, turns: int) -> PerCall:
    """Rows 1-4: the layers under ``replicas`` simulated replicas, and the synchronised one
    under 1 replica."""
    import torch
    from torch import nn

    from encoding_syncbn import SyncBatchNorm
    from encoding_syncbn.testing import SimulatedDataParallel

    class Repeat(nn.Module):
        """One layer called ``calls`` times in a row, a multiplication between calls."""

        def __init__(self, layer: nn.Module) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for _ in range(calls):
                x = self.layer(x * 1)
            return x

    def loss(layer: nn.Module, count: int) -> Callable[[], torch.Tensor]:
        net = SimulatedDataParallel(Repeat(layer), count)
        return lambda: net(torch.randn(2 * count, 8, 2, 2)).sum()

    def sync(enabled: bool) -> nn.Module:
        return SyncBatchNorm(8, activation="leaky_relu", slope=0.01, sync=enabled)

    plain = nn.Sequential(nn.BatchNorm2d(8), nn.LeakyReLU(0.01, inplace=True))
    return _per_call_medians({"sync": loss(sync(True), replicas),
                              "sync=False": loss(sync(False), replicas),
                              "bn": loss(plain, replicas),
                              "1 replica": loss(sync(True), 1)}, calls, turns)


def one_thread_work_us(replicas: int, calls: int, turns: int) -> PerCall:
    """Row 6: what ``replicas`` replicas compute, all in one thread: the synchronised path's
    steps in the order the replica threads run them (``"sync"``), and the unsynchronised
    ``BatchNormAct`` once per replica (``"sync=False"``). Each replica holds the small-gamma
    channels ``replicate()`` reads once a step and hands it, as the layer's replicas do."""
    import torch

    from encoding_syncbn.activations import ActConfig
    from encoding_syncbn.layer.functional import (
            NormAct,
        batch_norm_act,
        merge_replicas,
        replica_stats,
    )
    from encoding_syncbn.layer.inplace_policy import ChannelsAside

    weight = torch.ones(8, requires_grad=True)
    bias = torch.zeros(8, requires_grad=True)
    config = ActConfig("leaky_relu", 0.01, inplace=True)

    def synced(xs: list[torch.Tensor], gammas: list[ChannelsAside]) -> list[torch.Tensor]:
        kept = [gamma.index(weight, bias) for gamma in gammas]
        contributions = [replica_stats(x) for x in xs]
        mean, _, invstd, _ = merge_replicas(contributions, 1e-5)
        return [NormAct.apply(c.x, mean, invstd, weight, bias, config, c.link, k)
                for c, k in zip(contributions, kept)]

    def alone(xs: list[torch.Tensor], gammas: list[ChannelsAside]) -> list[torch.Tensor]:
        return [batch_norm_act(x, weight, bias, 1e-5, config, channels_aside=gamma)
                for x, gamma in zip(xs, gammas)]

    def loss(layer: Callable[[list[torch.Tensor], list[ChannelsAside]], list[torch.Tensor]]
             ) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            xs = list(torch.randn(2 * replicas, 8, 2, 2, requires_grad=True).split(2))
            found = ChannelsAside.read_now(weight, bias)
            gammas = [found.copy() for _ in xs]
            for _ in range(calls):
                xs = layer([x * 1 for x in xs], gammas)
            return torch.cat(xs).sum()
        return run

    return _per_call_medians({"sync": loss(synced), "sync=False": loss(alone)}, calls, turns)


def meeting_us(replicas: int, meetings: int = 2000) -> dict[str, float]:
    """Microseconds per meeting of ``replicas`` threads doing nothing else: this package's
    protocol (the master gathers and answers), and ``threading.Barrier``."""
    import threading

    from helpers.timing import threads_seconds

    from encoding_syncbn.sync.group import ReplicaGroup, ReplicaSession

    group = ReplicaGroup(ReplicaSession(), "rendezvous")
    for _ in range(replicas):
        group.add_member(threading.Event())  # stand-ins for the replica modules
    group.close()
    barrier = threading.Barrier(replicas)

    def ours(rank: int) -> None:
        for _ in range(meetings):
            call = group.begin_call(rank)
            if rank == 0:
                group.scatter(call, group.gather(call, rank))
            else:
                group.exchange(rank, call, rank)

    def stdlib(rank: int) -> None:
        for _ in range(meetings):
            barrier.wait()

    return {"encoding_syncbn": threads_seconds(ours, replicas) / meetings * 1e6,
            "threading.Barrier": threads_seconds(stdlib, replicas) / meetings * 1e6}


def tiny_ops_us(replicas: int, ops: int = 30, repeats: int = 300) -> dict[int, float]:
    """Microseconds per ``ops`` tiny ATen calls in each of 1 and of ``replicas`` threads at
    once, no meeting: what sharing the GIL costs."""
    import torch
    from helpers.timing import threads_seconds

    def body(rank: int) -> None:
        t = torch.zeros(8)
        for _ in range(repeats):
            for _ in range(ops):
                t = t.mul(1.0)

    return {count: threads_seconds(body, count) / repeats * 1e6 for count in (1, replicas)}


def main() -> None:
    args = parse_args()
    import torch
    from helpers.timing import median_range

    def cells(per_round: list[tuple[float, float]]) -> list[str]:
        """Forward, backward and total: the median round [min, max over the rounds]."""
        return [median_range([f for f, _ in per_round]), median_range([b for _, b in per_round]),
                median_range([f + b for f, b in per_round])]

    torch.set_num_threads(args.threads)
    k = args.replicas
    rounds = []
    for index in range(args.rounds):
        print(f"round {index + 1} of {args.rounds} ...", flush=True)
        rounds.append((threaded_calls_us(k, args.calls, args.turns),
                       one_thread_work_us(k, args.calls, args.turns),
                       meeting_us(k), tiny_ops_us(k)))

    def minus(first: str, second: str, which: int = 0) -> list[tuple[float, float]]:
        return [(r[which][first][0] - r[which][second][0],
                 r[which][first][1] - r[which][second][1]) for r in rounds]

    def absolute(name: str) -> list[tuple[float, float]]:
        return [r[0][name] for r in rounds]

    per_call = results.markdown_table(
        ["per layer call", "relative to", "forward us", "backward us", "total us"], [
            [f"(1) `SyncBatchNorm`, synchronised, {k} replicas: what a user pays", "absolute",
             *cells(absolute("sync"))],
            [f"(2) `SyncBatchNorm(sync=False)`, {k} replicas", "absolute",
             *cells(absolute("sync=False"))],
            [f"(3) `nn.BatchNorm2d` + `nn.LeakyReLU`, {k} replicas", "absolute",
             *cells(absolute("bn"))],
            ["(4) `SyncBatchNorm`, 1 replica", "absolute", *cells(absolute("1 replica"))],
            ["(5a) synchronisation cost, (1) - (2)", f"(2): same layer, {k} replicas, unsynced",
             *cells(minus("sync", "sync=False"))],
            ["(5b) synchronisation cost, (1) - (3)", f"(3): BatchNorm2d, {k} replicas",
             *cells(minus("sync", "bn"))],
            [f"(6) the synchronisation's own work, {k} replicas' calls in one thread",
             f"{k} unsynchronised calls in one thread", *cells(minus("sync", "sync=False", 1))],
        ])
    meetings = [r[2] for r in rounds]
    tiny = [r[3] for r in rounds]
    where = results.markdown_table(["where (5) goes, per event", "us"], [
        [f"one meeting of {k} threads doing nothing else, this package's protocol",
         median_range([m["encoding_syncbn"] for m in meetings])],
        [f"one meeting of {k} threads doing nothing else, `threading.Barrier`",
         median_range([m["threading.Barrier"] for m in meetings])],
        ["30 tiny ATen calls, 1 thread", median_range([t[1] for t in tiny])],
        [f"30 tiny ATen calls in each of {k} threads at once",
         median_range([t[k] for t in tiny])],
    ])
    notes = (f"{k} simulated replicas (threads, `SimulatedDataParallel`), a tiny input (2 "
             f"samples per replica, 8 channels, 2x2), {args.calls} layer calls per forward, "
             f"{torch.get_num_threads()} torch thread(s). Microseconds per layer call: the "
             f"median of {args.turns} turns per round, the variants taking turns; shown as the "
             f"median of {args.rounds} rounds [min, max over the rounds]. The backward "
             f"includes freeing the graph. Rows (1)-(4) are what a call costs; (5) is what "
             f"synchronising adds to a call under the same {k} threads; (6) is the part of (5) "
             f"that is computation (the master's merge and its backward), the rest is the "
             f"threads' hand-offs (second table).")
    print(notes + "\n\n" + per_call + "\n\n" + where)
    results.record(args, "bench_sync.py (cpu)", per_call + "\n\n" + where, notes)


if __name__ == "__main__":
    main()
