"""The llm_datadist port and the vLLM-style pull examples as their processes are stopped or die: SIGTERM to the
port reaps every process it spawned; a spawned process killed (SIGKILL, as the OOM killer sends it) ends the
example at once with a FAILED line naming that process, not after its 120 s run limit naming the wait."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_cli import live_processes_in_group

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def _start(name: str, cwd: Path) -> subprocess.Popen:
    """The example in a session of its own: every process it spawns is in the group ``pid``."""
    return subprocess.Popen([sys.executable, str(EXAMPLES / f"{name}.py")], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)


def _spawned(parent: int) -> list[int]:
    """The live processes ``parent`` spawned with multiprocessing, in the order they started."""
    found = []
    for entry in Path("/proc").glob("[0-9]*"):
        try:
            fields = (entry / "stat").read_text().rpartition(")")[2].split()
            cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
        except (OSError, ValueError):  # one that ended meanwhile
            continue
        if int(fields[1]) == parent and fields[0] != "Z" and "spawn_main" in cmdline:
            found.append((int(fields[19]), int(entry.name)))  # its start time, in clock ticks since boot
    return [pid for _, pid in sorted(found)]


def _wait_for_spawned(example: subprocess.Popen, count: int) -> list[int]:
    """Once ``count`` processes of the example started (and 0.3 s more: the newest is importing torch)."""
    deadline = time.monotonic() + 20
    while len(spawned := _spawned(example.pid)) < count:
        assert example.poll() is None and time.monotonic() < deadline, f"{count} spawned processes wanted"
        time.sleep(0.05)
    time.sleep(0.3)
    return spawned


def _reap(example: subprocess.Popen) -> None:
    if example.poll() is None or live_processes_in_group(example.pid):
        os.killpg(example.pid, signal.SIGKILL)
        example.communicate()


@pytest.mark.parametrize("children", [1, 2])
def test_sigterm_to_the_llm_datadist_port_leaves_no_process_of_it(tmp_path, children):
    """`kill PID` (SIGTERM, as a service manager or a cancelled CI job sends it) once the prompt process starts,
    or the decoder too: exit 143 and every process gone at once. Before, SIGTERM ended the example before its
    finally ran: the prompt served on in done.wait(60), and multiprocessing's resource tracker with it."""
    example = _start("llm_datadist_port", tmp_path)
    try:
        _wait_for_spawned(example, children)
        example.send_signal(signal.SIGTERM)
        _, err = example.communicate(timeout=15)
        deadline = time.monotonic() + 3
        while (left := live_processes_in_group(example.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not left
        assert example.returncode == 128 + signal.SIGTERM, err[-3000:]  # it stopped mid-run, not at its end
    finally:
        _reap(example)


@pytest.mark.parametrize("name, started, victim, who", [
    ("llm_datadist_port", 1, 0, "prompt"),  # starting: it never sends its port
    ("llm_datadist_port", 2, 0, "prompt"),  # serving its caches, the decoder starting
    ("llm_datadist_port", 2, 1, "decoder"),
    ("vllm_style_pull", 2, 0, "prefill"),
    ("vllm_style_pull", 2, 1, "decode"),
])
def test_a_spawned_process_killed_ends_the_example_with_a_failed_line_naming_it(tmp_path, name, started, victim,
                                                                                  who):
    """SIGKILL to one spawned process once ``started`` of them started: the example ends within seconds, its last
    line FAILED naming that process and its exit code. Before, the port waited its 120 s limit and blamed the wait
    ("prompt did not start"); the vLLM-style pull hung when the prefill died (the parent held copies of the
    children's pipe ends: no EOF) and, when the decode died, printed 'FAILED: vllm_style_pull: ' naming nothing
    (the text of EOFError()); the port hung for ever when its prompt died inside an mp.Event's wait."""
    example = _start(name, tmp_path)
    try:
        os.kill(_wait_for_spawned(example, started)[victim], signal.SIGKILL)
        out, err = example.communicate(timeout=10)
        assert example.returncode == 1, out + err[-3000:]
        last = out.splitlines()[-1]
        assert last.startswith(f"FAILED: {name}: the {who} process exited with code -9"), out + err[-3000:]
    finally:
        _reap(example)


_NODE_DRIVER = """
import multiprocessing as mp
import sys
sys.path[:0] = [{fake!r}, {examples!r}]
import vllm_disaggregated as vd
vd.START_LIMIT_S = 3.0
if __name__ == "__main__":
    try:
        vd.Node("prefill", "no-model")
    except Exception as exc:
        print(type(exc).__name__, exc, flush=True)
    print("left", len(mp.active_children()), flush=True)
"""


@pytest.mark.parametrize("vllm, expected", [
    ("raise ImportError('no vllm here')", "ConnectionError prefill vLLM exited (exit code 1)"),
    ("import time\ntime.sleep(600)", "TimeoutError prefill vLLM did not start within 3 s"),
    (None, "ConnectionError prefill vLLM exited before it connected (exit code 3)"),
])
def test_a_vllm_node_that_fails_to_start_is_stopped_and_says_why(tmp_path, vllm, expected):
    """``examples/vllm_disaggregated.py``'s ``Node`` whose vLLM cannot start (here a stand-in ``vllm`` package that
    fails to import, or hangs in its import; or a process that dies in its start-up, before it connects): the error
    names the exit code, and the node's process is gone when the constructor raises. Before, the code read
    ``None`` (read before the process was reaped); a node that never became ready was left running (no caller
    held it to close it): the example hung at its exit, joining it; one that died before it connected was waited
    for ``START_LIMIT_S`` (300 s) and reported as not connecting (found by review, 2026-12-07)."""
    env = dict(os.environ)
    if vllm is None:  # the spawned process dies in its start-up, before it connects
        (tmp_path / "sitecustomize.py").write_text(
            "import os\nif b'spawn_main' in open('/proc/self/cmdline', 'rb').read():\n    os._exit(3)\n")
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(tmp_path), env.get("PYTHONPATH")) if p)
    else:
        (tmp_path / "vllm").mkdir()
        (tmp_path / "vllm" / "__init__.py").write_text(vllm + "\n")
    driver = tmp_path / "driver.py"
    driver.write_text(_NODE_DRIVER.format(fake=str(tmp_path), examples=str(EXAMPLES)))
    run = subprocess.Popen([sys.executable, str(driver)], cwd=tmp_path, stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, start_new_session=True, env=env)
    try:
        out, err = run.communicate(timeout=40)
        assert out.splitlines() == [expected, "left 0"], out + err[-3000:]
        assert run.returncode == 0
    finally:
        _reap(run)
