"""Every python block of the README and docs/ is a complete program that runs as copied (the
docs' lint finds an undefined name in any of them), the quickstart runs, and every script
answers ``--help``."""

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
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _python_blocks() -> dict[str, str]:
    """{"README.md:LINE": source} of every ```python (or ```py) block, LINE its first line."""
    blocks = {}
    for path in DOCS:
        text = path.read_text()
        for match in re.finditer(r"^```py(?:thon)?\n(.*?)^```", text, flags=re.S | re.M):
            line = text.count("\n", 0, match.start(1)) + 1
            blocks[f"{path.relative_to(ROOT).as_posix()}:{line}"] = match.group(1)
    return blocks


BLOCKS = _python_blocks()


def test_docs_have_python_blocks():
    files = {name.partition(":")[0] for name in BLOCKS}
    assert {"README.md", "docs/converting.md"} <= files


def test_python_blocks_lint_clean(tmp_path):
    """Pyflakes' checks over each block alone: an undefined name (a model, a module never
    imported) or an unused import fails here, whether or not the block can run here."""
    paths = [tmp_path / f"block{index:03d}.py" for index in range(len(BLOCKS))]
    for path, source in zip(paths, BLOCKS.values()):
        path.write_text(source)
    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--isolated", "--no-cache",
                             "--select", "F", "--output-format", "concise", *map(str, paths)],
                            capture_output=True, text=True, cwd=tmp_path)
    found = result.stdout
    for path, name in zip(paths, BLOCKS):
        found = found.replace(path.name, name)
    assert result.returncode == 0, found + result.stderr


@pytest.mark.parametrize("name", BLOCKS)
def test_python_block_runs(name, tmp_path):
    """The block, saved as a script, runs from a folder of its own: under torchrun (2 ranks,
    gloo on the CPU) when it reads LOCAL_RANK, else as ``python block.py``."""
    source = BLOCKS[name]
    script = tmp_path / "block.py"
    script.write_text(source)
    launcher = [sys.executable]
    if "LOCAL_RANK" in source:
        launcher += ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    # No time bound: a block's waits on replicas or ranks are bounded by their own timeouts.
    result = subprocess.run([*launcher, str(Path(__file__).with_name("doc_block.py")),
                             str(script)], capture_output=True, text=True, cwd=tmp_path, env=env)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    if "print(" in source:
        assert result.stdout.strip(), f"{name} printed nothing"


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
