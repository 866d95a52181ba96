#!/usr/bin/env python
"""Per-replica BatchNorm against SyncBatchNorm against In-Place ABN: one training, measured.

Runs ``train_segmentation.py`` once per (setting, norm) with the same network, seed, data
order and activation; only the normalisation differs (``--norm bn``, ``--norm syncbn`` or
``--norm inplace_abn``, the plain network converted as a user would). Two settings split the
batch over the (simulated, on the CPU) DataParallel replicas differently:

* ``noisy``: 4 replicas x 1 image: per-replica statistics come from one image, as with a few
  large crops per GPU in real segmentation;
* ``control``: 2 replicas x 8 images: per-replica statistics are already good.

Each run is its own process, so its peak memory is its own. Writes ``compare.md`` (the
table) and ``compare.png`` (validation mIoU per epoch) to ``--output``, and each run's
checkpoint, curves and predictions to a subfolder. The training script's other flags are
passed to every run (``--help`` lists them), e.g.::

    python examples/compare_norms.py --epochs 6 --train-images 256
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import textwrap
import time
from collections.abc import Sequence
from pathlib import Path

import torch

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))

from segmentation.model import NORM_CHOICES  # noqa: E402
from segmentation.plots import save_comparison  # noqa: E402
from train_segmentation import build_parser as training_parser  # noqa: E402

TRAIN_SCRIPT = _HERE / "train_segmentation.py"

#: The data of every run unless overridden: small objects at several scales (radius 5% to 20%
#: of the side), up to 4 per image, so that the background dominates most images and the
#: statistics of one image differ from the next's, as in real segmentation.
DATA = ["--shape-size", "0.05,0.2", "--max-shapes", "4"]

#: (replicas, images per replica) of each setting. The learning rate follows the batch
#: (linear scaling from the training script's 0.05 for 16 images per step).
SETTINGS = {"noisy": (4, 1), "control": (2, 8)}
LABELS = {
    "bn": "BatchNorm2d (per replica)",
    "syncbn": "SyncBatchNorm",
    "inplace_abn": "In-Place ABN",
}
#: The training script's flags this script sets per run, which cannot be passed through.
SET_PER_RUN = ("--norm", "--activation", "--output", "--replicas", "--batch-size", "--lr")


def _names(choices: Sequence[str]):
    def parse(text: str) -> list[str]:
        names = [v.strip() for v in text.split(",") if v.strip()]
        unknown = [v for v in names if v not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"expected comma-separated names from {', '.join(choices)}, got {text!r}")
        return names
    return parse


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter,
                     argparse.RawDescriptionHelpFormatter):
    """Defaults after each flag's help; the epilog's list of passed-on flags as laid out."""


def _passed_on() -> str:
    """The help's epilog: the training script's flags that go to every run, with their help
    and defaults (this script's for the data flags it sets, ``DATA``)."""
    defaults = dict(zip(DATA[::2], DATA[1::2]))
    lines = ["flags passed to every run (train_segmentation.py's; its --help says more):"]
    for action in training_parser()._actions:
        flag = action.option_strings[-1] if action.option_strings else None
        if flag is None or flag in (*SET_PER_RUN, "--help", "--no-progress"):
            continue
        usage = flag if action.nargs == 0 else f"{flag} {action.dest.upper()}"
        default = defaults.get(flag, action.default)
        if isinstance(default, list):
            default = ",".join(map(str, default))
        shown = ("" if default is None or default is False or "default" in (action.help or "")
                 else f" (default: {default})")
        lines += textwrap.wrap(f"{usage}: {action.help}{shown}", 96,
                               initial_indent="  ", subsequent_indent="      ")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    """This script's flags, and the rest (passed to every training run)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=_passed_on(),
                                formatter_class=_HelpFormatter)
    p.add_argument("--settings", type=_names(tuple(SETTINGS)), default=list(SETTINGS),
                   help="comma-separated settings to run, from: " + ", ".join(SETTINGS))
    p.add_argument("--norms", type=_names(NORM_CHOICES), default=list(NORM_CHOICES),
                   help="comma-separated normalisations to run, from: " + ", ".join(NORM_CHOICES))
    p.add_argument("--activation", choices=("relu", "leaky_relu"), default="leaky_relu",
                   help="the activation of every run (inplace_abn needs leaky_relu)")
    p.add_argument("--output", type=Path, default=Path("runs/compare"),
                   help="folder for compare.md, compare.png and one subfolder per run")
    args, rest = p.parse_known_args(argv)
    if args.activation != "leaky_relu" and "inplace_abn" in args.norms:
        p.error("inplace_abn needs --activation leaky_relu; leave it out with --norms bn,syncbn")
    # The training script's parser takes a flag's unambiguous prefix too (``--rep 1``).
    given = {a.split("=")[0] for a in rest if a.startswith("--") and len(a.split("=")[0]) > 2}
    clash = sorted({flag for flag in SET_PER_RUN for name in given if flag.startswith(name)})
    if clash:
        p.error(f"{', '.join(clash)} are set by this script per run, not passed through")
    return args, rest


def _describe(setting: str) -> str:
    replicas, per_replica = SETTINGS[setting]
    return f"{replicas} replicas x {per_replica} image{'s' * (per_replica > 1)}"


def _written(path: Path) -> int | None:
    """When ``path`` was last written (ns), None where there is no such file."""
    return path.stat().st_mtime_ns if path.is_file() else None


def run_one(setting: str, norm: str, args: argparse.Namespace, rest: list[str]) -> dict:
    """Train one variant in its own process; its history as the training script saved it."""
    replicas, per_replica = SETTINGS[setting]
    batch = replicas * per_replica
    out = args.output / f"{setting}-{norm}"
    cmd = [sys.executable, str(TRAIN_SCRIPT), "--replicas", str(replicas),
           "--batch-size", str(batch), "--lr", f"{0.05 * batch / 16:g}", "--norm", norm,
           "--activation", args.activation, "--no-progress", "--output", str(out), *DATA,
           *rest]
    # An earlier invocation's checkpoint (which a passed-on --resume may name) must not stand
    # in for this run's: the run must write one.
    before = _written(out / "checkpoint.pt")
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - start
    out.mkdir(parents=True, exist_ok=True)
    (out / "log.txt").write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{setting}/{norm} failed (exit {proc.returncode}); its output:\n"
                         f"{(proc.stdout + proc.stderr)[-3000:]}")
    if _written(out / "checkpoint.pt") in (None, before):
        raise SystemExit(f"{setting}/{norm} trained no epoch (--epochs 0, or a --resume "
                         f"already at --epochs): nothing to compare; its output is in "
                         f"{out / 'log.txt'}")
    history = torch.load(out / "checkpoint.pt", weights_only=True)["history"]
    return {"setting": setting, "norm": norm, "history": history, "wall_s": wall}


def table(results: list[dict]) -> str:
    """The markdown table: one row per run."""
    rows = [
        "| setting | normalisation | final mIoU | best mIoU (epoch) | "
        "training time (s) | process wall time (s) | peak memory, epoch 1 (MiB) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        hist = r["history"]
        best = max(hist, key=lambda h: h["miou"])
        rows.append(
            f"| {r['setting']}: {_describe(r['setting'])} | {LABELS[r['norm']]} | "
            f"{hist[-1]['miou']:.4f} | {best['miou']:.4f} ({best['epoch']}) | "
            f"{sum(h.get('train_s', 0.0) for h in hist):.0f} | {r['wall_s']:.0f} | "
            f"{hist[0]['peak_mib']:.0f} |"
        )
    return "\n".join(rows) + "\n"


def main(argv: Sequence[str] | None = None) -> list[dict]:
    """Run every (setting, norm), then write compare.md and compare.png."""
    args, rest = parse_args(argv)
    args.output.mkdir(parents=True, exist_ok=True)
    results = []
    for setting in args.settings:
        for norm in args.norms:
            r = run_one(setting, norm, args, rest)
            print(f"{setting:8s} {norm:12s} final mIoU {r['history'][-1]['miou']:.4f} "
                  f"({r['wall_s']:.0f} s)", flush=True)
            results.append(r)
    command = " ".join(["python examples/compare_norms.py", *(argv or sys.argv[1:])])
    text = (f"`{command}` (activation {args.activation}; other flags: the training script's "
            f"defaults)\n\n{table(results)}")
    (args.output / "compare.md").write_text(text)
    save_comparison(
        {f"{setting}: {_describe(setting)}": {LABELS[r["norm"]]: r["history"] for r in results
                                              if r["setting"] == setting}
         for setting in args.settings},
        args.output / "compare.png",
    )
    print(text, end="")
    return results


if __name__ == "__main__":
    main()
