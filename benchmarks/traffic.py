"""Bytes each Triton kernel launch loads and stores, for one in-place BN + leaky_relu layer.

    python benchmarks/traffic.py [--shape 8 64 64 64] [--dtype float32]

Runs the layer (``SyncBatchNorm(C, activation="leaky_relu")``, backend "triton") forward and
backward on the CPU under Triton's interpreter, counting the bytes of the unmasked lanes of
every ``tl.load`` / ``tl.store``, and prints them per launch and in units of the activation's
size. The least the passes can move is 3 forward (stats read + normalise read/write) and 5
backward (reduction read of y, dy + dx pass read of y, dy and write of dx); per-channel vectors
and partial buffers add a fraction, so the script exits non-zero above 3.1 forward or 5.1
backward.
"""

from __future__ import annotations

import os

# Before triton is imported anywhere: the kernels must be built for the interpreter.
os.environ["TRITON_INTERPRET"] = "1"

import argparse  # noqa: E402
import time  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from contextlib import contextmanager  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

import encoding_syncbn  # noqa: E402

FORWARD_TARGET = 3.1
BACKWARD_TARGET = 5.1


class Launch:
    __slots__ = ("name", "grid", "loaded", "stored")

    def __init__(self, name: str, grid: tuple) -> None:
        self.name, self.grid, self.loaded, self.stored = name, grid, 0, 0


@contextmanager
def count_traffic() -> Iterator[list[Launch]]:
    """Record one :class:`Launch` per kernel launch with the bytes of its unmasked lanes."""
    from triton.runtime import interpreter  # triton is optional: imported after --help

    launches: list[Launch] = []
    builder = interpreter.interpreter_builder
    load, store = builder.create_masked_load, builder.create_masked_store
    run = interpreter.GridExecutor.__call__

    def lanes_bytes(ptrs, mask) -> int:
        itemsize = np.dtype(interpreter._get_np_dtype(ptrs.get_element_ty())).itemsize
        active = np.broadcast_to(mask.data, ptrs.data.shape)
        return int(np.count_nonzero(active)) * itemsize

    def counted_load(ptrs, mask, *args, **kwargs):
        launches[-1].loaded += lanes_bytes(ptrs, mask)
        return load(ptrs, mask, *args, **kwargs)

    def counted_store(ptrs, value, mask, *args, **kwargs):
        launches[-1].stored += lanes_bytes(ptrs, mask)
        return store(ptrs, value, mask, *args, **kwargs)

    def counted_run(executor, *args, **kwargs):
        grid = executor.grid if isinstance(executor.grid, tuple) else ()
        launches.append(Launch(executor.fn.__name__, grid))
        return run(executor, *args, **kwargs)

    builder.create_masked_load, builder.create_masked_store = counted_load, counted_store
    interpreter.GridExecutor.__call__ = counted_run
    try:
        yield launches
    finally:
        builder.create_masked_load, builder.create_masked_store = load, store
        interpreter.GridExecutor.__call__ = run


def report(title: str, launches: list[Launch], activation_bytes: int, target: float) -> bool:
    print(f"\n{title}")
    print(f"  {'kernel':<26} {'grid':>12} {'loaded':>14} {'stored':>14} {'x activation':>13}")
    total = 0
    for launch in launches:
        moved = launch.loaded + launch.stored
        total += moved
        grid = "x".join(map(str, launch.grid))
        print(f"  {launch.name:<26} {grid:>12} {launch.loaded:>14,} {launch.stored:>14,} "
              f"{moved / activation_bytes:>13.4f}")
    ratio = total / activation_bytes
    ok = ratio <= target
    print(f"  {'total':<26} {'':>12} {'':>14} {total:>14,} {ratio:>13.4f}  "
          f"(target <= {target}: {'ok' if ok else 'MISSED'})")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", type=int, nargs="+", default=[8, 64, 64, 64],
                        metavar="SIZE", help="the input's shape, N C [H W ...] "
                                             "(default: 8 64 64 64)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"],
                        help="the input's and the layer's dtype (default: %(default)s)")
    parser.add_argument("--channels-last", action="store_true",
                        help="a channels_last input (needs a 4-d --shape)")
    args = parser.parse_args()

    dtype = getattr(torch, args.dtype)
    shape = tuple(args.shape)
    encoding_syncbn.set_backend("triton")
    layer = encoding_syncbn.SyncBatchNorm(shape[1], activation="leaky_relu")
    assert layer.inplace, "the layer should run in place"
    layer.to(dtype)

    torch.manual_seed(0)
    leaf = torch.randn(shape, dtype=dtype, requires_grad=True)
    if args.channels_last:
        leaf = leaf.detach().to(memory_format=torch.channels_last).requires_grad_()
    dy = torch.randn_like(leaf)
    activation_bytes = leaf.numel() * leaf.element_size()
    print(f"input {shape} {args.dtype}"
          f"{' channels_last' if args.channels_last else ''}: one activation = "
          f"{activation_bytes:,} bytes")

    start = time.perf_counter()
    # A non-leaf input, so that the layer may overwrite it (copying the leaf is not counted:
    # it is no Triton launch).
    x = leaf * 1
    with count_traffic() as forward:
        y = layer(x)
    assert y.data_ptr() == x.data_ptr(), "the layer did not run in place"
    with count_traffic() as backward:
        y.backward(dy)
    elapsed = time.perf_counter() - start

    ok = report("forward", forward, activation_bytes, FORWARD_TARGET)
    ok &= report("backward", backward, activation_bytes, BACKWARD_TARGET)
    print(f"\n(interpreter run: {elapsed:.1f}s)")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
