"""Forgetting what the Triton backend memoised, for a run that changes a planning constant.

The planners memoise their answers (``functools.lru_cache``) by the input's geometry, dtype
and target, not by the constants of ``kernels/triton/plan.py`` they read (tile sizes, warps,
programs an SM, the compile options), which stay as shipped in a user's process; the direct
launches keep each specialisation's compiled kernel, compiled with the options then set. A
test or a sweep that changes a constant calls :func:`forget_plans` after the change and again
after restoring it.
"""

from __future__ import annotations

import sys

_TRITON_BACKEND = "encoding_syncbn.kernels.triton."


def forget_plans() -> None:
    """Clear every ``functools.lru_cache`` the Triton backend's modules hold (the planners'
    memos, the launch target's) and the compiled kernels kept for direct launches."""
    from encoding_syncbn.kernels.triton import launch

    for name, module in list(sys.modules.items()):
        if name.startswith(_TRITON_BACKEND) and module is not None:
            for value in list(vars(module).values()):
                clear = getattr(value, "cache_clear", None)
                if callable(clear):
                    clear()
    launch.forget_compiled()
