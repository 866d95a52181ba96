"""Records a benchmark's table in ``benchmarks/RESULTS.md`` when asked, with what is needed
to redo it.

A benchmark prints its table; with ``--record`` it also writes it into RESULTS.md
(``--record PATH``: into another file), so that running a benchmark leaves the checkout as it
was. Each script owns one section of the file, under a ``## <heading>`` line (its file name,
and the device where it measures several): a recorded run replaces its section, or appends it
the first time, and leaves the other sections as they are. A section holds the exact command,
the date, the commit, the machine (CPU model and the cores this process may use, the GPU when
one was used), the Python / torch / triton versions, the script's notes and its markdown table.

A script uses it as::

    parser = argparse.ArgumentParser(...)
    results.add_arguments(parser)                 # --record [PATH]
    args = parser.parse_args()
    ...
    table = results.markdown_table(["variant", "ms"], rows)
    print(table)
    results.record(args, "bench_x.py", table, notes="what is measured, relative to what")

Only the standard library is imported here, so that ``--help`` stays instant.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "RESULTS.md"
TITLE = (
    "# Benchmark results\n\n"
    "Written by the scripts in this folder when run with `--record` "
    "(benchmarks/helpers/results.py): each section is the last recorded run of its command, "
    "on the machine it names. Rerun the command to reproduce it, with `--record` to update "
    "it; a recorded run replaces its own section only.\n"
)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--record [PATH]``: whether, and where, the table is written besides being printed."""
    parser.add_argument("--record", nargs="?", type=Path, const=RESULTS, default=None,
                        metavar="PATH",
                        help="also write the table, with the command, date, commit and "
                             "machine, into this script's section of benchmarks/RESULTS.md "
                             "(or of PATH); without it the run only prints")


def cores() -> int:
    """The CPU cores this process may run on (its affinity mask, not the host's count)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
        os.cpu_count() or 1)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)  # reads metadata: imports nothing
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def machine(gpu: str | None = None) -> str:
    """One line: CPU model and usable cores, the GPU if one was used, the versions, and the
    1-minute load average."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    parts = [f"CPU: {cpu}, {cores()} cores"]
    if gpu:
        parts.append(f"GPU: {gpu}")
    torch = sys.modules.get("torch")
    parts += [f"Python {platform.python_version()}",
              f"torch {torch.__version__ if torch else _version('torch')}",
              f"triton {_version('triton')}"]
    if hasattr(os, "getloadavg"):  # a shared machine: how busy it was
        parts.append(f"load average {os.getloadavg()[0]:.1f} at the end")
    return ", ".join(parts)


def command() -> str:
    """The command line of this run, the script's path relative to the repository root and
    ``--record [PATH]`` left out: the command that reproduces the table."""
    script = Path(sys.argv[0]).resolve()
    try:
        script = script.relative_to(ROOT)
    except ValueError:
        pass
    argv, kept, skip = sys.argv[1:], [], False
    for i, arg in enumerate(argv):
        if skip:  # --record's PATH
            skip = False
        elif arg == "--record":  # PATH, if given, is the next word (no script has positionals)
            skip = i + 1 < len(argv) and not argv[i + 1].startswith("-")
        elif not arg.startswith("--record="):
            kept.append(arg)
    return shlex.join(["python", str(script), *kept])


def _commit() -> str:
    """The checkout's commit, "-dirty" if tracked files other than RESULTS.md differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True,
                              timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "--short", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".",
                      f":(exclude){RESULTS.relative_to(ROOT).as_posix()}")
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return (commit + ("-dirty" if changed else "")) if commit else "unknown"


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A markdown table; cells are written with ``str``, numbers right-aligned."""
    def numeric(cell: object) -> bool:
        return isinstance(cell, (int, float))

    align = ["---:" if rows and all(numeric(row[i]) for row in rows) else "---"
             for i in range(len(header))]
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(align) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def replace_section(text: str, heading: str, body: str) -> str:
    """``text`` with the section under ``## heading`` replaced by ``body`` (appended if absent).

    A section runs from its heading line to the next ``## `` line or the end of the text.
    """
    lines = text.splitlines()
    start = next((i for i, line in enumerate(lines) if line == f"## {heading}"), None)
    section = [f"## {heading}", "", *body.strip("\n").splitlines(), ""]
    if start is None:
        while lines and not lines[-1].strip():
            lines.pop()
        new = [*lines, "", *section]
    else:
        end = next((i for i in range(start + 1, len(lines)) if lines[i].startswith("## ")),
                   len(lines))
        new = [*lines[:start], *section, *lines[end:]]
    return "\n".join(new).rstrip("\n") + "\n"


def record(args: argparse.Namespace, heading: str, table: str, notes: str = "",
           gpu: str | None = None) -> None:
    """Write ``table`` (with ``notes``, the command, date and machine) under ``## heading``
    in the file ``--record`` named; nothing without ``--record``."""
    if args.record is None:
        return
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    body = (f"`{command()}`\n\n{now}, commit {_commit()}; {machine(gpu)}.\n\n"
            + (notes.strip() + "\n\n" if notes.strip() else "") + table)
    path = Path(args.record)
    text = path.read_text() if path.exists() else TITLE
    path.write_text(replace_section(text, heading, body))
    print(f"(written under '## {heading}' in {path})")
