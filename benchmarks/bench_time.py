"""How long a forward+backward of the in-place layer takes, against BatchNorm2d + leaky_relu.

    python benchmarks/bench_time.py                    # CPU, one thread
    python benchmarks/bench_time.py --device cuda      # a GPU, when there is one
    python benchmarks/bench_time.py --device cuda --shape 8 256 128 128 --dtype float16

Times forward and backward of the two 8-layer stacks of benchmarks/helpers/stacks.py, by default on
an (8, 64, 64, 64) float32 input (``--shape``, ``--dtype``: another; the parameters stay
float32, as under autocast, but for a float64 input, whose stacks are float64 throughout):
``SyncBatchNorm(64, activation="leaky_relu")`` in place, and ``nn.BatchNorm2d(64)`` followed
by ``F.leaky_relu(inplace=True)``. One replica, no
synchronisation (see bench_sync.py for that). The two stacks take turns (after two warm-up
turns), so that a slow spell of a shared machine hits both alike; each figure is the median
over the turns with its interquartile range, and the ratio is taken turn by turn (ours /
plain, the two runs of the same turn). Prints the table (``--record``: into
benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse

from helpers import results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu",
                        help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--shape", type=int, nargs="+", default=None,
                        help="input shape N C ... (default: benchmarks/helpers/stacks.py's SHAPE)")
    parser.add_argument("--dtype", default="float32",
                        choices=("float32", "float16", "bfloat16", "float64"),
                        help="input dtype (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=20,
                        help="timed turns of each stack (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads on the CPU (default: %(default)s)")
    results.add_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Imported after the flags are read, so that --help needs no torch.
    import torch
    from helpers.stacks import LABELS, LAYERS, SHAPE, STACKS
    from helpers.timing import forward_backward, median_iqr, take_turns

    device = torch.device(args.device)
    shape = tuple(args.shape or SHAPE)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    x = torch.randn(shape, device=device, dtype=getattr(torch, args.dtype))
    grad = torch.randn_like(x)
    parameters = torch.float64 if x.dtype == torch.float64 else torch.float32
    stacks = {name: make(shape[1], LAYERS).to(device, parameters)
              for name, make in STACKS.items()}

    def measure(stack: torch.nn.Module):
        return lambda: forward_backward(lambda: stack(x.detach().requires_grad_()), grad,
                                        device)

    times = take_turns({name: measure(stack) for name, stack in stacks.items()}, args.turns)
    ours, plain = times["inplace_abn"], times["bn+leaky_relu"]
    rows = []
    for name in STACKS:
        fwd = [f * 1e3 for f, _ in times[name]]
        bwd = [b * 1e3 for _, b in times[name]]
        rows.append([LABELS[name], median_iqr(fwd, 2), median_iqr(bwd, 2),
                     median_iqr([f + b for f, b in zip(fwd, bwd)], 2)])
    rows.append(["ratio, ours / plain (turn by turn)",
                 median_iqr([o[0] / p[0] for o, p in zip(ours, plain)], 2),
                 median_iqr([o[1] / p[1] for o, p in zip(ours, plain)], 2),
                 median_iqr([sum(o) / sum(p) for o, p in zip(ours, plain)], 2)])
    table = results.markdown_table(
        ["stack", "forward ms", "backward ms", "forward+backward ms"], rows)
    threads = f"{torch.get_num_threads()} thread(s)" if device.type == "cpu" else "GPU"
    notes = (f"{LAYERS}-layer stacks on an {shape} {args.dtype} input, {device.type}, {threads}, "
             f"one replica: time per forward and backward of the whole stack, median "
             f"[interquartile range] of {args.turns} turns, the two stacks taking turns. "
             f"The ratio is ours over `nn.BatchNorm2d` + `F.leaky_relu` in the same turn.")
    print(notes + "\n\n" + table)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    # The default input keeps the section it always had; another input gets its own.
    size = "" if (shape, args.dtype) == (SHAPE, "float32") else (
        ", " + "x".join(map(str, shape)) + " " + args.dtype)
    results.record(args, f"bench_time.py ({device.type}{size})", table, notes, gpu)


if __name__ == "__main__":
    main()
