"""The command line and an example as a user stops or misuses them: SIGTERM, Ctrl-C again and again, a plot
onto a folder, an abort timeout the example cannot finish within (rows 366-368)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest

from aio_datadist.__main__ import main
from test_cli import demo_stopped

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("children", [1, 2])
def test_sigterm_to_the_demo_ends_it_with_one_line_and_no_process_left(tmp_path, children):
    """`kill PID` (SIGTERM to the demo's own process, as a service manager or `timeout` sends it) once the prompt
    process starts: one line, exit 143, no traceback from any process, every process gone."""
    returncode, err, left, _ = demo_stopped(tmp_path, children, lambda demo: demo.send_signal(signal.SIGTERM))
    assert not left
    assert returncode == 128 + signal.SIGTERM and err.splitlines() == ["demo terminated"], (returncode, err[-3000:])


@pytest.fixture
def transfer_benchmark(monkeypatch):
    monkeypatch.syspath_prepend(str(REPO))
    monkeypatch.chdir(REPO)
    from benchmarks import harness, transfer

    def measuring(*args, **kwargs):
        raise AssertionError("the benchmark started measuring")

    monkeypatch.setattr(harness, "run_coroutine", measuring)
    return transfer


def test_plot_onto_a_folder_is_refused_before_measuring(capsys, monkeypatch, tmp_path, transfer_benchmark):
    """`--plot out.png` where out.png is a folder: savefig can never write it; refused with usage (exit 2)
    before minutes of measuring, not by an IsADirectoryError traceback after them."""
    if importlib.util.find_spec("matplotlib") is None:  # the check before measuring only asks for the formats
        agg = types.ModuleType("matplotlib.backends.backend_agg")
        agg.FigureCanvasAgg = type("FigureCanvasAgg", (), {
            "get_supported_filetypes": staticmethod(lambda: {"png": "Portable Network Graphics"})})
        for name in ("matplotlib", "matplotlib.backends"):
            monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
        monkeypatch.setitem(sys.modules, agg.__name__, agg)
    (tmp_path / "out.png").mkdir()
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--plot", str(tmp_path / "out.png"), "--sizes", "1", "--transport", "tcp", "--no-progress"])
    assert exit_.value.code == 2
    assert "--plot" in capsys.readouterr().err


def _vllm_style_pull():
    spec = importlib.util.spec_from_file_location("vllm_style_pull_hunt", REPO / "examples" / "vllm_style_pull.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("value", ["inf", "480"])
def test_vllm_style_pull_refuses_an_abort_timeout_it_cannot_finish_within(capsys, value):
    """`--abort-timeout inf` or one past the example's own 120 s run limit (the help quotes vLLM's 480):
    the example ran 120 s then ended 'FAILED: ... no result from the prefill process within 120 s'."""
    example = _vllm_style_pull()
    with pytest.raises(SystemExit) as exit_:
        example.parse_args(["--abort-timeout", value])
    assert exit_.value.code == 2
    assert "--abort-timeout" in capsys.readouterr().err


@pytest.mark.parametrize("children", [1, 2])
def test_ctrl_c_pressed_again_and_again_ends_the_demo_with_one_line_and_no_process_left(tmp_path, children):
    """Ctrl-C pressed several times in a row (a terminal sends each to the whole process group), once the
    prompt process or both started: still one line, exit 130, no traceback, every process gone. Row 297 covers
    one Ctrl-C only: a second one landed in the demo's clean-up (`proc.join`), left the decoder unkilled (it
    then printed its own traceback) and the parent died of SIGINT with a traceback."""
    def stop(demo: subprocess.Popen) -> None:
        for gap in (0, 0.002, 0.004, 0.01, 0.02, 0.05):
            time.sleep(gap)
            try:
                os.killpg(demo.pid, signal.SIGINT)
            except ProcessLookupError:  # every process of the group ended
                break

    returncode, err, left, _ = demo_stopped(tmp_path, children, stop)
    assert returncode == 130 and err.splitlines() == ["demo interrupted"], (returncode, err[-3000:])
    assert not left
