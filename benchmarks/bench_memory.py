"""How much memory a forward of the in-place layer keeps, against BatchNorm2d + leaky_relu.

    python benchmarks/bench_memory.py                  # CPU
    python benchmarks/bench_memory.py --device cuda    # a GPU, when there is one

Measures the forward's peak memory growth of the two 8-layer stacks of benchmarks/helpers/stacks.py
on an (8, 64, 64, 64) float32 input (``SyncBatchNorm(64, activation="leaky_relu")`` in place,
and ``nn.BatchNorm2d(64)`` followed by ``F.leaky_relu(inplace=True)``): the activations kept
for backward plus the forward's transients, in MiB and in units of the input's size.

- CPU: the growth of the process's peak resident memory (Linux VmHWM, reset through
  /proc/self/clear_refs just before the forward), in a fresh process per measurement so that
  no peak carries over; it includes the allocator's slack.
- CUDA: ``torch.cuda.max_memory_allocated`` minus what was allocated before the forward.

Each stack is measured ``--repeats`` times (the median and the range are shown). Prints the
table (``--record``: into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

from helpers import results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="measurements per stack (default: %(default)s)")
    parser.add_argument("--forward-memory-of", help=argparse.SUPPRESS)  # the child process
    results.add_arguments(parser)
    return parser.parse_args()


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def child_measure(name: str) -> None:
    """In a fresh process: print the peak RSS growth (bytes) of one forward, as JSON."""
    import torch
    from helpers.stacks import LAYERS, SHAPE, STACKS

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


def cpu_growth(name: str) -> int:
    """Peak RSS growth (bytes) of one forward of the stack ``name``, in a fresh process."""
    result = subprocess.run([sys.executable, __file__, "--forward-memory-of", name],
                            capture_output=True, text=True, check=True)
    return json.loads(result.stdout.strip().splitlines()[-1])["growth"]


def main() -> None:
    args = parse_args()
    if args.forward_memory_of:
        child_measure(args.forward_memory_of)
        return
    # Imported after the flags are read, so that --help needs no torch.
    import torch
    from helpers.stacks import LABELS, LAYERS, SHAPE, STACKS
    from helpers.timing import median_range

    device = torch.device(args.device)
    activation = torch.Size(SHAPE).numel() * 4

    def cuda_growth(name: str) -> int:
        stack = STACKS[name](SHAPE[1], LAYERS).to(device)
        x = torch.randn(SHAPE, device=device, requires_grad=True)
        stack(x).sum().backward()  # warm-up: one-time allocations are not counted
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = stack(x)
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device) - base
        del out
        return peak

    measure = cuda_growth if device.type == "cuda" else cpu_growth
    growth = {name: [measure(name) for _ in range(args.repeats)] for name in STACKS}
    median = {name: statistics.median(values) for name, values in growth.items()}
    rows = [[LABELS[name], median_range([v / 2**20 for v in values], 1),
             f"{median[name] / activation:.2f}"] for name, values in growth.items()]
    rows.append(["ratio, ours / plain (medians)",
                 f"{median['inplace_abn'] / median['bn+leaky_relu']:.2f}", ""])
    kind = ("peak RSS growth (VmHWM), a fresh process each" if device.type == "cpu"
            else "growth of torch.cuda.max_memory_allocated")
    table = results.markdown_table(
        ["stack", "forward peak growth MiB, median [min, max]", "in inputs' sizes"], rows)
    notes = (f"{LAYERS}-layer stacks on an {SHAPE} float32 input ({activation / 2**20:.0f} "
             f"MiB), {device.type}, one replica: the forward's peak memory growth ({kind}), "
             f"{args.repeats} measurements per stack. What a forward keeps for backward plus "
             f"its transients.")
    print(notes + "\n\n" + table)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    results.record(args, f"bench_memory.py ({device.type})", table, notes, gpu)


if __name__ == "__main__":
    main()
