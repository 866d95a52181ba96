"""Handing tensors from one CUDA stream to another: what one thread wrote on its stream,
another reads on its own (replicas, and autograd's per-device threads)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def stream_event(like: torch.Tensor) -> torch.cuda.Event | None:
    """For tensors another thread (another replica, or autograd's thread for another device)
    will read: an event on the current stream of ``like``'s device, recorded after everything
    that wrote them; None on the CPU, where an op is done when it returns."""
    if not like.is_cuda:
        return None
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(like.device))
    return ready


def wait_for(ready: torch.cuda.Event | None, tensors: Sequence[torch.Tensor]) -> None:
    """Make this thread's current streams wait for ``ready`` before reading ``tensors``, and
    tell the caching allocator they are used there (their memory is not reused before those
    streams are done with them). Nothing on the CPU."""
    if ready is None:
        return
    for t in tensors:
        stream = torch.cuda.current_stream(t.device)
        stream.wait_event(ready)
        t.record_stream(stream)


