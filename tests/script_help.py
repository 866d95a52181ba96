"""``python SCRIPT --help`` for many scripts at the cost of one torch import (test_docs.py).

Run as ``python script_help.py ROOT OUT SCRIPT... -- OPTIONAL...``: marks the OPTIONAL packages
missing, imports torch, then runs each SCRIPT (a path under ROOT) with ``--help`` in a child
forked from this process (where the platform forks; else in a fresh interpreter), as
``python SCRIPT --help`` would run it, and writes its exit code, stdout and stderr to
``OUT/<i>.json`` (i: the script's position). A process per script would import torch once a
script, all at once: minutes on a loaded 2-core machine.
"""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path


def run_one(root: Path, script: str) -> None:
    """In this process: run ``script --help`` as ``python script --help`` would; exits."""
    sys.argv = [script, "--help"]
    sys.path[0:1] = [str((root / script).parent), str(root)]
    code = 0
    try:
        runpy.run_path(str(root / script), run_name="__main__")
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else (exit_.code is not None)
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def forked(root: Path, script: str) -> tuple[int, str, str]:
    """``script --help`` in a child of this process: (exit code, stdout, stderr)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        pid = os.fork()
        if pid == 0:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            run_one(root, script)
        _, status = os.waitpid(pid, 0)
        out.seek(0)
        err.seek(0)
        return os.waitstatus_to_exitcode(status), out.read(), err.read()


def fresh(root: Path, script: str, optional: list[str]) -> tuple[int, str, str]:
    """``script --help`` in a fresh interpreter: (exit code, stdout, stderr)."""
    result = subprocess.run([sys.executable, __file__, "--one", str(root), script, *optional],
                            capture_output=True, text=True, cwd=root)
    return result.returncode, result.stdout, result.stderr


def mark_missing(optional: list[str]) -> None:
    for name in optional:
        sys.modules[name] = None  # as if not installed: an import raises ModuleNotFoundError


def main(argv: list[str]) -> None:
    if argv[0] == "--one":
        root, script, optional = Path(argv[1]), argv[2], argv[3:]
        mark_missing(optional)
        run_one(root, script)
    root, out = Path(argv[0]), Path(argv[1])
    split = argv.index("--")
    scripts, optional = argv[2:split], argv[split + 1:]
    mark_missing(optional)
    if hasattr(os, "fork"):
        import torch  # noqa: F401  (once, before the forks: each child has it imported)
    for i, script in enumerate(scripts):
        code, stdout, stderr = (forked(root, script) if hasattr(os, "fork")
                                else fresh(root, script, optional))
        (out / f"{i}.json").write_text(json.dumps([code, stdout, stderr]))


if __name__ == "__main__":
    main(sys.argv[1:])
