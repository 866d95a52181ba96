"""Code run by a fresh interpreter on this checkout, for what one that has imported nothing
yet does: import-time choices, a process's first call, compiled kernels where the suite
interprets them."""

from __future__ import annotations

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_fresh(code: str, *args: str, env: dict[str, str | None] | None = None,
              timeout: int = 300):
    """``python -c code args`` in the checkout, the checkout first on ``PYTHONPATH``, with
    this process's environment changed by ``env`` (None: a variable removed); it must exit
    0. The last line it prints, parsed as JSON."""
    environment = dict(os.environ)
    for name, value in (env or {}).items():
        if value is None:
            environment.pop(name, None)
        else:
            environment[name] = value
    environment["PYTHONPATH"] = os.pathsep.join(
        filter(None, [ROOT, environment.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env=environment, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])
