#!/usr/bin/env python
"""Forward+backward time and peak memory of the segmentation example's network, per norm layer.

Compares ``nn.BatchNorm2d`` + ReLU, ``SyncBatchNorm`` + ReLU and in-place ABN
(``convert_inplace_abn``, leaky ReLU) in the DeepLabV3 / dilated ResNet of
``examples/train_segmentation.py``. Each variant runs in a fresh subprocess so that one
variant's allocations cannot inflate the next one's peak:

* CUDA: peak of ``torch.cuda.max_memory_allocated`` minus what was allocated before the first
  iteration (model and input), summed over the devices used;
* CPU: peak resident set size (``ru_maxrss``) minus the peak reached after building the model
  and the input. Includes allocator slack, so read it as an upper bound.

Prints a markdown table with the machine, the configuration and the date (``--record``: into
benchmarks/RESULTS.md too). Example::

    python benchmarks/bench_model.py                         # ResNet-18 widths, OS 8
    python benchmarks/bench_model.py --width 64 --blocks 3,4,6,3 --image-size 512
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from helpers import results
from torch import nn

_ROOT = Path(__file__).resolve().parent.parent
# The network lives in the example's helper package; the library is used from the checkout
# when it is not installed.
sys.path.insert(0, str(_ROOT / "examples"))
sys.path.append(str(_ROOT))

from segmentation.model import NORM_CHOICES, DeepLabV3, convert_norm  # noqa: E402

LABELS = {
    "bn": "BatchNorm2d + ReLU",
    "syncbn": "SyncBatchNorm + ReLU",
    "inplace_abn": "In-place ABN (SyncBatchNorm, leaky_relu)",
}


def _int_list(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Flags; size defaults depend on the device (a realistic size that still runs on CPU)."""
    # Defaults written into each help text: ArgumentDefaultsHelpFormatter would add
    # "(default: None)" after the device-dependent defaults that the texts spell out.
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--norms", default=",".join(NORM_CHOICES),
                   help="comma-separated variants to run, from: " + ", ".join(NORM_CHOICES)
                        + " (default: all)")
    p.add_argument("--width", type=int, default=64,
                   help="first-stage channels (default: %(default)s = ResNet-18/34 widths)")
    p.add_argument("--blocks", type=_int_list, default=[2, 2, 2, 2],
                   help="basic blocks per stage (default: 2,2,2,2 = ResNet-18; 3,4,6,3 = "
                        "ResNet-34)")
    p.add_argument("--output-stride", type=int, choices=(8, 16), default=8,
                   help="backbone output stride (default: %(default)s)")
    p.add_argument("--num-classes", type=int, default=21,
                   help="classifier outputs (default: %(default)s, as VOC)")
    p.add_argument("--image-size", type=int, default=None,
                   help="square input side (default: 512 on CUDA, 256 on CPU)")
    p.add_argument("--batch-size", type=int, default=None,
                   help="images per iteration (default: 8 on CUDA, 4 on CPU)")
    p.add_argument("--iters", type=int, default=None,
                   help="timed iterations (default: 20 on CUDA, 3 on CPU)")
    p.add_argument("--warmup", type=int, default=1,
                   help="untimed iterations first (default: %(default)s)")
    p.add_argument("--replicas", type=int, default=1,
                   help="DataParallel replicas: GPUs on CUDA, simulated threads on CPU "
                        "(default: %(default)s)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto = CUDA when available (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads on CPU (default: all available cores)")
    p.add_argument("--worker", choices=NORM_CHOICES, default=None,
                   help=argparse.SUPPRESS)  # internal: run one variant and print JSON
    results.add_arguments(p)
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    cuda = args.device == "cuda"
    args.image_size = args.image_size or (512 if cuda else 256)
    args.batch_size = args.batch_size or (8 if cuda else 4)
    args.iters = args.iters or (20 if cuda else 3)
    return args


def _wrap(model: nn.Module, args: argparse.Namespace) -> nn.Module:
    if args.replicas == 1:
        return model
    if args.device == "cuda":
        return nn.DataParallel(model, device_ids=list(range(args.replicas)))
    from encoding_syncbn.testing import SimulatedDataParallel

    return SimulatedDataParallel(model, args.replicas)


def run_variant(args: argparse.Namespace, norm: str) -> dict:
    """Time ``args.iters`` forward+backward passes of one variant; measure its peak memory."""
    cuda = args.device == "cuda"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(args.threads or results.cores())
    torch.manual_seed(0)
    activation = "leaky_relu" if norm == "inplace_abn" else "relu"  # as LABELS says
    model = DeepLabV3(args.num_classes, activation, args.width, args.blocks, args.output_stride)
    model = convert_norm(model, norm).to(device).train()
    net = _wrap(model, args)
    size = (args.batch_size, 3, args.image_size, args.image_size)
    x = torch.randn(size, device=device)
    target = torch.randint(0, args.num_classes, (size[0], size[2], size[3]), device=device)

    devices = list(range(args.replicas)) if cuda else []
    if cuda:
        torch.cuda.synchronize()
        base = {d: torch.cuda.memory_allocated(d) for d in devices}
        for d in devices:
            torch.cuda.reset_peak_memory_stats(d)
    else:
        base_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux

    times = []
    for i in range(args.warmup + args.iters):
        model.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        loss = F.cross_entropy(net(x), target)
        loss.backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - start)

    if cuda:
        peak = sum(torch.cuda.max_memory_allocated(d) - base[d] for d in devices)
    else:
        peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base_kib) * 1024
    return {"norm": norm, "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3, "peak_mib": peak / 2**20}


def main(argv: list[str] | None = None) -> list[dict]:
    """Run every variant in its own subprocess and print the markdown table."""
    args = parse_args(argv)
    if args.worker is not None:
        print(json.dumps(run_variant(args, args.worker)))
        return []
    norms = [n for n in args.norms.split(",") if n]
    unknown = set(norms) - set(NORM_CHOICES)
    if unknown:
        raise SystemExit(f"unknown --norms {sorted(unknown)}; choose from {NORM_CHOICES}")

    forwarded = [
        "--width", str(args.width), "--blocks", ",".join(map(str, args.blocks)),
        "--output-stride", str(args.output_stride), "--num-classes", str(args.num_classes),
        "--image-size", str(args.image_size), "--batch-size", str(args.batch_size),
        "--iters", str(args.iters), "--warmup", str(args.warmup),
        "--replicas", str(args.replicas), "--device", args.device,
    ]
    if args.threads:
        forwarded += ["--threads", str(args.threads)]
    measured = []
    for norm in norms:
        print(f"running {norm} ...", file=sys.stderr, flush=True)
        proc = subprocess.run([sys.executable, __file__, *forwarded, "--worker", norm],
                              capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"variant {norm} failed:\n{proc.stderr}")
        measured.append(json.loads(proc.stdout.strip().splitlines()[-1]))

    cuda = args.device == "cuda"
    memory = "peak CUDA memory allocated" if cuda else "peak RSS increase"
    ref = next((r["peak_mib"] for r in measured if r["norm"] == "bn"), None)
    table = results.markdown_table(
        ["norm layer", "ms / iter (median)", "ms / iter (min)", f"{memory} (MiB)",
         "memory vs BN"],
        [[LABELS[r["norm"]], round(r["median_ms"], 1), round(r["min_ms"], 1),
          round(r["peak_mib"]), f"{r['peak_mib'] / ref:.2f}x" if ref else "-"]
         for r in measured])
    threads = "" if cuda else f", {args.threads or results.cores()} thread(s)"
    notes = (f"DeepLabV3 forward+backward: width {args.width}, blocks "
             f"{','.join(map(str, args.blocks))}, output stride {args.output_stride}, "
             f"{args.num_classes} classes, input {args.batch_size}x3x{args.image_size}x"
             f"{args.image_size}, {args.replicas} replica(s), float32{threads}, median of "
             f"{args.iters} iterations after {args.warmup} warm-up, each variant in a fresh "
             f"process.")
    gpu = f"{torch.cuda.get_device_name(0)} x{args.replicas}" if cuda else None
    print(f"{notes}\n{results.machine(gpu)}\n\n{table}")
    results.record(args, f"bench_model.py ({args.device})", table, notes, gpu)
    return measured


if __name__ == "__main__":
    main()
