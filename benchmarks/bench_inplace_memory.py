"""How much activation memory ``convert_inplace_abn`` saves on real models (CPU).

    python benchmarks/bench_inplace_memory.py [--batch 8] [--size 128] [--record]

For each model (built with LeakyReLU where it had ReLU, random weights), one training step
(forward, backward) in float32, three ways: the original model, ``convert_sync_batchnorm``
(synchronised, out of place) and ``convert_inplace_abn``. Measured: the bytes autograd keeps
for backward, counted by a saved-tensors hook at the end of the forward: every distinct
storage packed for backward, the model's parameters excluded. That is the activation memory a
training step holds at its peak (just before backward starts), exactly and independent of
allocator caching and of other processes; it is what In-Place ABN reduces. Peak RSS is not
used: on a shared CPU machine it moves by more than the effect.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import results
import torch
from torch import nn

# The model zoos, pytest (tests/third_party.py) and the package load after the flags, so
# that --help stays quick.
TESTS = os.path.join(os.path.dirname(__file__), "..", "tests")


def leaky(model: nn.Module) -> nn.Module:
    """``model`` with each ReLU replaced by its own LeakyReLU(0.01), same inplace flag."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.ReLU:
                setattr(module, name, nn.LeakyReLU(0.01, inplace=child.inplace))
    return model


def models() -> dict[str, nn.Module]:
    sys.path.insert(0, TESTS)
    from third_party import import_or_skip  # torchvision's CUDA-only ops: see there

    timm = import_or_skip("timm")
    torchvision = import_or_skip("torchvision")
    smp = import_or_skip("segmentation_models_pytorch")
    return {
        "timm resnet18 (act_layer=leaky_relu)":
            timm.create_model("resnet18", act_layer="leaky_relu"),
        "timm efficientnet_b0 (act_layer=leaky_relu)":
            timm.create_model("efficientnet_b0", act_layer="leaky_relu"),
        "torchvision resnet18 (ReLU -> LeakyReLU)": leaky(torchvision.models.resnet18()),
        "smp Unet resnet18 (ReLU -> LeakyReLU)":
            leaky(smp.Unet("resnet18", encoder_weights=None, classes=2)),
    }


def saved_bytes(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes of the distinct non-parameter storages saved for backward by one forward."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = model(x * 1)
    out = out if isinstance(out, torch.Tensor) else out[0]
    out.float().square().mean().backward()
    return sum(storages.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8,
                        help="images per training step (default: %(default)s)")
    parser.add_argument("--size", type=int, default=128,
                        help="height and width of each image (default: %(default)s)")
    results.add_arguments(parser)
    args = parser.parse_args()
    from encoding_syncbn import convert_inplace_abn, convert_sync_batchnorm

    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    rows = []
    for name, model in models().items():
        sizes = [saved_bytes(convert(copy.deepcopy(model)), x) / 2**20 for convert in
                 (lambda m: m, convert_sync_batchnorm, convert_inplace_abn)]
        rows.append([name, *(f"{size:.1f}" for size in sizes), f"{sizes[2] / sizes[0]:.2f}"])
    table = results.markdown_table(
        ["model", "original MiB", "convert_sync_batchnorm MiB", "convert_inplace_abn MiB",
         "in place / original"], rows)
    notes = (f"One training step, input {tuple(x.shape)} float32, random weights: the bytes "
             "autograd keeps for backward (distinct storages packed by a saved-tensors hook, "
             "parameters excluded).")
    print(notes + "\n\n" + table)
    results.record(args, "bench_inplace_memory.py", table, notes)


if __name__ == "__main__":
    main()
