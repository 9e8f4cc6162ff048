"""The framework-integration examples run as a user runs them: ``python examples/NAME.py``.

Each example spawns a prefill and a decode process and exits 0 only when
its own checks passed (token equality with ``model.generate``; pulled bytes,
freed blocks and the abort timeout); its last line is ``OK: NAME: ...`` naming
them, or ``FAILED: NAME: ...`` naming what failed.
"""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
RUN_LIMIT_S = 150  # a bound for a loaded machine; each example takes about 10 s on 2 cores


def run_example(name: str, *args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """Run an example in its own session, so that a hung run is killed with every process it started."""
    proc = subprocess.Popen([sys.executable, str(EXAMPLES / name), *args], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True, env=env)
    try:
        output, _ = proc.communicate(timeout=RUN_LIMIT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"{name} did not finish within {RUN_LIMIT_S} s:\n{output}")
    return proc.returncode, output


@pytest.mark.slow
def test_disaggregated_generation_equals_model_generate():
    if importlib.util.find_spec("transformers") is None:
        if os.environ.get("CI"):
            pytest.fail('transformers is missing: CI installs it with the "test" extra')
        pytest.skip('needs transformers: pip install -e ".[examples]"')
    code, output = run_example("disaggregated_generation.py", "--prompts", "5,23,37,50", "--new-tokens", "12")
    assert code == 0, output
    assert output.count("tokens equal to model.generate") == 4, output
    assert output.count("K,V bit-identical to a local prefill's") + output.count("K,V within 1e-5") == 4, output
    last = output.splitlines()[-1]
    assert last.startswith("OK: disaggregated_generation: 4 prompts, disaggregated tokens equal to single-process "
                           "model.generate"), output


@pytest.mark.slow
def test_vllm_style_pull_frees_blocks_on_finished_and_on_timeout():
    # A 3 s abort timeout: far above a pull's milliseconds even on a loaded machine.
    code, output = run_example("vllm_style_pull.py", "--requests", "6", "--abort-timeout", "3")
    assert code == 0, output
    assert output.count("bytes verified; 'finished' sent") == 5, output
    assert output.count("released by the abort timeout (") == 1, output
    last = output.splitlines()[-1]
    assert last.startswith("OK: vllm_style_pull: 5 requests pulled and verified, blocks freed on 'finished'; "
                           "abandoned request(s) [3] released by the abort timeout; prefill pool 128/128 blocks "
                           "free"), output


@pytest.mark.slow
def test_vllm_style_pull_whose_bytes_differ_ends_with_failed_and_exit_1(tmp_path):
    """As if the pulls had moved wrong bytes: every byte comparison, in every process, says they differ."""
    (tmp_path / "sitecustomize.py").write_text("import torch\n\ntorch.equal = lambda a, b: False\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    code, output = run_example("vllm_style_pull.py", "--requests", "2", "--abort-timeout", "1", env=env)
    assert code == 1, output
    last = output.splitlines()[-1]
    assert last == "FAILED: vllm_style_pull: requests pulled with verified bytes: [], not [0]", output
