"""A gloo process group on localhost for tests that spawn their ranks: the parent holds the
rendezvous store (so its port is free and stays the test's), each rank joins through it."""

from __future__ import annotations

import datetime
import os
import sys

import torch
import torch.distributed as dist

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)


def rendezvous(world: int) -> dist.TCPStore:
    """The parent's store, on a free port (``.port``), for ``world`` ranks."""
    return dist.TCPStore("127.0.0.1", 0, world, is_master=True, wait_for_workers=False,
                         timeout=COLLECTIVE_TIMEOUT)


def join(rank: int, world: int, port: int) -> None:
    """Join the parent's group as ``rank``: gloo over the loopback, one CPU thread a rank."""
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # localhost only
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=COLLECTIVE_TIMEOUT)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)
