"""Counting the Triton backend's launches where its ops hand them over, by every way they go."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def counted_launches() -> Iterator[list[str]]:
    """The names of the Triton kernels launched inside the block, in order, counted where the
    ops hand their launches over: ``ops._run`` (Triton's public launch, and the interpreter's)
    and, where they launch, ``ops.launch_prepared`` and ``ops.launch_direct`` (a repeat call's
    compiled kernels, called directly). Counting changes no launch's path."""
    from encoding_syncbn.kernels.triton import ops

    names: list[str] = []
    run, launch_prepared, launch_direct = ops._run, ops.launch_prepared, ops.launch_direct

    def counted_run(launches, device):
        names.extend(planned.kernel.fn.__name__ for planned in launches)
        return run(launches, device)

    def counting(launch):
        def counted(prepared, device, *launch_args):
            launched = launch(prepared, device, *launch_args)
            if launched:
                names.extend(prepared.kernels)
            return launched
        return counted

    ops._run = counted_run
    ops.launch_prepared, ops.launch_direct = counting(launch_prepared), counting(launch_direct)
    try:
        yield names
    finally:
        ops._run, ops.launch_prepared, ops.launch_direct = run, launch_prepared, launch_direct
