"""``kernels/triton/launch.py``: the compiled kernel launched directly hands the driver what
Triton's public launch hands it (CI runs this module with Triton 3.6 too)."""

import json
import os
import shutil
import subprocess
import sys

import pytest

pytest.importorskip("triton")

from encoding_syncbn import compat  # noqa: E402
from encoding_syncbn.kernels.triton import launch  # noqa: E402
from encoding_syncbn.kernels.triton.plan import INTERPRET  # noqa: E402

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(shutil.which(os.environ.get("CC", "gcc")) is None
                    and shutil.which("clang") is None,
                    reason="the stand-in driver is built with a C compiler")
def test_direct_and_public_launches_hand_the_driver_the_same_arguments():
    """Every kernel, and in it every dtype, layout, tile, activation, split and integer typing
    (``tests/launch_paths.py``), aligned and misaligned: the public launch and the direct one
    give the stand-in driver the same grid, block, shared memory, stream, attributes, function
    and parameter bytes; the second launch of a specialisation is direct, a misaligned tensor
    gets a kernel of its own, a launch hook turns the public path back on, and forgetting the
    plans after a planning constant changed (``forget_plans`` of
    benchmarks/helpers/plans.py, which plan_sweep.py calls) forgets the compiled kernels."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, os.path.join(_ROOT, "tests", "launch_paths.py")],
                          capture_output=True, text=True, env=env, timeout=1200, cwd=_ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    found = json.loads(proc.stdout.splitlines()[-1])
    assert found["kernels"] == ["_backward_dx_kernel", "_backward_reduce_kernel",
                                "_batch_stats_kernel", "_channel_stats_kernel",
                                "_normalize_act_kernel", "_normalize_running_kernel"]
    assert found["cases"] > 2 * len(found["kernels"])
    for problem in ("different", "public_on_second_launch", "pointers_missing",
                    "misaligned_shares_kernel"):
        assert found[problem] == [], (problem, found)
    assert found["hooked_launch_public"] and found["unhooked_launch_direct"], found
    assert found["forgotten_with_plans"], found


@pytest.mark.parametrize("version,known", [
    ("3.6.0", True), ("3.7.1", True), ("3.8.0", True), ("3.9.0", True),
    ("3.9.0+git1234abcd", True), ("3.5.1", False), ("3.10.0", False), ("4.0.0", False),
    ("unknown", False)])
def test_direct_launch_only_for_triton_releases_it_was_read_against(version, known):
    assert compat.compiled_launch_release(version) is known


@pytest.mark.skipif(not INTERPRET, reason="the interpreter's launches")
def test_interpreted_launches_take_the_public_path():
    assert launch._resolve_knobs() is None
