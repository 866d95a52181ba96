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
- the per-call cost of the synchronisation itself: a tiny input through 4 simulated replicas
  against 1, per layer call, in microseconds;
- on CUDA, each op's effective bandwidth (the bytes it must move over its time) against
  the device's peak memory bandwidth (``--peak-gbps``, default: the H100 SXM's 3350 GB/s).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

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


def sync_cost_us(replicas: int, sync: bool = True, calls: int = 200) -> tuple[float, float]:
    """Microseconds of wall and of CPU time (all threads) per layer call (fwd+bwd) of a tiny
    input under simulated DataParallel."""
    layer = SyncBatchNorm(8, activation="leaky_relu", sync=sync)

    class Repeat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layer = layer

        def forward(self, x):
            for _ in range(calls):
                x = self.layer(x * 1)
            return x

    model = SimulatedDataParallel(Repeat(), replicas)
    x = torch.randn(2 * replicas, 8, 2, 2)
    wall, cpu = [], []
    for _ in range(9):
        start, start_cpu = time.perf_counter(), time.process_time()
        model(x).sum().backward()
        wall.append((time.perf_counter() - start) / calls)
        cpu.append((time.process_time() - start_cpu) / calls)
    # The minimum: thread scheduling on a busy machine only ever adds time.
    return min(wall) * 1e6, min(cpu) * 1e6


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
        one, four, four_alone = sync_cost_us(1), sync_cost_us(4), sync_cost_us(4, sync=False)
        for i, clock in enumerate(("wall", "CPU")):
            print(f"per layer call (fwd+bwd, tiny input, {clock} time): 1 replica "
                  f"{one[i]:.0f} us, 4 replicas {four[i]:.0f} us (difference "
                  f"{four[i] - one[i]:.0f} us); 4 replicas with sync=False {four_alone[i]:.0f} "
                  f"us, so the exchange itself costs {four[i] - four_alone[i]:.0f} us")


if __name__ == "__main__":
    main()
