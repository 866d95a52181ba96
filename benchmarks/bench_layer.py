"""Time and memory of one In-Place ABN layer stack against BatchNorm2d + leaky_relu.

    python benchmarks/bench_layer.py                  # CPU, one thread
    python benchmarks/bench_layer.py --device cuda    # a GPU, when there is one

Prints, measured in the same run:
- forward+backward time (the fastest of ``--repeats``, the two stacks taking turns) of an
  8-layer stack on an (8, 64, 64, 64) float32 input, for
  ``SyncBatchNorm(64, activation="leaky_relu")`` (in place) and for ``nn.BatchNorm2d(64)``
  followed by ``F.leaky_relu(inplace=True)``; between layers the stack multiplies by 2, an op
  that keeps nothing for backward (it stands for the conv of a real network);
- the forward's peak memory growth of each stack (the activations kept for backward plus
  transients). On the CPU it is the growth of the process's peak resident memory (Linux
  VmHWM, reset through /proc/self/clear_refs just before the forward) in a fresh process per
  variant; on CUDA, ``torch.cuda.max_memory_allocated``;
- on the CPU, the per-call cost of the synchronisation itself: a tiny input through 4
  simulated replicas, synchronised and with ``sync=False``, and through 1, per layer call,
  forward and backward, in microseconds, in ``--sync-rounds`` rounds; the same layer calls'
  work for 4 replicas run in one thread, synchronised and not (the synchronisation's work
  without the threads' hand-offs); the cost of one bare meeting of 4 threads; that of 30
  tiny ATen calls per thread in 1 and in 4 threads (the GIL's hand-offs); and a trivial
  ``torch.library`` custom op's per-call cost against a direct call;
- on CUDA, each op's effective bandwidth (the bytes it must move over its time) against
  the device's peak memory bandwidth (``--peak-gbps``, default: the H100 SXM's 3350 GB/s).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from encoding_syncbn import SyncBatchNorm
from encoding_syncbn.testing import SimulatedDataParallel

SHAPE = (8, 64, 64, 64)
LAYERS = 8


class PlainStack(nn.Module):
    def __init__(self, channels: int, layers: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(nn.BatchNorm2d(channels) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            x = F.leaky_relu(norm(x * 2), 0.01, inplace=True)
        return x


class InPlaceStack(nn.Module):
    def __init__(self, channels: int, layers: int) -> None:
        super().__init__()
        self.norms = nn.ModuleList(
            SyncBatchNorm(channels, activation="leaky_relu", slope=0.01) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for norm in self.norms:
            x = norm(x * 2)
        return x


STACKS = {"bn+leaky_relu": PlainStack, "inplace_abn": InPlaceStack}


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_fwd_bwd(stacks: dict[str, nn.Module], x: torch.Tensor, repeats: int
                 ) -> dict[str, float]:
    """Fastest seconds of one forward+backward of each stack, the stacks taking turns (so a
    slow spell of a shared machine hits both alike) after two warm-up rounds."""
    grad = torch.randn_like(x)
    times: dict[str, list[float]] = {name: [] for name in stacks}
    for i in range(repeats + 2):
        for name, stack in stacks.items():
            leaf = x.detach().requires_grad_()
            synchronize(x.device)
            start = time.perf_counter()
            stack(leaf).backward(grad)
            synchronize(x.device)
            if i >= 2:
                times[name].append(time.perf_counter() - start)
    return {name: min(values) for name, values in times.items()}


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def peak_rss_growth(name: str) -> int:
    """Peak RSS growth (bytes) of one forward, in a fresh process so no peak carries over."""
    result = subprocess.run([sys.executable, __file__, "--forward-memory-of", name],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["growth"]


def child_measure(name: str) -> None:
    torch.set_num_threads(1)
    stack = STACKS[name](SHAPE[1], LAYERS)
    x = torch.randn(SHAPE, requires_grad=True)
    # Warm up on a tiny input so that one-time allocations are not counted.
    stack(torch.randn(2, SHAPE[1], 2, 2, requires_grad=True)).sum().backward()
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets the peak (VmHWM) to the current resident size
    before = _status_kib("VmRSS")
    out = stack(x)
    after = _status_kib("VmHWM")
    del out
    print(json.dumps({"growth": (after - before) * 1024}))


def cuda_peak_growth(stack: nn.Module, x: torch.Tensor) -> int:
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = stack(x.detach().requires_grad_())
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


class _Repeat(nn.Module):
    """One layer called ``calls`` times in a row, a multiplication between calls."""

    def __init__(self, layer: nn.Module, calls: int) -> None:
        super().__init__()
        self.layer, self.calls = layer, calls

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.calls):
            x = self.layer(x * 1)
        return x


def _medians_us(losses: dict[str, Callable[[], torch.Tensor]], calls: int, repeats: int
                ) -> dict[str, tuple[float, float]]:
    """Median microseconds per layer call, ``(forward, backward)``, of each variant's
    ``loss()`` (a forward through ``calls`` layer calls, from a fresh input) and of its
    backward, the variants taking turns ``repeats`` times. Each variant pays for freeing its
    own graph, in its backward."""
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name in losses}
    for _ in range(repeats):
        for name, loss in losses.items():
            start = time.perf_counter()
            out = loss()
            middle = time.perf_counter()
            out.backward()
            del out
            end = time.perf_counter()
            times[name][0].append((middle - start) / calls * 1e6)
            times[name][1].append((end - middle) / calls * 1e6)
    return {name: (statistics.median(fwd), statistics.median(bwd))
            for name, (fwd, bwd) in times.items()}


def sync_cost_us(replicas: int = 4, calls: int = 50, repeats: int = 60
                 ) -> dict[str, tuple[float, float]]:
    """Microseconds per layer call, ``(forward, backward)``, of a tiny input (2 per replica,
    8 channels, 2x2) under ``replicas`` simulated replicas, synchronised (``"sync"``) and
    not (``"sync=False"``), and on one replica (``"1 replica"``, 2 per replica as well).

    The variants take turns, ``repeats`` times, and each figure is the median: the replicas
    are threads sharing a GIL, whose scheduling makes single runs vary widely.
    """
    def loss(sync: bool, count: int) -> Callable[[], torch.Tensor]:
        layer = SyncBatchNorm(8, activation="leaky_relu", sync=sync)
        net = SimulatedDataParallel(_Repeat(layer, calls), count)
        return lambda: net(torch.randn(2 * count, 8, 2, 2)).sum()

    return _medians_us({"sync": loss(True, replicas), "sync=False": loss(False, replicas),
                        "1 replica": loss(True, 1)}, calls, repeats)


def sync_work_us(replicas: int = 4, calls: int = 50, repeats: int = 100
                 ) -> dict[str, tuple[float, float]]:
    """Microseconds per layer call, ``(forward, backward)``, of what ``replicas`` replicas
    compute for a tiny input (2 per replica, 8 channels, 2x2), all in one thread: the
    synchronised path's steps in the order the replica threads run them (every replica's
    statistics, the master's merge, every replica's ``NormAct``; ``"sync"``), and the
    unsynchronised ``BatchNormAct`` once per replica (``"sync=False"``). Their difference
    is the synchronisation's own work, without the threads' hand-offs.
    """
    from encoding_syncbn.functional import (
        ActConfig,
        NormAct,
        _nothing,
        batch_norm_act,
        merge_replicas,
        replica_stats,
    )

    weight = torch.ones(8, requires_grad=True)
    bias = torch.zeros(8, requires_grad=True)
    config = ActConfig("leaky_relu", 0.01, True, ())
    no_channels = _nothing(torch.long, weight.device)

    def synced(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        contributions = [replica_stats(x) for x in xs]
        mean, _, invstd = merge_replicas(contributions, 1e-5)
        return [NormAct.apply(c.x, mean, invstd, weight, bias, config, c.link, no_channels)
                for c in contributions]

    def alone(xs: list[torch.Tensor]) -> list[torch.Tensor]:
        return [batch_norm_act(x, weight, bias, 1e-5, config)[0] for x in xs]

    def loss(layer: Callable[[list[torch.Tensor]], list[torch.Tensor]]
             ) -> Callable[[], torch.Tensor]:
        def run() -> torch.Tensor:
            xs = list(torch.randn(2 * replicas, 8, 2, 2, requires_grad=True).split(2))
            for _ in range(calls):
                xs = layer([x * 1 for x in xs])
            return torch.cat(xs).sum()
        return run

    return _medians_us({"sync": loss(synced), "sync=False": loss(alone)}, calls, repeats)


def _sync_minus_alone(costs: dict[str, tuple[float, float]]) -> tuple[float, float]:
    """``(forward, backward)`` of ``"sync"`` minus those of ``"sync=False"``."""
    (sync_fwd, sync_bwd), (alone_fwd, alone_bwd) = costs["sync"], costs["sync=False"]
    return sync_fwd - alone_fwd, sync_bwd - alone_bwd


def _threads_seconds(body, count: int) -> float:
    """Wall seconds for ``body(rank)`` to run in ``count`` threads at once."""
    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def threaded_tiny_ops_us(replicas: int = 4, ops: int = 30, rounds: int = 300
                         ) -> dict[int, float]:
    """Microseconds per round of ``ops`` tiny ATen calls in each of 1 and of ``replicas``
    threads, no synchronisation: what sharing the GIL costs (every call releases it)."""

    def body(rank: int) -> None:
        t = torch.zeros(8)
        for _ in range(rounds):
            for _ in range(ops):
                t = t.mul(1.0)

    return {count: _threads_seconds(body, count) / rounds * 1e6 for count in (1, replicas)}


def rendezvous_us(replicas: int = 4, rounds: int = 2000) -> dict[str, float]:
    """Microseconds per meeting of ``replicas`` threads doing nothing else: this package's
    protocol (master gathers and answers), and ``threading.Barrier`` for comparison."""
    from encoding_syncbn.sync import ReplicaGroup, ReplicaSession

    group = ReplicaGroup(ReplicaSession(), "rendezvous")
    members = [threading.Event() for _ in range(replicas)]  # stand-ins for the replicas
    for member in members:
        group.add_member(member)
    group.close()
    barrier = threading.Barrier(replicas)

    def ours(rank: int) -> None:
        for _ in range(rounds):
            call = group.begin_call(rank)
            if rank == 0:
                group.scatter(call, group.gather(call, rank))
            else:
                group.exchange(rank, call, rank)

    def stdlib(rank: int) -> None:
        for _ in range(rounds):
            barrier.wait()

    return {name: _threads_seconds(body, replicas) / rounds * 1e6
            for name, body in (("encoding_syncbn", ours), ("threading.Barrier", stdlib))}


def dispatcher_overhead_us(calls: int = 20000) -> dict[str, float]:
    """Microseconds per call of a trivial ``torch.library`` custom op, functional and
    mutating, and of the same Python function called directly: what the Triton backend saves
    by calling its launchers directly in eager mode."""
    import timeit

    def body(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def body_(x: torch.Tensor, out: torch.Tensor) -> None:
        return None

    functional = torch.library.custom_op("bench_layer::functional", mutates_args=())(body)
    functional.register_fake(body)
    torch.library.custom_op("bench_layer::mutating_", mutates_args=("out",))(body_)
    x = torch.zeros(8)
    cases = {"custom op": lambda: torch.ops.bench_layer.functional(x),
             "mutating custom op": lambda: torch.ops.bench_layer.mutating_(x, x),
             "direct call": lambda: body(x)}
    return {name: min(timeit.repeat(call, number=calls, repeat=5)) / calls * 1e6
            for name, call in cases.items()}


def kernel_bandwidth(x: torch.Tensor, repeats: int) -> list[tuple[str, float, float]]:
    """(op, microseconds, GB/s) for each of the layer's four ops on ``x``'s device."""
    from encoding_syncbn.kernels import ops_for

    ops = ops_for(x)
    channels = x.shape[1]
    mean, m2, count = ops.channel_stats(x)
    invstd = torch.rsqrt(m2 / count + 1e-5)
    weight, bias = torch.ones(channels, device=x.device), torch.zeros(channels, device=x.device)
    y, dy = x.clone(), torch.randn_like(x)
    sums = ops.backward_reduce(y, dy, mean, invstd, weight, bias, "leaky_relu", 0.01, True)
    coefs = (invstd, sums[1] / count, sums[0] / count)
    # (name, call, activation-sized tensors read + written)
    cases = [
        ("channel_stats", lambda: ops.channel_stats(x), 1),
        ("normalize_act (in place)", lambda: ops.normalize_act(
            y, mean, invstd, weight, bias, "leaky_relu", 0.01, y), 2),
        ("backward_reduce", lambda: ops.backward_reduce(
            y, dy, mean, invstd, weight, bias, "leaky_relu", 0.01, True), 2),
        ("backward_dx", lambda: ops.backward_dx(
            y, dy, mean, invstd, weight, bias, "leaky_relu", 0.01, True, *coefs), 3),
    ]
    rows = []
    for name, call, tensors in cases:
        call()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            call()
        end.record()
        torch.cuda.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / repeats
        rows.append((name, seconds * 1e6, tensors * x.nbytes / seconds / 1e9))
    return rows


def ops_name(x: torch.Tensor) -> str:
    from encoding_syncbn.kernels import ops_for

    return ops_for(x).__name__.rsplit(".", 1)[-1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--repeats", type=int, default=10,
                        help="timed iterations per stack (the fastest is reported)")
    parser.add_argument("--peak-gbps", type=float, default=3350.0,
                        help="the device's peak memory bandwidth, GB/s (H100 SXM: 3350, "
                             "H200: 4800, A100 80GB: 2039)")
    parser.add_argument("--sync-rounds", type=int, default=5,
                        help="rounds of the threaded synchronisation-cost measurement (CPU)")
    parser.add_argument("--forward-memory-of", choices=STACKS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.forward_memory_of:  # the fresh child process of peak_rss_growth
        child_measure(args.forward_memory_of)
        return
    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(1)
    x = torch.randn(SHAPE, device=device)
    print(f"torch {torch.__version__}, device {device}, threads {torch.get_num_threads()}, "
          f"input {SHAPE} float32, {LAYERS}-layer stack")
    results = {}
    stacks = {name: make(SHAPE[1], LAYERS).to(device) for name, make in STACKS.items()}
    timings = time_fwd_bwd(stacks, x, args.repeats)
    for name, stack in stacks.items():
        seconds = timings[name]
        if device.type == "cuda":
            growth = cuda_peak_growth(stack, x)
        else:
            growth = peak_rss_growth(name)
        results[name] = (seconds, growth)
        print(f"{name:>14}: fwd+bwd {seconds * 1e3:8.2f} ms   forward peak growth "
              f"{growth / 2**20:8.1f} MiB ({growth / x.nbytes:.2f} activations)")
    (t_ours, m_ours), (t_plain, m_plain) = results["inplace_abn"], results["bn+leaky_relu"]
    print(f"time ratio (inplace_abn / bn+leaky_relu): {t_ours / t_plain:.2f}")
    print(f"memory ratio (inplace_abn / bn+leaky_relu): {m_ours / m_plain:.2f}")
    if device.type == "cuda":
        print(f"per-op bandwidth, backend {ops_name(x)}, peak {args.peak_gbps:.0f} GB/s:")
        for name, micros, gbps in kernel_bandwidth(x, 20):
            print(f"{name:>26}: {micros:9.1f} us {gbps:8.0f} GB/s "
                  f"({100 * gbps / args.peak_gbps:.0f}% of peak)")
    if device.type == "cpu":
        # Rounds, not one longer run: the threads' scheduling drifts over tens of seconds, so
        # that medians of one run still differ by 2x or more from the next run's.
        rounds = sorted((sync_cost_us() for _ in range(args.sync_rounds)),
                        key=lambda costs: sum(_sync_minus_alone(costs)))
        costs = rounds[len(rounds) // 2]
        print(f"per layer call, tiny input, 4 simulated replicas (medians of 60 turns; the "
              f"median of {len(rounds)} rounds):")
        for name, (fwd, bwd) in costs.items():
            print(f"{name:>14}: forward {fwd:7.0f} us  backward {bwd:7.0f} us  "
                  f"total {fwd + bwd:7.0f} us")
        fwd, bwd = _sync_minus_alone(costs)
        print(f"the exchange itself (sync - sync=False): forward {fwd:.0f} us, "
              f"backward {bwd:.0f} us, total {fwd + bwd:.0f} us; every round: " + ", ".join(
                  "{:.0f} + {:.0f} = {:.0f} us".format(*pair, sum(pair))
                  for pair in map(_sync_minus_alone, rounds)))
        work = sync_work_us()
        fwd, bwd = _sync_minus_alone(work)
        print(f"the same work in one thread (no hand-offs, medians of 100 turns), "
              f"sync - sync=False: forward {fwd:.0f} us, backward {bwd:.0f} us, total "
              f"{fwd + bwd:.0f} us (" + ", ".join(
                  f"{name} {f:.0f} + {b:.0f} us" for name, (f, b) in work.items()) + ")")
        meeting = rendezvous_us()
        print("one meeting of 4 threads doing nothing else: " + ", ".join(
            f"{name} {micros:.0f} us" for name, micros in meeting.items()))
        tiny = threaded_tiny_ops_us()
        print("30 tiny ATen calls in each thread, no meeting: " + ", ".join(
            f"{count} thread(s) {micros:.0f} us" for count, micros in tiny.items()))
        print("per call: " + ", ".join(
            f"{name} {micros:.1f} us" for name, micros in dispatcher_overhead_us().items()))

if __name__ == "__main__":
    main()
