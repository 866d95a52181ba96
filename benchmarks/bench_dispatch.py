"""What calling an op through the torch.library dispatcher costs, against a direct call.

    python benchmarks/bench_dispatch.py

The layer's ops are registered as ``torch.library`` custom ops (so that tracers and
``torch.compile`` see them), but plain eager calls launch the kernels directly. This measures
what that saves per op call on this machine: a trivial custom op (its body returns
``torch.empty_like(x)``), the same op declared as mutating an argument (its body does
nothing), and the same Python function called directly. Each figure is microseconds per call,
from ``timeit``: the median of ``--repeats`` runs of ``--calls`` calls, with the range. Prints
the table (``--record``: into benchmarks/RESULTS.md too).
"""

from __future__ import annotations

import argparse
import timeit

from helpers import results


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=20000,
                        help="calls per timed run (default: %(default)s)")
    parser.add_argument("--repeats", type=int, default=7,
                        help="timed runs of each call (default: %(default)s)")
    results.add_arguments(parser)
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    # Imported after the flags are read, so that --help needs no torch.
    import torch
    from helpers.timing import median_range

    torch.set_num_threads(1)

    def body(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x)

    def body_(x: torch.Tensor, out: torch.Tensor) -> None:
        return None

    # Explicit schemas: torch is imported here, not at module scope where the inference of a
    # schema from the string annotations would look for it.
    functional = torch.library.custom_op("bench_dispatch::functional", mutates_args=(),
                                         schema="(Tensor x) -> Tensor")(body)
    functional.register_fake(body)
    torch.library.custom_op("bench_dispatch::mutating_", mutates_args=("out",),
                            schema="(Tensor x, Tensor(a!) out) -> ()")(body_)
    x = torch.zeros(8)
    cases = {"custom op": lambda: torch.ops.bench_dispatch.functional(x),
             "custom op that mutates an argument": lambda: torch.ops.bench_dispatch.mutating_(x, x),
             "the same function called directly": lambda: body(x)}
    rows = []
    for name, call in cases.items():
        micros = [seconds / args.calls * 1e6
                  for seconds in timeit.repeat(call, number=args.calls, repeat=args.repeats)]
        rows.append([name, median_range(micros, 2)])
    table = results.markdown_table(["call", "us per call, median [min, max]"], rows)
    notes = (f"One thread, an 8-element CPU tensor: microseconds per call, the median of "
             f"{args.repeats} `timeit` runs of {args.calls} calls [min, max over the runs]. The "
             f"difference between a custom op and the direct call is what an eager layer call "
             f"saves per op by launching its kernels directly.")
    print(notes + "\n\n" + table)
    results.record(args, "bench_dispatch.py (cpu)", table, notes)


if __name__ == "__main__":
    main()
