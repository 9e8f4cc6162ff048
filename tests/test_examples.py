"""The quickstart examples (docs/quickstart.md) run as written, each as its own program."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.mark.parametrize("name", ["quickstart_pull", "quickstart_layerwise"])
def test_quickstart_example_runs(name, tmp_path):
    run = subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=tmp_path,  # outside the checkout
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.splitlines()[-1] == f"{name} OK", run.stdout
    assert "verified" in run.stdout and not run.stderr


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
