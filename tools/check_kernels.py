"""Ahead-of-time compile every Triton kernel specialisation the package launches; report resources.

    python tools/check_kernels.py --arch 80 90             # all: before a kernel change
    python tools/check_kernels.py --arch 80 90 --pairs     # CI's representative set

Needs no GPU. The specialisations come from
:func:`kernel_specialisations.launch_specialisations`, which plans
launches with the same helpers as the ops themselves (dtypes, layouts, every tile shape,
activations, saved input/output, finishing variants). Arguments are typed the way Triton's JIT would
type them (ints equal to 1 become constants, multiples of 16 carry a divisibility hint, tensors
are assumed 16-byte aligned). Each cubin is read with the ``cuobjdump --dump-resource-usage``
that Triton ships. Exit status 1 on any compile failure or any spill to local memory.
Triton's own cache makes a second run fast.

The whole set grows with every planned shape and tile: run it before a kernel change. CI
compiles ``--pairs``, a representative set whose size does not follow the number of plans: for
each kernel, a set of its specialisations (picked greedily, in the order planned) in which
every pair of choices that any planned specialisation makes occurs at least once; a choice is
one argument's typing (its pointer dtype, integer width, constant 1, divisibility hint) or one
constexpr's value. So each dtype meets each activation, layout, tile and split choice, each
integer typing meets each of those, and so on; a new shape adds to the set only where it brings
a choice or a pair of choices no plan made before.
"""

from __future__ import annotations

import os

# The kernels must be real JIT functions, not the CPU interpreter's stand-ins.
os.environ.pop("TRITON_INTERPRET", None)

import argparse  # noqa: E402
import itertools  # noqa: E402
import multiprocessing  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402
from typing import NamedTuple  # noqa: E402

import torch  # noqa: E402
import triton  # noqa: E402
from kernel_specialisations import launch_specialisations  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from encoding_syncbn import compat  # noqa: E402
from encoding_syncbn.kernels.triton.plan import (  # noqa: E402
    COMPILE_OPTIONS,
    Launch,
    Target,
    programs_per_sm,
)

# SM counts of the reference parts (A100, H100 SXM): only the grid planning depends on them.
_SM_COUNT = {80: 108, 86: 84, 89: 128, 90: 132}

_PTR_TYPES = {torch.float32: "*fp32", torch.float16: "*fp16", torch.bfloat16: "*bf16",
              torch.float64: "*fp64", torch.uint8: "*u8", torch.int32: "*i32",
              torch.int64: "*i64"}
_DIVISIBILITY = [["tt.divisibility", 16]]
_RESOURCE = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")


class Spec(NamedTuple):
    kernel: object
    label: str
    signature: dict
    constexprs: dict
    attrs: dict
    num_warps: int


class Row(NamedTuple):
    kernel: str
    label: str
    arch: int
    registers: int
    spills: int
    shared: int
    programs: int  # resident on one SM, as registers and threads allow
    error: str


def launch_spec(label: str, launch: Launch) -> Spec:
    """Type a planned launch's arguments as Triton's JIT specialises them."""
    kernel = launch.kernel
    signature, constexprs, attrs = {}, {}, {}
    for i, (param, value) in enumerate(zip(kernel.params, launch.args)):
        name = param.name
        if isinstance(value, torch.Tensor):
            signature[name] = _PTR_TYPES[value.dtype]
            attrs[(i,)] = _DIVISIBILITY
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            if value == 1:
                signature[name], constexprs[name] = "constexpr", 1
                continue
            signature[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
            if value % 16 == 0:
                attrs[(i,)] = _DIVISIBILITY
        elif isinstance(value, float):
            signature[name] = param.annotation_type or "fp32"
        else:
            raise TypeError(f"{kernel.__name__}: cannot type argument {name}={value!r}")
    for name, value in launch.constexprs.items():
        signature[name], constexprs[name] = "constexpr", value
    return Spec(kernel, label, signature, constexprs, attrs, launch.num_warps)


def _key(spec: Spec) -> tuple:
    return (spec.kernel.__name__, tuple(sorted(spec.signature.items())),
            tuple(sorted((k, str(v)) for k, v in spec.constexprs.items())),
            tuple(sorted(spec.attrs)))


def specialisations(arch: int) -> list[Spec]:
    """Distinct specialisations for one architecture (some recur across plans)."""
    target = Target(False, _SM_COUNT.get(arch, 132))
    seen, specs = set(), []
    for label, launch in launch_specialisations(target):
        spec = launch_spec(label, launch)
        if _key(spec) not in seen:
            seen.add(_key(spec))
            specs.append(spec)
    return specs


def _choices(spec: Spec) -> list[tuple[str, str, bool]]:
    """Each argument's typing in ``spec``: (name, type or constexpr value, divisibility hint)."""
    return [(name, str(spec.constexprs[name]) if kind == "constexpr" else kind, (i,) in spec.attrs)
            for i, (name, kind) in enumerate(spec.signature.items())]


def covering(specs: list[Spec], size: int = 2) -> list[Spec]:
    """Per kernel, specialisations of ``specs`` in which every combination of ``size`` choices
    (argument typings, :func:`_choices`) that some specialisation of that kernel makes occurs
    (``size`` 2: every pair, CI's ``--pairs``): each step takes the first one that covers the
    most combinations not covered yet."""
    kernels: dict[str, list[Spec]] = {}
    for spec in specs:
        kernels.setdefault(spec.kernel.__name__, []).append(spec)
    chosen = []
    for group in kernels.values():
        ids: dict[tuple, int] = {}
        combinations = [{ids.setdefault(combination, len(ids))
                         for combination in itertools.combinations(_choices(spec), size)}
                        for spec in group]
        uncovered = set(ids.values())
        while uncovered:
            best = max(range(len(group)), key=lambda i: len(combinations[i] & uncovered))
            uncovered -= combinations[best]
            chosen.append(group[best])
    return chosen


def compile_spec(spec: Spec, arch: int):
    """``spec`` compiled for ``sm_<arch>`` as the launcher compiles it (Triton's compiled
    kernel: ``asm["cubin"]``, ``metadata``)."""
    source = ASTSource(fn=spec.kernel, signature=spec.signature, constexprs=spec.constexprs,
                       attrs=spec.attrs)
    return triton.compile(source, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": spec.num_warps, **COMPILE_OPTIONS})


def cuobjdump(cubin: bytes, option: str) -> str:
    """What ``cuobjdump <option>`` prints for ``cubin`` (``-sass``, ``--dump-resource-usage``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([compat.cuobjdump_path(), option, f.name],
                              capture_output=True, text=True, check=True).stdout


def _resources(cubin: bytes) -> tuple[int, int, int]:
    """(registers, spill bytes (stack + local), shared bytes) from cuobjdump."""
    out = cuobjdump(cubin, "--dump-resource-usage")
    match = _RESOURCE.search(out)
    if match is None:
        raise RuntimeError(f"unexpected cuobjdump output:\n{out}")
    regs, stack, shared, local = map(int, match.groups())
    return regs, stack + local, shared


# Work items for the pool: forked workers inherit this list instead of unpickling kernels.
_WORK: list[tuple[int, Spec]] = []


def _compile(index: int) -> Row:
    arch, spec = _WORK[index]
    name = spec.kernel.__name__
    try:
        compiled = compile_spec(spec, arch)
        regs, spills, shared = _resources(compiled.asm["cubin"])
        # Triton's own shared-memory plan (reductions) adds to the static amount.
        return Row(name, spec.label, arch, regs, spills, max(shared, compiled.metadata.shared),
                   programs_per_sm(regs, spec.num_warps), "")
    except Exception as exc:  # report every failure, keep compiling the rest
        return Row(name, spec.label, arch, 0, 0, 0, 0, f"{type(exc).__name__}: {exc}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90],
                        help="compute capabilities, e.g. 80 90")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                        help="parallel compiler processes")
    parser.add_argument("--kernel", action="append", default=None,
                        help="only kernels whose name contains this (repeatable)")
    parser.add_argument("--limit", type=int, default=None,
                        help="at most this many specialisations per kernel and arch (smoke test)")
    parser.add_argument("--pairs", action="store_true",
                        help="only a representative set: every pair of choices a kernel's "
                             "specialisations make, covered once (CI's; see the docstring)")
    parser.add_argument("--summary", action="store_true",
                        help="print one line per kernel and arch instead of every specialisation")
    args = parser.parse_args(argv)

    start = time.perf_counter()
    for arch in args.arch:
        per_kernel: dict[str, int] = {}
        specs = specialisations(arch)
        for spec in covering(specs) if args.pairs else specs:
            name = spec.kernel.__name__
            if args.kernel and not any(k in name for k in args.kernel):
                continue
            if args.limit is not None and per_kernel.get(name, 0) >= args.limit:
                continue
            per_kernel[name] = per_kernel.get(name, 0) + 1
            _WORK.append((arch, spec))
    if not _WORK:
        print("no specialisation selected", file=sys.stderr)
        return 1

    jobs = max(1, min(args.jobs, len(_WORK)))
    if jobs == 1:
        rows = [_compile(i) for i in range(len(_WORK))]
    else:
        with multiprocessing.get_context("fork").Pool(jobs) as pool:
            rows = pool.map(_compile, range(len(_WORK)), chunksize=4)

    failures = [r for r in rows if r.error]
    spills = [r for r in rows if not r.error and r.spills]
    if args.summary:
        _print_summary(rows)
    else:
        _print_table(rows)
    for r in failures:
        print(f"COMPILE FAILURE {r.kernel} [{r.label}] sm_{r.arch}: {r.error}", file=sys.stderr)
    for r in spills:
        print(f"SPILL {r.kernel} [{r.label}] sm_{r.arch}: {r.spills} bytes", file=sys.stderr)
    print(f"{len(rows)} specialisations, {len(failures)} failed, {len(spills)} spilling, "
          f"{time.perf_counter() - start:.1f}s with {jobs} process(es)")
    return 1 if failures or spills else 0


def _print_table(rows: list[Row]) -> None:
    width = max(len(r.label) for r in rows)
    print(f"{'kernel':<26} {'specialisation':<{width}} {'arch':>6} {'regs':>5} {'spill':>6} "
          f"{'smem':>6} {'per SM':>6}")
    for r in rows:
        status = ("FAILED" if r.error else
                  f"{r.registers:>5} {r.spills:>6} {r.shared:>6} {r.programs:>6}")
        print(f"{r.kernel:<26} {r.label:<{width}} {'sm_' + str(r.arch):>6} {status}")


def _print_summary(rows: list[Row]) -> None:
    print(f"{'kernel':<26} {'arch':>6} {'variants':>8} {'regs min-max':>13} {'spills':>7} "
          f"{'smem max':>9} {'per SM min-max':>14} {'failed':>6}")
    groups: dict[tuple[str, int], list[Row]] = {}
    for r in rows:
        groups.setdefault((r.kernel, r.arch), []).append(r)
    for (kernel, arch), group in groups.items():
        ok = [r for r in group if not r.error]
        regs = f"{min(r.registers for r in ok)}-{max(r.registers for r in ok)}" if ok else "-"
        programs = (f"{min(r.programs for r in ok)}-{max(r.programs for r in ok)}" if ok
                    else "-")
        print(f"{kernel:<26} {'sm_' + str(arch):>6} {len(group):>8} {regs:>13} "
              f"{sum(r.spills for r in ok):>7} {max((r.shared for r in ok), default=0):>9} "
              f"{programs:>14} {len(group) - len(ok):>6}")


if __name__ == "__main__":
    sys.exit(main())
