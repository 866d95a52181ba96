"""How much activation memory ``convert_inplace_abn`` saves on real models (CPU).

    python benchmarks/bench_inplace_memory.py [--batch 8] [--size 128]
        [--autocast {float16,bfloat16}] [--beta-over-gamma S] [--record]

For each model (built with LeakyReLU where it had ReLU, random weights), one training step
(forward, backward) in float32, or under ``torch.autocast`` in ``--autocast``'s dtype, three
ways: the original model, ``convert_sync_batchnorm`` (synchronised, out of place) and
``convert_inplace_abn``. ``--beta-over-gamma S`` sets each norm layer's beta to
``S * |gamma| * N(0, 1)`` per channel, a stand-in for trained parameters: in half precision an
in-place layer keeps aside the channels whose |beta| is large against |gamma| (their rebuilt
input would lose precision), and the table counts them. Measured: the bytes autograd keeps
for backward, counted by a saved-tensors hook at the end of the forward: every distinct
storage packed for backward, the model's parameters excluded. That is the activation memory a
training step holds at its peak (just before backward starts), exactly and independent of
allocator caching and of other processes; it is what In-Place ABN reduces. Peak RSS is not
used: on a shared CPU machine it moves by more than the effect. Beside it, what
``convert_inplace_abn(..., report=True, input_shape=...)`` estimates from shapes alone
before and after (float32: it does not model autocast), and the estimate's largest
relative error against the measurements.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys

import torch
from helpers import results
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


def spread_betas(model: nn.Module, ratio: float, gen: torch.Generator) -> nn.Module:
    """``model`` with each norm layer's beta set to ``ratio * |gamma| * N(0, 1)`` per channel."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.modules.batchnorm._NormBase) and module.affine:
                noise = torch.randn(module.bias.shape, generator=gen)
                module.bias.copy_(ratio * module.weight.abs() * noise)
    return model


def parameter_copy(tensor: torch.Tensor, parameters: set[int]) -> bool:
    """Whether ``tensor`` is a cast of a parameter (autocast's half-precision weights), by its
    autograd history: a copy whose input is the parameter itself."""
    node = tensor.grad_fn
    if node is None or type(node).__name__ != "ToCopyBackward0":
        return False
    return any(getattr(source, "variable", None) is not None
               and source.variable.untyped_storage().data_ptr() in parameters
               for source, _ in node.next_functions if source is not None)


def saved_bytes(model: nn.Module, x: torch.Tensor, autocast: torch.dtype | None) -> int:
    """Bytes of the distinct non-parameter storages saved for backward by one forward (under
    ``torch.autocast`` in ``autocast``'s dtype, unless None: the half-precision copies it makes
    of the parameters are not counted either)."""
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    storages: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters and not parameter_copy(tensor, parameters):
            storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    model.train()
    with (torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor),
          torch.autocast("cpu", dtype=autocast, enabled=autocast is not None)):
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
    parser.add_argument("--autocast", choices=["float16", "bfloat16"], default=None,
                        help="run the step under torch.autocast in this dtype "
                             "(default: float32, no autocast)")
    parser.add_argument("--beta-over-gamma", type=float, default=0.0, metavar="S",
                        help="set each norm's beta to S * |gamma| * N(0, 1) per channel "
                             "(default: %(default)s, the parameters as initialised)")
    results.add_arguments(parser)
    args = parser.parse_args()
    from encoding_syncbn import SyncBatchNorm, convert_inplace_abn, convert_sync_batchnorm
    from encoding_syncbn.layer.inplace_policy import gamma_limit, running_spread, small_gamma_mask

    autocast = getattr(torch, args.autocast) if args.autocast else None
    torch.manual_seed(0)
    x = torch.randn(args.batch, 3, args.size, args.size)
    rows = []
    for name, model in models().items():
        spread_betas(model, args.beta_over_gamma, torch.Generator().manual_seed(0))
        in_place, report = convert_inplace_abn(copy.deepcopy(model), report=True,
                                               input_shape=tuple(x.shape))
        sizes = [saved_bytes(converted, x, autocast) / 2**20 for converted in
                 (model, convert_sync_batchnorm(copy.deepcopy(model)), in_place)]
        estimate = [report.memory.before_bytes / 2**20, report.memory.after_bytes / 2**20]
        error = max(abs(e / m - 1) for e, m in zip(estimate, (sizes[0], sizes[2])))
        layers = [m for m in in_place.modules() if isinstance(m, SyncBatchNorm) and m.inplace]
        # As a single replica's layer chooses them (the limit with its margin), with the
        # running statistics' spread.
        limit = gamma_limit(with_margin=True)
        aside = sum(int(small_gamma_mask(m.weight, m.bias, limit, running_spread(
            m._running_of(m.running_var))).sum()) for m in layers)
        channels = sum(m.num_features for m in layers)
        rows.append([name, *(f"{size:.1f}" for size in sizes), f"{sizes[2] / sizes[0]:.2f}",
                     f"{aside} / {channels}",
                     *([f"{estimate[0]:.1f} / {estimate[1]:.1f}", f"{error:.1%}"]
                       if autocast is None else ["(float32 only)", ""])])
    table = results.markdown_table(
        ["model", "original MiB", "convert_sync_batchnorm MiB", "convert_inplace_abn MiB",
         "in place / original", "channels kept aside / in place",
         "estimated original / in place MiB", "estimate's error"], rows)
    dtype = f"under autocast {args.autocast}" if autocast else "float32"
    params = (f"each norm's beta = {args.beta_over_gamma:g} * |gamma| * N(0, 1)"
              if args.beta_over_gamma else "parameters as initialised")
    notes = (f"One training step, input {tuple(x.shape)} {dtype}, random weights, {params}: "
             "the bytes autograd keeps for backward (distinct storages packed by a "
             "saved-tensors hook, parameters excluded); the channels the in-place layers keep "
             "aside (their input saved: see the README's Limits); the report's estimate from "
             "shapes alone (convert_inplace_abn(report=True, input_shape=...)), and its "
             "largest relative error against the two measurements.")
    print(notes + "\n\n" + table)
    options = ([f"autocast {args.autocast}"] if autocast else []) + (
        [f"beta-over-gamma {args.beta_over_gamma:g}"] if args.beta_over_gamma else [])
    heading = "bench_inplace_memory.py" + (f" ({', '.join(options)})" if options else "")
    results.record(args, heading, table, notes)


if __name__ == "__main__":
    main()
