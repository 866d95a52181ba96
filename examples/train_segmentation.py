#!/usr/bin/env python
"""Train DeepLabV3 (dilated ResNet + ASPP) with synchronized / in-place activated BatchNorm.

With no arguments it trains a small model on the built-in synthetic shapes dataset on CPU,
through two simulated DataParallel replicas so the statistics really are synchronised, and
finishes in a few minutes. Examples::

    python examples/train_segmentation.py                      # synthetic, in-place ABN
    python examples/train_segmentation.py --norm bn            # per-replica BatchNorm baseline
    python examples/train_segmentation.py --norm syncbn --activation relu
    torchrun --nproc_per_node 2 examples/train_segmentation.py --distributed --replicas 2
    python examples/train_segmentation.py --data-root VOCdevkit/VOC2012 --image-size 321 \\
        --width 64 --blocks 2,2,2,2 --batch-size 16 --epochs 50 --lr 0.01

The network is written with plain ``nn.BatchNorm2d`` and converted with
``encoding_syncbn.convert_sync_batchnorm`` or ``encoding_syncbn.convert_inplace_abn``
(``--norm``); the activation is chosen separately (``--activation``). Several visible GPUs are
used through stock ``nn.DataParallel``; ``--distributed`` (under torchrun) runs one process per
``--replicas`` GPUs (nccl), or per CPU slot with gloo, each process driving its replicas with
DataParallel (simulated in threads on the CPU) inside DistributedDataParallel. The
SyncBatchNorm layers synchronise across replicas and processes at once, by themselves.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset, DistributedSampler, RandomSampler, Subset

_HERE = Path(__file__).resolve().parent
# Runnable from a source checkout: the helper package sits next to this file, and the library
# one folder up is used when it is not installed.
sys.path.insert(0, str(_HERE))
if importlib.util.find_spec("encoding_syncbn") is None:
    sys.path.append(str(_HERE.parent))

from segmentation.data import (  # noqa: E402
    DEFAULT_MAX_SHAPES,
    DEFAULT_SHAPE_SIZE,
    IGNORE_INDEX,
    SyntheticShapes,
    VOCSegmentation,
)
from segmentation.metrics import confusion_matrix, scores  # noqa: E402
from segmentation.model import (  # noqa: E402
    ACTIVATION_CHOICES,
    NORM_CHOICES,
    DeepLabV3,
    convert_norm,
)
from segmentation.plots import save_curves, save_predictions  # noqa: E402

from encoding_syncbn.testing import SimulatedDataParallel  # noqa: E402

CHECKPOINT_NAME = "checkpoint.pt"
EXPORT_NAME = "model.pt2"


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        msg = f"expected comma-separated integers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" only where the help does not already say what the default is."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if action.default is None or action.default is False or "default" in text:
            return text
        return super()._get_help_string(action)


def _float_pair(text: str) -> tuple[float, float]:
    try:
        low, high = (float(v) for v in text.split(","))
    except ValueError:
        msg = f"expected two comma-separated numbers, got {text!r}"
        raise argparse.ArgumentTypeError(msg) from None
    return low, high


def build_parser() -> argparse.ArgumentParser:
    """Command-line flags; the defaults are the quick synthetic CPU run."""
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=_HelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument("--norm", choices=NORM_CHOICES, default="inplace_abn",
                   help="normalisation: bn = nn.BatchNorm2d (per-replica statistics, what "
                        "plain DataParallel gives), syncbn = convert_sync_batchnorm (whole-batch "
                        "statistics), inplace_abn = convert_inplace_abn (synchronised and fused "
                        "in place with the leaky ReLU after it: one stored activation per pair)")
    g.add_argument("--activation", choices=ACTIVATION_CHOICES, default="leaky_relu",
                   help="activation after each normalisation, the same for every --norm "
                        "(inplace_abn needs leaky_relu: ReLU cannot be inverted)")
    g.add_argument("--width", type=int, default=16,
                   help="channels of the first ResNet stage; stages use 1x, 2x, 4x, 8x this "
                        "(64 = ResNet-18/34 widths)")
    g.add_argument("--blocks", type=_int_list, default=[1, 1, 1, 1],
                   help="basic blocks per ResNet stage, comma-separated (2,2,2,2 = ResNet-18, "
                        "3,4,6,3 = ResNet-34)")
    g.add_argument("--output-stride", type=int, choices=(8, 16), default=8,
                   help="input size / feature size; the last stages are dilated instead")
    g.add_argument("--aspp-rates", type=_int_list, default=None,
                   help="ASPP dilation rates, comma-separated (default: 6,12,18 at output "
                        "stride 16, 12,24,36 at 8)")

    g = p.add_argument_group("data")
    g.add_argument("--data-root", type=Path, default=None,
                   help="Pascal VOC 2012 folder (VOCdevkit/VOC2012 with JPEGImages, "
                        "SegmentationClass, ImageSets/Segmentation); omit for synthetic shapes")
    g.add_argument("--image-size", type=int, default=64,
                   help="synthetic image side, or VOC training crop / validation size")
    g.add_argument("--train-images", type=int, default=768,
                   help="synthetic training set size (ignored for VOC)")
    g.add_argument("--val-images", type=int, default=128,
                   help="synthetic validation set size (ignored for VOC)")
    g.add_argument("--max-shapes", type=int, default=DEFAULT_MAX_SHAPES,
                   help="synthetic: at most this many shapes per image (at least one)")
    g.add_argument("--shape-size", type=_float_pair, default=",".join(map(str, DEFAULT_SHAPE_SIZE)),
                   help="synthetic: range of the shapes' radius as fractions of the image side, "
                        "MIN,MAX")
    g.add_argument("--workers", type=int, default=None,
                   help="DataLoader worker processes (default: 0 on CPU, where the cores are "
                        "busy training, 4 on GPU)")

    g = p.add_argument_group("optimisation")
    g.add_argument("--epochs", type=int, default=18, help="total training epochs")
    g.add_argument("--batch-size", type=int, default=16,
                   help="images per step and per process (split over DataParallel replicas)")
    g.add_argument("--lr", type=float, default=0.05,
                   help="peak SGD learning rate; a short linear warm-up then poly(0.9) decay")
    g.add_argument("--momentum", type=float, default=0.9, help="SGD (Nesterov) momentum")
    g.add_argument("--weight-decay", type=float, default=1e-4,
                   help="L2 weight decay (not applied to normalisation parameters and biases)")
    g.add_argument("--seed", type=int, default=0,
                   help="seed for initialisation, shuffling and the synthetic data")

    g = p.add_argument_group("parallelism")
    g.add_argument("--replicas", type=int, default=None,
                   help="DataParallel replicas per process. CPU: simulated replicas in threads, "
                        "2 (1 under --distributed). GPU: GPUs for nn.DataParallel, all visible "
                        "(1 under --distributed, where process LOCAL_RANK drives GPUs "
                        "LOCAL_RANK*R .. LOCAL_RANK*R+R-1) (default: as just said)")
    g.add_argument("--distributed", action="store_true",
                   help="one process per --replicas devices under torchrun: gloo on CPU, nccl "
                        "on GPU, DistributedSampler and DistributedDataParallel around the "
                        "(simulated) DataParallel replicas")
    g.add_argument("--threads", type=int, default=None,
                   help="torch intra-op threads per replica thread on CPU (default: the "
                        "available cores divided among replicas and local processes)")

    g = p.add_argument_group("output")
    g.add_argument("--output", type=Path, default=Path("runs/segmentation"),
                   help=f"folder for {CHECKPOINT_NAME} (written every epoch), curves.png and "
                        "predictions.png")
    g.add_argument("--resume", type=Path, default=None,
                   help="checkpoint to continue from (model, optimiser, epoch and history)")
    g.add_argument("--num-vis", type=int, default=4,
                   help="validation samples shown in predictions.png")
    g.add_argument("--no-progress", action="store_true", help="hide the per-epoch progress bar")
    g.add_argument("--export", action="store_true",
                   help=f"also write {EXPORT_NAME}: the trained model in evaluation as a "
                        "torch.export program (plain ATen ops, any batch size), which runs "
                        "without encoding_syncbn (torch.export.load) and converts to ONNX")
    return p


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """Parse and cross-check the flags."""
    p = build_parser()
    args = p.parse_args(argv)
    if args.replicas is not None and args.replicas < 1:
        p.error("--replicas must be at least 1")
    if args.batch_size < 1:
        p.error(f"--batch-size must be at least 1, got {args.batch_size}")
    if len(args.blocks) != 4 or min(args.blocks) < 1:
        p.error(f"--blocks takes four positive counts, one a ResNet stage, got "
                f"{','.join(map(str, args.blocks))}")
    if args.norm == "inplace_abn" and args.activation != "leaky_relu":
        p.error(f"--norm inplace_abn needs --activation leaky_relu, got {args.activation} "
                "(the in-place layer rebuilds its input from its output: ReLU is not invertible)")
    return args


class Runtime:
    """Where this process runs: device, rank and world size, and the replicas it drives.

    ``device_ids`` are this process's GPUs (the first is ``device``, where DataParallel gathers),
    empty on the CPU, where ``replicas`` threads simulate DataParallel.
    """

    def __init__(self, args: argparse.Namespace) -> None:
        self.distributed = args.distributed
        cuda = torch.cuda.is_available()
        gpus = torch.cuda.device_count() if cuda else 0
        if self.distributed:
            if "RANK" not in os.environ:
                raise SystemExit("--distributed needs torchrun (RANK/WORLD_SIZE are not set)")
            local_rank = int(os.environ.get("LOCAL_RANK", 0))
            self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
            self.replicas = args.replicas or 1
            first = local_rank * self.replicas
            if cuda and first + self.replicas > gpus:
                raise SystemExit(
                    f"--replicas {self.replicas} GPUs per process for {self.local_world_size} "
                    f"local processes needs {self.local_world_size * self.replicas} GPUs, "
                    f"this node has {gpus}"
                )
            self.device_ids = list(range(first, first + self.replicas)) if cuda else []
            self.device = torch.device("cuda", first) if cuda else torch.device("cpu")
            if cuda:
                torch.cuda.set_device(self.device)
            dist.init_process_group("nccl" if cuda else "gloo")
            self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        else:
            self.rank, self.world_size, self.local_world_size = 0, 1, 1
            self.replicas = min(args.replicas or gpus, gpus) if cuda else args.replicas or 2
            self.device_ids = list(range(self.replicas)) if cuda else []
            self.device = torch.device("cuda", 0) if cuda else torch.device("cpu")
        if self.device.type == "cpu":
            # Each replica thread runs its own intra-op thread team; more threads than cores in
            # total only adds contention.
            cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                os.cpu_count() or 1)
            threads = args.threads or max(1, cores // (self.replicas * self.local_world_size))
            torch.set_num_threads(threads)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: nn.Module) -> nn.Module:
        """The model as trained: (simulated) DataParallel over this process's replicas, inside
        DistributedDataParallel when distributed; or bare."""
        net = model
        if self.replicas > 1:
            if self.device.type == "cuda":
                net = nn.DataParallel(model, device_ids=self.device_ids)
            else:
                net = SimulatedDataParallel(model, self.replicas)
        if self.distributed:
            # DDP takes device_ids only for a module on one device that it runs itself; around
            # DataParallel (which scatters the batch) it gets None. It all-reduces the gradients
            # that DataParallel's backward summed onto the module's own parameters.
            ids = [self.device.index] if self.device.type == "cuda" and self.replicas == 1 else None
            net = nn.parallel.DistributedDataParallel(net, device_ids=ids)
        return net

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum over processes (identity when not distributed)."""
        if self.distributed:
            # nccl reduces device tensors only; gloo takes CPU ones.
            work = tensor.to(self.device)
            dist.all_reduce(work)
            return work.cpu()
        return tensor


def build_datasets(args: argparse.Namespace) -> tuple[Dataset, Dataset, Sequence[str]]:
    """Training set, validation set and class names."""
    if args.data_root is not None:
        try:
            train = VOCSegmentation(args.data_root, "train", args.image_size)
            val = VOCSegmentation(args.data_root, "val", args.image_size)
        except (FileNotFoundError, ValueError) as err:
            # A usage error: the message names what is missing, a traceback adds nothing.
            raise SystemExit(f"error: {err}") from None
    else:
        shapes = {"max_shapes": args.max_shapes, "shape_size": args.shape_size}
        try:
            train = SyntheticShapes(args.train_images, args.image_size, args.seed, "train",
                                    **shapes)
            val = SyntheticShapes(args.val_images, args.image_size, args.seed, "val", **shapes)
        except ValueError as err:
            raise SystemExit(f"error: {err}") from None
    return train, val, train.classes


def learning_rate(args: argparse.Namespace, step: int, total_steps: int) -> float:
    """Linear warm-up over the first 3% of steps, then DeepLab's poly(0.9) decay."""
    warmup = max(1, int(0.03 * total_steps))
    if step < warmup:
        return args.lr * (step + 1) / warmup
    return args.lr * (1 - (step - warmup) / max(1, total_steps - warmup)) ** 0.9


def make_optimizer(model: nn.Module, args: argparse.Namespace) -> torch.optim.Optimizer:
    """SGD; weight decay only on conv weights (decaying BN scales and biases only hurts)."""
    decay = [p for p in model.parameters() if p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.ndim <= 1]
    groups = [
        {"params": decay, "weight_decay": args.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.SGD(groups, lr=args.lr, momentum=args.momentum, nesterov=True)


def model_config(args: argparse.Namespace, num_classes: int) -> dict:
    """What a checkpoint must match to be loaded into this run's model."""
    return {
        "num_classes": num_classes, "norm": args.norm, "activation": args.activation,
        "width": args.width,
        "blocks": list(args.blocks), "output_stride": args.output_stride,
        "aspp_rates": None if args.aspp_rates is None else list(args.aspp_rates),
    }


class PeakMemory:
    """Peak memory of training above what the process held before its first step, in MiB.

    CUDA: tensors allocated on this process's devices (``max_memory_allocated``), summed.
    CPU: the process's peak resident set size (``ru_maxrss``, allocator slack included) minus its
    resident set size before the first step; a peak over the process's life so far, so only the
    first epoch's figure is the training steps' alone (later ones include the validations).
    """

    def __init__(self, rt: Runtime) -> None:
        self.devices = rt.device_ids
        if self.devices:
            self.base = sum(torch.cuda.memory_allocated(d) for d in self.devices)
            for d in self.devices:
                torch.cuda.reset_peak_memory_stats(d)
        else:
            # Linux: the second field of statm is the resident set size in pages.
            pages = int(Path("/proc/self/statm").read_text().split()[1])
            self.base = pages * os.sysconf("SC_PAGE_SIZE")

    def peak_mib(self) -> float:
        if self.devices:
            peak = sum(torch.cuda.max_memory_allocated(d) for d in self.devices)
        else:
            import resource

            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
        return max(0, peak - self.base) / 2**20


def train_one_epoch(
    model: nn.Module, loader: DataLoader, optimizer: torch.optim.Optimizer,
    args: argparse.Namespace, rt: Runtime, epoch: int,
) -> float:
    """One pass over the training set; returns the mean loss over all processes' images."""
    model.train()
    total_steps = args.epochs * len(loader)
    loss_sum = torch.zeros(2, dtype=torch.float64)  # (sum of per-image loss, images)
    bar = None
    if rt.is_main and not args.no_progress:
        from tqdm import tqdm  # only for the progress bar: --help and --no-progress need none

        bar = tqdm(loader, desc=f"epoch {epoch + 1}/{args.epochs}", unit="batch", leave=False,
                   dynamic_ncols=True)
    start = time.perf_counter()
    for step, (images, targets) in enumerate(bar if bar is not None else loader):
        lr = learning_rate(args, epoch * len(loader) + step, total_steps)
        for group in optimizer.param_groups:
            group["lr"] = lr
        images = images.to(rt.device, non_blocking=True)
        targets = targets.to(rt.device, non_blocking=True)
        logits = model(images)
        # The gathered output lives on the first device; the targets were moved there too.
        loss = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()

        n = images.shape[0]
        loss_sum += torch.tensor([loss.item() * n, n], dtype=torch.float64)
        if bar is not None:
            rate = (step + 1) * n * rt.world_size / (time.perf_counter() - start)
            bar.set_postfix(loss=f"{loss_sum[0].item() / loss_sum[1].item():.4f}",
                            lr=f"{lr:.4f}", img_s=f"{rate:.1f}")
    if bar is not None:
        bar.close()
    loss_sum = rt.all_reduce(loss_sum)
    return (loss_sum[0] / loss_sum[1]).item()


@torch.no_grad()
def evaluate(
    model: nn.Module, loader: DataLoader, num_classes: int, rt: Runtime
) -> dict[str, float]:
    """Pixel accuracy and mIoU over the whole validation set (all processes' shards)."""
    model.eval()
    confusion = torch.zeros(num_classes, num_classes, dtype=torch.int64)
    for images, targets in loader:
        preds = model(images.to(rt.device)).argmax(1)
        confusion += confusion_matrix(preds, targets.to(preds.device), num_classes)
    return scores(rt.all_reduce(confusion))


def save_checkpoint(path: Path, state: dict) -> None:
    """Write atomically, so an interrupted save never leaves a truncated checkpoint behind."""
    tmp = path.with_suffix(".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(path: Path, config: dict) -> dict:
    """Load a checkpoint written by this script and check it fits the model being built."""
    if not path.is_file():
        raise SystemExit(f"--resume: no checkpoint at {path}")
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("config") != config:
        raise SystemExit(
            f"--resume: {path} was trained with {state.get('config')}, "
            f"but this run builds {config}; pass the same model flags (--norm, --activation, "
            "--width, --blocks, --output-stride, --aspp-rates) and a data set of as many "
            "classes"
        )
    return state


def save_figures(
    model: nn.Module, val_set: Dataset, history: list[dict], num_classes: int,
    args: argparse.Namespace, rt: Runtime,
) -> list[Path]:
    """curves.png and predictions.png in the output folder (main process only); the paths
    written."""
    save_curves(history, args.output / "curves.png")
    count = min(args.num_vis, len(val_set))
    if count == 0:
        return [args.output / "curves.png"]
    images, targets = zip(*(val_set[i] for i in range(count)))
    images, targets = torch.stack(images), torch.stack(targets)
    model.eval()
    with torch.no_grad():
        preds = model(images.to(rt.device)).argmax(1).cpu()
    save_predictions(images, targets, preds, num_classes, args.output / "predictions.png")
    return [args.output / "curves.png", args.output / "predictions.png"]


def main(argv: Sequence[str] | None = None) -> dict:
    """Train, validate every epoch, checkpoint, plot; returns the final validation scores."""
    args = parse_args(argv)
    rt = Runtime(args)
    try:
        return _run(args, rt)
    finally:
        if rt.distributed:
            dist.destroy_process_group()


def _run(args: argparse.Namespace, rt: Runtime) -> dict:
    torch.manual_seed(args.seed)
    train_set, val_set, classes = build_datasets(args)
    num_classes = len(classes)
    config = model_config(args, num_classes)

    # Written with plain nn.BatchNorm2d, converted as any user model would be (--norm).
    model = DeepLabV3(num_classes, args.activation, args.width, args.blocks,
                      args.output_stride, args.aspp_rates)
    model = convert_norm(model, args.norm).to(rt.device)
    optimizer = make_optimizer(model, args)
    start_epoch, history = 0, []
    if args.resume is not None:
        state = load_checkpoint(args.resume, config)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch, history = state["epoch"], state["history"]
        if start_epoch >= args.epochs and rt.is_main:
            print(f"--resume: {args.resume} has trained {start_epoch} epochs, --epochs "
                  f"{args.epochs}: nothing left to train (raise --epochs to go on)",
                  flush=True)
    net = rt.wrap(model)
    # Eval-mode BN needs no synchronisation, so each process scores its own shard with the bare
    # model (no DDP collectives); DataParallel still spreads the work over its devices.
    eval_net = model if rt.distributed else net

    workers = args.workers if args.workers is not None else (
        4 if rt.device.type == "cuda" else 0)
    if rt.distributed:
        train_sampler = DistributedSampler(train_set, seed=args.seed, drop_last=True)
        # Disjoint validation shards (no padding duplicates); confusion matrices are summed.
        val_set_local = Subset(val_set, range(rt.rank, len(val_set), rt.world_size))
    else:
        shuffle_gen = torch.Generator()
        train_sampler = RandomSampler(train_set, generator=shuffle_gen)
        val_set_local = val_set
    pin = rt.device.type == "cuda"
    # drop_last: a tiny last batch gives noisy batch statistics (and, unsynchronised, a chunk
    # of one image per replica).
    train_loader = DataLoader(train_set, args.batch_size, sampler=train_sampler,
                              num_workers=workers, pin_memory=pin, drop_last=True)
    val_loader = DataLoader(val_set_local, args.batch_size * 2, num_workers=workers,
                            pin_memory=pin)
    if len(train_loader) == 0:
        raise SystemExit(f"--batch-size {args.batch_size} exceeds the training set "
                         f"({len(train_set)} images per process)")

    if rt.is_main:
        args.output.mkdir(parents=True, exist_ok=True)
        params = sum(p.numel() for p in model.parameters())
        print(f"DeepLabV3 norm={args.norm} activation={args.activation} width={args.width} "
              f"blocks={args.blocks} "
              f"OS={args.output_stride} params={params / 1e6:.2f}M | device={rt.device} "
              f"replicas={rt.replicas} processes={rt.world_size} "
              f"threads={torch.get_num_threads()} | train={len(train_set)} "
              f"val={len(val_set)} classes={num_classes}", flush=True)

    memory = PeakMemory(rt)
    for epoch in range(start_epoch, args.epochs):
        if rt.distributed:
            train_sampler.set_epoch(epoch)
        else:
            # Reseeded per epoch: a resumed run sees the same order as an uninterrupted one.
            shuffle_gen.manual_seed(args.seed * 1000 + epoch)
        start = time.perf_counter()
        loss = train_one_epoch(net, train_loader, optimizer, args, rt, epoch)
        train_s, peak_mib = time.perf_counter() - start, memory.peak_mib()
        val = evaluate(eval_net, val_loader, num_classes, rt)
        history.append({"epoch": epoch + 1, "loss": loss, **val, "train_s": train_s,
                        "peak_mib": peak_mib})
        if rt.is_main:
            print(f"epoch {epoch + 1}/{args.epochs}  loss {loss:.4f}  "
                  f"pixel acc {val['pixel_acc']:.4f}  mIoU {val['miou']:.4f}  "
                  f"({train_s:.1f} s training, peak {peak_mib:.0f} MiB, "
                  f"{time.perf_counter() - start:.1f} s)", flush=True)
            save_checkpoint(args.output / CHECKPOINT_NAME, {
                "epoch": epoch + 1, "model": model.state_dict(),
                "optimizer": optimizer.state_dict(), "history": history, "config": config,
            })

    if not history:
        # --epochs 0: nothing was trained; score the initial model so the report still holds.
        history.append({"epoch": 0, "loss": math.nan,
                        **evaluate(eval_net, val_loader, num_classes, rt)})
    if rt.is_main:
        written = save_figures(model, val_set, history, num_classes, args, rt)
        if args.export:
            export_model(model, val_set, args.output / EXPORT_NAME)
            written.append(args.output / EXPORT_NAME)
        print(f"wrote {', '.join(map(str, written))}", flush=True)
        print(f"final mIoU: {history[-1]['miou']:.4f}", flush=True)
    return history[-1]


def export_model(model: nn.Module, val_set: Dataset, path: Path) -> None:
    """The evaluating model as a torch.export program with a dynamic batch: the synchronised
    layers record themselves in ATen ops, so the program needs no encoding_syncbn."""
    # Two images: export specialises a size of 1 (it would fix the batch there).
    images = [val_set[min(i, len(val_set) - 1)][0] for i in range(2)]
    example = torch.stack(images).to(next(model.parameters()).device)
    was_training = model.training
    model.eval()
    program = torch.export.export(model, (example,), dynamic_shapes=(
        {0: torch.export.Dim("batch", min=1, max=1024)},))
    model.train(was_training)
    torch.export.save(program, path)


if __name__ == "__main__":
    main()
    if dist.is_available() and dist.is_torchelastic_launched():
        # Under torchrun, DistributedDataParallel keeps gloo's worker threads alive past
        # destroy_process_group (torch 2.13), and a worker that releases a collective's tensor
        # while the interpreter shuts down aborts the process ("terminate called without an
        # active exception", SIGABRT) after all the output. Everything is written and the
        # process group destroyed by now: leave without the interpreter's shutdown.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)
