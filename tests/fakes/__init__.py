"""Stand-in driver libraries (``fake_cuda.c``, ``fake_ascendcl.c``) for the device tests, built with ``cc``."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

HERE = Path(__file__).parent


def build(tmp_path_factory: pytest.TempPathFactory, name: str) -> str:
    """Compile ``<name>.c`` into a shared library in a fresh temporary folder: its path."""
    out = tmp_path_factory.mktemp(name) / f"lib{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-O1", "-pthread", "-o", str(out), str(HERE / f"{name}.c")],
                   check=True, timeout=60)
    return str(out)
