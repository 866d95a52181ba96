"""The benchmarks' timing: variants taking turns, forward and backward timed apart, summaries.

On a shared machine whose speed drifts, variants that are compared run in turns (A, B, A,
B, ...) so that a slow spell hits each alike, and a figure is a median with its spread,
never a single run.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable, Sequence

import torch


def synchronize(device: torch.device | None) -> None:
    """Wait for the device's queued work (a no-op on the CPU and for None)."""
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_backward(run: Callable[[], torch.Tensor], grad: torch.Tensor | None = None,
                     device: torch.device | None = None) -> tuple[float, float]:
    """Seconds of ``out = run()`` and of ``out.backward(grad)``, the device synchronised
    around each. The backward includes freeing the graph."""
    synchronize(device)
    start = time.perf_counter()
    out = run()
    synchronize(device)
    middle = time.perf_counter()
    out.backward(grad)
    del out
    synchronize(device)
    return middle - start, time.perf_counter() - middle


def take_turns(variants: dict[str, Callable[[], Sequence[float]]], turns: int, warmup: int = 2
               ) -> dict[str, list[Sequence[float]]]:
    """Each variant's measurements (whatever its callable returns, e.g. forward and backward
    seconds), the variants called in turns, ``warmup`` untimed turns first."""
    measured: dict[str, list[Sequence[float]]] = {name: [] for name in variants}
    for turn in range(warmup + turns):
        for name, measure in variants.items():
            values = measure()
            if turn >= warmup:
                measured[name].append(values)
    return measured


def threads_seconds(body: Callable[[int], None], count: int) -> float:
    """Wall seconds for ``body(rank)`` to run in ``count`` threads at once."""
    threads = [threading.Thread(target=body, args=(rank,)) for rank in range(count)]
    start = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.perf_counter() - start


def median_iqr(values: Sequence[float], digits: int = 0) -> str:
    """``"median [first quartile, third quartile]"``: for many samples (turns)."""
    if len(values) < 2:
        return f"{values[0]:.{digits}f}"
    q1, median, q3 = statistics.quantiles(values, n=4, method="inclusive")
    return f"{median:.{digits}f} [{q1:.{digits}f}, {q3:.{digits}f}]"


def median_range(values: Sequence[float], digits: int = 0) -> str:
    """``"median [min, max]"``: for a few samples (rounds, repeated runs)."""
    return (f"{statistics.median(values):.{digits}f} [{min(values):.{digits}f}, "
            f"{max(values):.{digits}f}]")
