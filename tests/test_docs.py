"""The README's ```python blocks (```py ones are fragments) and the quickstart run as written;
every script answers ``--help``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BLOCKS = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)


def test_readme_has_python_blocks():
    assert BLOCKS


@pytest.mark.parametrize("index", range(len(BLOCKS)))
def test_readme_python_block_runs(index):
    exec(compile(BLOCKS[index], f"README.md python block {index}", "exec"), {})


def test_quickstart_reports_equal_statistics():
    # No time bound: its waits on the replicas are bounded by ENCODING_SYNCBN_TIMEOUT.
    result = subprocess.run([sys.executable, str(ROOT / "examples" / "quickstart.py")],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith("per-replica BatchNorm's do not: equal")


# Every script under benchmarks/ and examples/ (helper modules have no __main__ block).
SCRIPTS = sorted(path.relative_to(ROOT).as_posix()
                 for folder in ("benchmarks", "examples") for path in (ROOT / folder).glob("*.py")
                 if "__name__ == \"__main__\"" in path.read_text())
# The optional packages (triton, the examples' extras, the model zoos): --help must not need
# them. script_help.py marks them missing before it runs the scripts.
OPTIONAL = ("triton", "tqdm", "matplotlib", "PIL", "timm", "torchvision",
            "segmentation_models_pytorch")


@pytest.fixture(scope="module")
def helps(tmp_path_factory):
    """Every script's ``--help``: {script: (exit code, stdout, stderr)}, from one process that
    imports torch once (see script_help.py)."""
    out = tmp_path_factory.mktemp("helps")
    env = {**os.environ, "COLUMNS": "1000"}  # one line per option: defaults are easy to count
    subprocess.run([sys.executable, str(Path(__file__).with_name("script_help.py")), str(ROOT),
                    str(out), *SCRIPTS, "--", *OPTIONAL], check=True, env=env, cwd=ROOT)
    return {script: tuple(json.loads((out / f"{i}.json").read_text()))
            for i, script in enumerate(SCRIPTS)}


def test_scripts_found():
    assert {"benchmarks/bench_time.py", "examples/quickstart.py"} <= set(SCRIPTS)


def test_benchmark_helpers_live_in_helpers():
    """Every module directly under benchmarks/ is a script (its helpers are in
    benchmarks/helpers/, none of them a script)."""
    top = {path.relative_to(ROOT).as_posix() for path in (ROOT / "benchmarks").glob("*.py")}
    assert top <= set(SCRIPTS), top - set(SCRIPTS)
    helpers = list((ROOT / "benchmarks" / "helpers").glob("*.py"))
    assert helpers
    assert not [path.name for path in helpers if "__main__" in path.read_text()]


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_help(helps, script):
    code, out, err = helps[script]
    assert code == 0, err
    assert out.startswith("usage: "), out[:500]
    # An option's help states its default once (ArgumentDefaultsHelpFormatter appends
    # "(default: None)" to a help text that already spells out its default).
    options = re.split(r"\n(?=  -)", out.partition("\noptions:")[2])
    assert not [option for option in options if option.count("(default") > 1], out


@pytest.fixture(scope="module")
def results():
    """benchmarks/helpers/results.py, the benchmarks' shared recording helper."""
    spec = importlib.util.spec_from_file_location("bench_results",
                                                  ROOT / "benchmarks/helpers/results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_section_replaced_or_appended(results):
    text = "# R\n\n## a.py\n\nold a\n\n## b.py (cpu)\n\nold b\n"
    text = results.replace_section(text, "a.py", "new a\n| x |")
    assert text == "# R\n\n## a.py\n\nnew a\n| x |\n\n## b.py (cpu)\n\nold b\n"
    text = results.replace_section(text, "b.py (cpu)", "new b")
    assert text.endswith("## a.py\n\nnew a\n| x |\n\n## b.py (cpu)\n\nnew b\n")
    assert results.replace_section(text, "b.py", "c").endswith("new b\n\n## b.py\n\nc\n")
    assert results.markdown_table(["a", "b"], [["x", 1.5]]) == "| a | b |\n|---|---:|\n| x | 1.5 |"


def test_results_written_only_with_record(results, tmp_path, monkeypatch):
    """A benchmark prints by default; ``--record`` writes RESULTS.md, ``--record PATH`` PATH,
    under a command that leaves ``--record`` out."""
    parser = argparse.ArgumentParser()
    results.add_arguments(parser)
    assert parser.parse_args([]).record is None
    assert parser.parse_args(["--record"]).record == results.RESULTS
    path = tmp_path / "R.md"
    results.record(parser.parse_args([]), "x.py", "| a |")
    assert not path.exists()
    argv = ["--n", "3", "--record", str(path), "--fast"]
    monkeypatch.setattr(sys, "argv", [str(ROOT / "benchmarks" / "x.py"), *argv])
    results.record(parser.parse_args(["--record", str(path)]), "x.py", "| a |")
    text = path.read_text()
    assert text.startswith(results.TITLE)
    assert "## x.py\n\n`python benchmarks/x.py --n 3 --fast`\n" in text
    assert text.endswith("\n\n| a |\n")


def test_version():
    import encoding_syncbn

    assert re.fullmatch(r"\d+\.\d+\.\d+", encoding_syncbn.__version__)
