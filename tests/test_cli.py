"""``python -m aio_datadist``: help, argument handling, the demo and a tiny ``bench`` run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from aio_datadist.__main__ import main
from peers import NIXL_MISSING

REPO = Path(__file__).resolve().parent.parent
RUN_LIMIT_S = 120  # the tiny bench takes about 12 s on 2 cores


def cli(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "aio_datadist", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=RUN_LIMIT_S)


def test_help_lists_the_commands():
    result = cli("--help")
    assert result.returncode == 0, result.stderr
    assert "demo" in result.stdout and "bench" in result.stdout


@pytest.mark.parametrize("transport, moved_by", [
    (None, "same-host shared memory"),
    pytest.param("nixl", "NIXL READ/WRITE", marks=[pytest.mark.nixl, pytest.mark.skipif(
        bool(NIXL_MISSING), reason=NIXL_MISSING)]),
])
def test_the_demo_moves_a_real_kv_cache_between_two_processes(tmp_path, transport, moved_by):
    """README's first command, run from outside the checkout as a user would."""
    result = cli("demo", *(["--transport", transport] if transport else []), cwd=tmp_path)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "demo OK" in result.stdout and f"transport: {moved_by}" in result.stdout
    assert result.stdout.count("bytes verified") == 2


def test_bench_help_lists_its_options():
    result = cli("bench", "--help")
    assert result.returncode == 0, result.stderr
    for option in ("--quick", "--sizes", "--uvloop", "--data-channels", "--format", "--plot", "--no-progress"):
        assert option in result.stdout


@pytest.mark.parametrize("args, message", [
    ([], "required: command"),
    (["bench", "--sizes", "0"], "--sizes: expected block counts >= 1"),
    (["bench", "--sizes", "4,x"], "--sizes: expected comma-separated block counts"),
    (["bench", "--data-channels", "0"], "--data-channels: expected an integer >= 1"),
    (["bench", "--format", "csv"], "--format: invalid choice"),
])
def test_bad_arguments_are_refused_with_usage(capsys, args, message):
    with pytest.raises(SystemExit) as exit_:
        main(args)
    assert exit_.value.code == 2
    assert message in capsys.readouterr().err


def test_plot_without_matplotlib_is_refused_before_measuring(capsys, monkeypatch, tmp_path):
    for name in ["matplotlib", *(m for m in sys.modules if m.startswith("matplotlib."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if not installed
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--plot", str(tmp_path / "out.png")])
    assert exit_.value.code == 2
    assert 'needs matplotlib, which is not installed: pip install -e ".[bench]"' in capsys.readouterr().err


@pytest.mark.parametrize("name, message", [
    ("missing/out.png", "does not exist"),
    ("out.xyz", "--plot: name the file with one of the suffixes"),
])
def test_plot_into_a_file_matplotlib_cannot_write_is_refused(capsys, tmp_path, name, message):
    pytest.importorskip("matplotlib")
    with pytest.raises(SystemExit) as exit_:
        main(["bench", "--plot", str(tmp_path / name)])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "python -m aio_datadist bench: error:" in err and message in err


def test_bench_outside_a_checkout_says_where_to_run_it(tmp_path):
    result = cli("bench", "--quick", cwd=tmp_path)
    assert result.returncode == 1
    assert "run this command from the" in result.stderr and "root of an aio_datadist checkout" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.slow
def test_quick_bench_prints_ratios_and_plots(tmp_path):
    plot = tmp_path / "throughput.png"
    has_matplotlib = subprocess.run([sys.executable, "-c", "import matplotlib"], capture_output=True).returncode == 0
    args = ["bench", "--quick", "--sizes", "1", "--format", "json"]
    result = cli(*args, *(["--plot", str(plot)] if has_matplotlib else []))
    assert result.returncode == 0, result.stderr
    table = json.loads(result.stdout)
    rows = {row["benchmark"]: row for row in table["rows"]}
    assert rows["raw socket sendall/recv_into"]["value"] > 0
    for name in ("pull_blocks", "push_blocks"):
        assert rows[name]["baseline"] == "raw socket"
        assert rows[name]["ratio"] > 0
        assert rows[name]["case"] == "1 blk (2 MiB)"
    # stderr is no terminal here: progress comes as plain lines
    assert "start the peer process and link..." in result.stderr and "measure 1 blocks..." in result.stderr
    if has_matplotlib:
        assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
