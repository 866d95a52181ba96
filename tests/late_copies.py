"""Small-gamma flags that reach the host late, as from a GPU, for tests on the CPU (where
``ChannelsAside`` reads each call's flags at once)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest

from encoding_syncbn.layer.inplace_policy import ChannelsAside


class _LateCopy:
    """Offered flags on their way to the host (``ChannelsAside._offer`` on a GPU: a copy to
    pinned memory and an event): landed where the test says, or once waited for."""

    def __init__(self, landing: dict) -> None:
        self.landing, self.waited = landing, False

    def synchronize(self) -> None:
        self.waited = True

    def query(self) -> bool:
        return self.waited or self.landing["now"]


@contextlib.contextmanager
def late_copies() -> Iterator[dict]:
    """``ChannelsAside`` with its offered flags landing on the host when ``landing["now"]``
    says (read at each poll): the flags as offered, copied. Yields ``landing``."""
    landing = {"now": False}

    def offer(self, small):
        self._host, self._ready = small.clone(), _LateCopy(landing)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(ChannelsAside, "_offer", offer)
        yield landing
