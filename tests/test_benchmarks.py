"""The CPU host benchmarks run end to end (a few calls each), their last line the JSON object
their docstrings promise, its figures nested as measured: the launches inside the backend's
ops, the ops inside the layer's call."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"

pytest.importorskip("triton")


def _run(script: str, *args: str) -> str:
    """``script``'s output, run with ``args`` on the checkout's package (not whichever one is
    installed); it must succeed."""
    path = os.pathsep.join(filter(None, [str(BENCHMARKS.parent), os.environ.get("PYTHONPATH")]))
    result = subprocess.run([sys.executable, str(BENCHMARKS / script), *args],
                            capture_output=True, text=True, cwd=BENCHMARKS,
                            env={**os.environ, "PYTHONPATH": path})
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def _last_json_line(script: str, *args: str) -> dict:
    return json.loads(_run(script, *args).strip().splitlines()[-1])


def test_host_overhead_counts_the_launcher_inside_the_ops():
    figures = _last_json_line("host_overhead.py", "--iters", "3", "--repeats", "1",
                              "--shapes", "1", "--stack", "2")
    assert figures["launcher_included"] is True
    assert figures["launches"] == 4
    assert 0 < figures["launcher_us_fwd_bwd"] < figures["in_ops_us_fwd_bwd"]
    assert figures["in_ops_us_fwd_bwd"] < figures["host_us_fwd_bwd"]


def test_host_overhead_times_each_launch_of_a_call():
    figures = _last_json_line("host_overhead.py", "--per-launch", "--iters", "3", "--repeats",
                              "1")
    assert figures["launches"] == 4
    assert figures["launcher_us_per_call"] > 0 and figures["public_launcher_us_per_call"] > 0


@pytest.mark.parametrize("harness", ["ours", "bare", "floor"])
def test_host_overhead_runs_each_counted_harness_with_and_without_steps(harness):
    """``--instructions`` subtracts a run of the warm steps alone from one with more: each
    harness runs both ways (valgrind, which counts them, is not needed to run them)."""
    for steps in ("0", "2"):
        _run("host_overhead.py", "--counted", harness, steps)


def test_host_overhead_reads_each_function_of_callgrinds_annotation():
    """``--instructions --by-function`` reads the inclusive count of each function it reports
    from ``callgrind_annotate``'s lines (a C++ name's own colons, a recursive call's line,
    percentages or none), and 0 for one the run never called."""
    import host_overhead

    annotated = "\n".join([
        "--------------------------------------------------------------------------------",
        "Ir                     file:function",
        "1,234,567 (12.00%)  ???:launchKernel [/root/.triton/cache/x/cuda_utils.so]",
        "  765,432 ( 7.00%)  ???:launchKernel'2 [/root/.triton/cache/x/cuda_utils.so]",
        "   98,765  ???:torch::autograd::PyNode::apply(std::vector<at::Tensor> &&) [/t.so]",
        "   54,321 ( 0.50%)  /build/Objects/call.c:_PyObject_Call [/lib/libpython3.11.so]",
    ])
    counts = host_overhead._inclusive_counts(annotated)
    assert counts == {label: {"launchKernel": 1234567, "torch::autograd::PyNode::apply(": 98765
                              }.get(function, 0)
                      for label, function in host_overhead.BY_FUNCTION}


# What .ci/gpu's parts may take: its default budget (GPU_BUDGET_S) less the few seconds its
# start (nvidia-smi, the version line) takes before the first step.
GPU_PART_SECONDS = 470


def _gpu_part_limits() -> dict[str, int]:
    """The step limits of each part of .ci/gpu added up (``step`` and ``bench``'s first
    argument, in the ``if [[ $part == ... ]]`` blocks that name the part)."""
    script = (BENCHMARKS.parent / ".ci" / "gpu").read_text()
    parts: list[str] = []
    totals: dict[str, int] = {}
    for line in script.splitlines():
        words = line.split()
        if line.startswith("if [[ $part == "):
            parts = re.findall(r"\$part == (\w+)", line)
        elif line == "fi":
            parts = []
        elif parts and words and words[0] in ("step", "bench"):
            for part in parts:
                totals[part] = totals.get(part, 0) + int(words[1])
    return totals


def test_gpu_run_parts_fit_their_budget():
    """Each part of .ci/gpu runs all its steps within one lent GPU's budget: no step is cut
    for want of time."""
    totals = _gpu_part_limits()
    assert set(totals) == {"goals", "sweep", "more", "tests", "profile"}
    assert all(seconds <= GPU_PART_SECONDS for seconds in totals.values()), totals


def test_kernel_loops_issue_few_instructions_and_load_vectors():
    """sm_90 SASS of each tile loop (compiled on the CPU): the statistics kernel at most 6
    instructions a byte read on every layout, and every loop loading whole vectors of its
    thread's elements where rows allow: 16 bytes, and 8 on a 14x14 map's float16 rows (196
    positions: a multiple of 4)."""
    figures = _last_json_line("kernel_instructions.py")
    assert figures["statistics_instructions_per_byte"] <= 6
    loads = {kernel: width for kernel, width in figures["load_bytes"].items() if width != "-"}
    assert loads
    for kernel, width in loads.items():
        assert width == (8 if "rows of channels" in kernel else 16), (kernel, width)


def test_each_planner_sweep_configuration_changes_what_it_names():
    """Each configuration of ``plan_sweep.py`` sets planner constants that exist (a misspelt
    name would set a new attribute and time the plans as shipped under its label), and each
    changes what some swept shape launches, planned for a 132-SM GPU: the grid, constexprs or
    warps of a reduction's or an elementwise pass's plan, or the compile options."""
    import torch
    from helpers.plans import forget_plans
    from plan_sweep import CEILING, CONFIGS, SHAPES, _get, _set

    from encoding_syncbn.kernels.triton import plan

    def planned() -> list:
        target, plans = plan.Target(False, 132), []
        for shape, dtype, channels_last in SHAPES:
            fmt = torch.channels_last if channels_last else torch.contiguous_format
            x = torch.empty(shape, dtype=dtype, device="meta", memory_format=fmt)
            for reduction in (True, False):
                op = plan.plan_op(x, target, reduction=reduction)
                plans.append((op.grid, op.constexprs, op.num_warps))
        return [plans, dict(plan.COMPILE_OPTIONS)]

    names = {name for config in CONFIGS.values() for name in config}
    assert CEILING in plan.COMPILE_OPTIONS
    assert all(hasattr(plan, name) for name in names - {CEILING}), names - set(vars(plan))
    shipped = {name: _get(plan, name) for name in names}
    options = dict(plan.COMPILE_OPTIONS)
    forget_plans()
    as_shipped = planned()
    try:
        for label, config in CONFIGS.items():
            for name, value in {**shipped, **config}.items():
                _set(plan, name, value)
            forget_plans()
            assert (planned() == as_shipped) == (not config), label
    finally:
        for name, value in shipped.items():
            _set(plan, name, value)
        forget_plans()
    assert plan.COMPILE_OPTIONS == options
