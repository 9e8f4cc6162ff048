"""The quickstart examples (docs/quickstart.md) and the llm_datadist port run as written, each as its own
program, and end with one OK line naming what they checked (or FAILED and exit status 1)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from aio_datadist import LLMStatusCode

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


#: What each example's last line says it checked.
CHECKED = {
    "quickstart_pull": "bytes equal; the consumed key refused with LLM_KV_CACHE_NOT_EXIST",
    "quickstart_layerwise": "each layer's bytes equal on arrival; transfer_cache_async returned LLM_SUCCESS",
    "llm_datadist_port": "pull_cache, pull_blocks and swap_blocks bytes equal; the consumed key refused",
}


def run_example(name: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=cwd, env=env,  # outside the checkout
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name", list(CHECKED))
def test_an_example_ends_with_one_ok_line_naming_what_it_checked(name, tmp_path):
    run = run_example(name, tmp_path)
    assert run.returncode == 0, run.stdout + run.stderr
    last = run.stdout.splitlines()[-1]
    assert last.startswith(f"OK: {name}: ") and CHECKED[name] in last, run.stdout
    assert "FAILED" not in run.stdout and not run.stderr
    bare = [code.name for code in LLMStatusCode if code > 1 and re.search(rf"\b{int(code)}\b", run.stdout)]
    assert not bare, f"status numbers instead of names {bare}: {run.stdout}"


@pytest.mark.parametrize("name", list(CHECKED))
def test_an_example_whose_bytes_differ_ends_with_failed_and_exit_1(name, tmp_path):
    """As if the transfers had moved wrong bytes: every byte comparison, in every process, says they differ."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import torch\n\ntorch.equal = lambda a, b: False\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(site), os.environ.get("PYTHONPATH")])))
    run = run_example(name, tmp_path, env)
    assert run.returncode == 1, run.stdout + run.stderr
    last = run.stdout.splitlines()[-1]
    assert last.startswith(f"FAILED: {name}: ") and "differ" in last, run.stdout + run.stderr
    assert "OK" not in run.stdout


def test_the_quickstart_quotes_the_examples():
    """Every line of a code block in docs/quickstart.md that follows "From `examples/...`" is in that file."""
    doc = (EXAMPLES.parent / "docs" / "quickstart.md").read_text()
    source = None
    quoted = 0
    for part in re.split(r"(```python\n.*?```)", doc, flags=re.S):
        if part.startswith("```python"):
            if source is None:
                continue
            lines = {line.strip() for line in (EXAMPLES / source).read_text().splitlines()}
            for line in part.splitlines()[1:-1]:
                assert line.strip() in lines, f"{line.strip()!r} is not in examples/{source}"
                quoted += 1
        else:
            found = re.findall(r"From `examples/(\w+\.py)`", part)
            if found:
                source = found[-1]
            elif "## " in part:
                source = None
    assert quoted > 30


def test_the_readme_program_runs_as_written(tmp_path):
    """README's "A first look" is a complete program: run it as it stands, from outside the checkout."""
    readme = (EXAMPLES.parent / "README.md").read_text()
    program = re.search(r"## A first look.*?```python\n(.*?)```", readme, re.S)
    assert program is not None, "README has no python block under 'A first look'"
    (tmp_path / "first_look.py").write_text(program.group(1))
    result = subprocess.run([sys.executable, "first_look.py"], cwd=tmp_path, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.strip() == "pulled 3 blocks over local"
