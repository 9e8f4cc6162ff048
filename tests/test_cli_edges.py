"""``python -m aio_datadist``: where ``bench`` finds its programs, and what ``demo --metrics-port`` checks first.

Every command here ends before any benchmark or demo process starts.
"""

from __future__ import annotations

import importlib
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import aio_datadist.demo
from aio_datadist import LLMDataDist, LLMRole
from aio_datadist.__main__ import _import_transfer_benchmark, main

REPO = Path(__file__).resolve().parent.parent
LIMIT_S = 60  # each command here exits in well under a second


def cli(*args: str, cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aio_datadist", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=LIMIT_S)


def project_with_benchmarks(root: Path, layout: str) -> Path:
    """A user's project with a ``benchmarks/`` folder of its own (asv, pytest-benchmark)."""
    folder = root / "benchmarks"
    folder.mkdir()
    if layout != "namespace":
        (folder / "__init__.py").write_text("")
    if layout == "own_transfer":
        (folder / "transfer.py").write_text("print('USER MODULE RAN')\n")
    return root


@pytest.mark.parametrize("layout", ["package", "own_transfer"])
def test_bench_from_a_project_with_its_own_benchmarks_folder_says_where_to_run_it(tmp_path, layout):
    """The project's ``benchmarks`` is neither imported nor run; the command says where to run it."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}  # as a user runs it: the installed package
    result = cli("bench", "--quick", "--sizes", "1", "--transport", "tcp", "--no-progress",
                 cwd=project_with_benchmarks(tmp_path, layout), env=env)
    assert result.returncode == 1, (result.returncode, result.stderr[-800:])
    assert "Traceback" not in result.stderr, result.stderr[-800:]
    assert "root of an aio_datadist checkout" in result.stderr
    assert "USER MODULE RAN" not in result.stdout


@pytest.fixture
def benchmarks_unloaded(monkeypatch):
    """No ``benchmarks`` module imported during the test; those imported before come back after it."""
    saved = {name: module for name, module in sys.modules.items() if name.partition(".")[0] == "benchmarks"}
    for name in saved:
        monkeypatch.delitem(sys.modules, name)
    yield
    for name in [name for name in sys.modules if name.partition(".")[0] == "benchmarks"]:
        del sys.modules[name]
    sys.modules.update(saved)


@pytest.mark.usefixtures("benchmarks_unloaded")
def test_bench_imports_the_checkouts_benchmark_whatever_comes_first_on_the_path(tmp_path, monkeypatch, capsys):
    """Run from the checkout, ``bench`` takes ``benchmarks/transfer.py`` beside the package even where another
    ``benchmarks`` comes first on ``sys.path``."""
    monkeypatch.syspath_prepend(str(project_with_benchmarks(tmp_path, "own_transfer")))
    monkeypatch.chdir(REPO)
    transfer = _import_transfer_benchmark()
    assert Path(transfer.__file__).resolve() == REPO / "benchmarks" / "transfer.py"
    assert "USER MODULE RAN" not in capsys.readouterr().out


@pytest.mark.usefixtures("benchmarks_unloaded")
def test_bench_away_from_the_checkouts_root_says_where_to_run_it(tmp_path, monkeypatch):
    """In process, with this checkout's package: from a project folder (with a ``benchmarks/transfer.py`` of its
    own) nothing is imported, and the message names the checkout to run it in."""
    monkeypatch.chdir(project_with_benchmarks(tmp_path, "own_transfer"))
    with pytest.raises(SystemExit, match="root of an aio_datadist checkout") as refused:
        _import_transfer_benchmark()
    assert f"the checkout at {REPO}: run it there" in str(refused.value)
    assert not [name for name in sys.modules if name.partition(".")[0] == "benchmarks"]


@pytest.fixture
def demo_not_started(monkeypatch):
    def started(*args):
        raise AssertionError("the demo started its processes")

    monkeypatch.setattr(aio_datadist.demo, "main", started)


@pytest.mark.usefixtures("demo_not_started")
def test_demo_metrics_without_prometheus_client_names_the_extra(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # import prometheus_client: ImportError
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--metrics-port", "0"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "python -m aio_datadist demo: error: --metrics-port needs prometheus_client" in err
    assert "pip install 'aio_datadist[metrics]'" in err


@pytest.mark.usefixtures("demo_not_started")
def test_demo_metrics_port_in_use_is_refused_before_the_demo_starts(capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            main(["demo", "--metrics-port", str(port)])
    assert exit_.value.code == 2
    assert f"python -m aio_datadist demo: error: --metrics-port {port}: cannot serve on 127.0.0.1:{port}" \
        in capsys.readouterr().err


@pytest.mark.usefixtures("demo_not_started")
def test_demo_metrics_with_a_broken_prometheus_client_names_the_extra(tmp_path, monkeypatch, capsys):
    """Installed but failing to import (not only missing): the same one line, not an ImportError traceback."""
    (tmp_path / "prometheus_client").mkdir()
    (tmp_path / "prometheus_client" / "__init__.py").write_text("raise ImportError('broken install')\n")
    monkeypatch.delitem(sys.modules, "prometheus_client", raising=False)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(SystemExit) as exit_:
        main(["demo", "--metrics-port", "0"])
    assert exit_.value.code == 2
    assert "--metrics-port needs prometheus_client" in capsys.readouterr().err


@pytest.mark.usefixtures("demo_not_started")
def test_demo_metrics_port_the_exporter_can_bind_is_not_refused():
    """A port in TIME_WAIT, or held on another loopback address only, the exporter binds (SO_REUSEADDR, on
    127.0.0.1): the check lets the demo start."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        with socket.create_connection(("127.0.0.1", port)) as client:
            accepted, _ = server.accept()
            accepted.close()  # closed first on the server's side: 127.0.0.1:port stays in TIME_WAIT
            client.recv(1)
    with socket.socket() as other:
        other.bind(("127.0.0.2", port))
        other.listen()
        with pytest.raises(AssertionError, match="the demo started its processes"):
            main(["demo", "--metrics-port", str(port)])


def test_a_demo_process_whose_metrics_port_was_taken_meanwhile_ends_with_one_line():
    """The port taken between the command line's check and the decoder's start: the decoder process ends with
    a one-line message naming it (what its parent reports), not an OSError traceback."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exit_:
            aio_datadist.demo._export(LLMDataDist(LLMRole.DECODER, 2), port)
    assert exit_.value.code == f"--metrics-port {port}: cannot serve on 127.0.0.1:{port}: Address already in use"


@pytest.mark.parametrize("layout", ["package", "own_transfer"])
def test_bench_with_another_benchmarks_package_imported_already_says_so(tmp_path, monkeypatch, layout):
    """A project's own ``benchmarks`` (no ``transfer.py``, or its own ``transfer`` imported too) imported before,
    in this process: the command says so, importing nothing of it (it raised ``ModuleNotFoundError`` past its
    check: found by review), and does not take that ``benchmarks.transfer`` for the checkout's."""
    project_with_benchmarks(tmp_path, layout)
    for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.syspath_prepend(str(tmp_path))
    importlib.import_module("benchmarks.transfer" if layout == "own_transfer" else "benchmarks")
    monkeypatch.chdir(REPO)
    try:
        with pytest.raises(SystemExit, match="another package named benchmarks"):
            _import_transfer_benchmark()
    finally:
        for name in [m for m in sys.modules if m == "benchmarks" or m.startswith("benchmarks.")]:
            del sys.modules[name]
