"""What torch.compile gives a converted model: graphs, breaks, time and peak memory.

    python benchmarks/bench_compile.py                   # CPU inductor, one thread
    python benchmarks/bench_compile.py --device cuda     # a GPU, when there is one

A net of ``--blocks`` conv (3x3, no bias) + ``nn.BatchNorm2d`` + ``nn.LeakyReLU(0.01)`` blocks
on a ``--shape`` float32 input (default (4, 3, 48, 48), 32 channels), converted by
``convert_inplace_abn`` (in-place ABN) and by ``convert_sync_batchnorm`` (out of place), each
compiled with a plain ``torch.compile(model)`` (default options, inductor) in the two ways a
compiled call can be traced (``modules.COMPILE_AS_FORMULA``: its formula in ATen ops, the
default, or the backend's opaque custom ops), against the plain net compiled and each net
eager; the in-place net also compiled out of place (``compiled_inplace.KEEP_ONLY_OUTPUT``
False: keeping its input, not only its output). Per variant:

- graphs and graph breaks of a training step and of evaluation (``torch._dynamo.explain``),
  after one compiled training step (an in-place layer's first compiled call, before it has
  counted the channels it keeps aside, runs out of place: see ``compiled_inplace``);
- forward+backward time of a training step, median [interquartile range] over ``--turns``
  turns, every variant taking turns (after compiling and two warm-up turns); the ratios are
  taken turn by turn against the compiled plain net and against the same net eager;
- peak memory of one training step (forward and backward), after warm-up: the growth of the
  process's peak resident memory (Linux VmHWM, reset through /proc/self/clear_refs) in a
  fresh process per variant whose allocator maps and unmaps every large block
  (``MALLOC_MMAP_THRESHOLD_``), so that the resident size follows the live tensors (CPU), or
  of ``torch.cuda.max_memory_allocated`` (GPU), in units of the net's activations (blocks x
  one conv output).

Prints the table (``--record``: into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from helpers import results

CHANNELS = 32
# name -> (converter, compiled, traced as the formula, in place keeping only the output)
VARIANTS = {
    "plain eager": (None, False, True, True),
    "plain compiled": (None, True, True, True),
    "inplace_abn eager": ("convert_inplace_abn", False, True, True),
    "inplace_abn compiled": ("convert_inplace_abn", True, True, True),
    "inplace_abn compiled, out of place": ("convert_inplace_abn", True, True, False),
    "inplace_abn compiled, custom ops": ("convert_inplace_abn", True, False, True),
    "sync_batchnorm eager": ("convert_sync_batchnorm", False, True, True),
    "sync_batchnorm compiled": ("convert_sync_batchnorm", True, True, True),
    "sync_batchnorm compiled, custom ops": ("convert_sync_batchnorm", True, False, True),
}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda (default: %(default)s)")
    parser.add_argument("--shape", type=int, nargs=4, default=[4, 3, 48, 48],
                        help="input shape N C H W (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=6,
                        help="conv + BN + leaky_relu blocks (default: %(default)s)")
    parser.add_argument("--turns", type=int, default=20,
                        help="timed turns of each variant (default: %(default)s)")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch intra-op threads on the CPU (default: %(default)s)")
    parser.add_argument("--memory-of", help=argparse.SUPPRESS)  # the child process
    results.add_arguments(parser)
    return parser.parse_args()


def build(name: str, args: argparse.Namespace, device):
    """The variant's model (compiled where it says), its input and output gradient."""
    import torch
    from torch import nn

    import encoding_syncbn
    from encoding_syncbn.conversions.fuse import convert_inplace_abn
    from encoding_syncbn.layer import compiled_inplace, modules

    converter, compiled, formula, only_output = VARIANTS[name]
    torch.manual_seed(0)
    layers, channels = [], args.shape[1]
    for _ in range(args.blocks):
        layers += [nn.Conv2d(channels, CHANNELS, 3, padding=1, bias=False),
                   nn.BatchNorm2d(CHANNELS), nn.LeakyReLU(0.01)]
        channels = CHANNELS
    model = nn.Sequential(*layers)
    if converter == "convert_inplace_abn":
        model = convert_inplace_abn(model)
    elif converter == "convert_sync_batchnorm":
        model = encoding_syncbn.convert_sync_batchnorm(model)
    model = model.to(device)
    x = torch.randn(args.shape, device=device)
    grad = torch.randn(args.shape[0], CHANNELS, *args.shape[2:], device=device)
    if not compiled:
        return model, x, grad
    compiled_model = torch.compile(model)

    def run(inp):
        # Traced (at the first call) and run with the variant's way of tracing.
        modules.COMPILE_AS_FORMULA = formula
        compiled_inplace.KEEP_ONLY_OUTPUT = only_output
        return compiled_model(inp)

    return run, x, grad


def graphs(name: str, args: argparse.Namespace, device) -> str:
    """``"graphs/breaks"`` of a training step and of evaluation, as explain counts them."""
    import torch

    from encoding_syncbn.layer import compiled_inplace, modules

    converter, compiled, formula, only_output = VARIANTS[name]
    if not compiled:
        return ""
    modules.COMPILE_AS_FORMULA = formula
    compiled_inplace.KEEP_ONLY_OUTPUT = only_output
    counts = []
    for training in (True, False):
        torch._dynamo.reset()
        model, x, grad = build(name.replace("compiled", "eager").split(",")[0], args, device)
        # A compiled training step first: the graphs counted are those of the steps after
        # it, where an in-place layer knows how many channels it keeps aside.
        step(torch.compile(model, backend="eager"), x, grad)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model.train(training))(x)
        counts.append(f"{explained.graph_count}/{explained.graph_break_count}")
    torch._dynamo.reset()
    return " train, ".join(counts) + " eval"


def step(run, x, grad) -> None:
    x = x.detach().requires_grad_()
    run(x * 1).backward(grad)


def child_memory(name: str, args: argparse.Namespace) -> None:
    """In a fresh process: the peak RSS growth (bytes) of one training step, as JSON."""
    import torch

    torch.set_num_threads(args.threads)
    run, x, grad = build(name, args, torch.device("cpu"))
    for _ in range(3):  # compiled, and every one-time allocation made
        step(run, x, grad)
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # resets the peak (VmHWM) to the current resident size
    before = _status_kib("VmRSS")
    step(run, x, grad)
    print(json.dumps({"growth": (_status_kib("VmHWM") - before) * 1024}))


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"no {field} in /proc/self/status")


def memory(name: str, args: argparse.Namespace, device) -> int:
    """Peak memory growth (bytes) of one training step of the variant."""
    if device.type == "cpu":
        command = [sys.executable, __file__, "--memory-of", name, "--threads",
                   str(args.threads), "--blocks", str(args.blocks), "--shape",
                   *map(str, args.shape)]
        # Large blocks mapped and unmapped one by one (glibc's threshold fixed): the resident
        # size follows the live tensors, not what the allocator kept from the warm-up.
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
        result = subprocess.run(command, capture_output=True, text=True, check=True, env=env)
        return json.loads(result.stdout.strip().splitlines()[-1])["growth"]
    import torch

    run, x, grad = build(name, args, device)
    for _ in range(3):
        step(run, x, grad)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    step(run, x, grad)
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - base


def main() -> None:
    args = parse_args()
    if args.memory_of:
        child_memory(args.memory_of, args)
        return
    # Imported after the flags are read, so that --help needs no torch.
    import torch
    from helpers.timing import forward_backward, median_iqr, take_turns

    device = torch.device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(args.threads)
    counted = {name: graphs(name, args, device) for name in VARIANTS}
    built = {name: build(name, args, device) for name in VARIANTS}

    def measure(name):
        run, x, grad = built[name]
        return lambda: forward_backward(lambda: run(x.detach().requires_grad_() * 1), grad,
                                        device)

    times = take_turns({name: measure(name) for name in VARIANTS}, args.turns)
    totals = {name: [sum(t) * 1e3 for t in values] for name, values in times.items()}
    peaks = {name: memory(name, args, device) for name in VARIANTS}
    activation = args.blocks * args.shape[0] * CHANNELS * args.shape[2] * args.shape[3] * 4

    def ratios(name: str, other: str) -> str:
        return median_iqr([a / b for a, b in zip(totals[name], totals[other])], 2)

    rows = []
    for name, (_, compiled, _, _) in VARIANTS.items():
        eager = name.split(" compiled")[0] + " eager"
        rows.append([
            name, counted[name], median_iqr(totals[name], 2),
            ratios(name, "plain compiled") if compiled else "",
            ratios(name, eager) if compiled else "",
            f"{peaks[name] / 2**20:.1f}", f"{peaks[name] / activation:.2f}",
            f"{peaks[name] / peaks['plain compiled']:.2f}",
        ])
    table = results.markdown_table(
        ["variant", "graphs/breaks", "fwd+bwd ms", "/ plain compiled (turn by turn)",
         "/ same net eager (turn by turn)", "peak MiB", "in activations",
         "peak / plain compiled"], rows)
    where = (f"CPU inductor, {torch.get_num_threads()} thread(s)" if device.type == "cpu"
             else "GPU inductor")
    kind = ("peak RSS growth (VmHWM), a fresh process per variant" if device.type == "cpu"
            else "growth of torch.cuda.max_memory_allocated")
    notes = (f"{args.blocks} blocks of conv 3x3 + BatchNorm2d + LeakyReLU(0.01), {CHANNELS} "
             f"channels, a {tuple(args.shape)} float32 input, {where}; plain "
             f"`torch.compile(model)`. Graphs/breaks: `torch._dynamo.explain` of a training "
             f"step and of evaluation, after one compiled training step. Time: a training "
             f"step's forward+backward, median [interquartile range] of {args.turns} turns, "
             f"all variants taking turns. Peak: "
             f"{kind} over one training step, in units of the net's activations "
             f"({activation / 2**20:.1f} MiB: the blocks' conv outputs). 'custom ops': "
             f"traced as the backend's opaque ops (`modules.COMPILE_AS_FORMULA = False`). 'out "
             f"of place': an in-place layer compiled keeping its input, as an in-place layer "
             f"did before it kept only its output (`compiled_inplace.KEEP_ONLY_OUTPUT = "
             f"False`).")
    print(notes + "\n\n" + table)
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else None
    results.record(args, f"bench_compile.py ({device.type})", table, notes, gpu)


if __name__ == "__main__":
    main()
