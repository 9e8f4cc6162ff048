"""The blocking facade survives what interrupts it: a KeyboardInterrupt or SystemExit raised in user code
on its loop, and a KeyboardInterrupt in the caller's thread while a call waits.

Each case runs ``compat_interrupt_child.py`` in a process of its own (a facade that hangs must not hang
the test run, and the program's normal exit, with the facade's ``atexit`` finalize, is part of the case).
Before: the exception left the loop's ``run_forever`` and ended the facade's loop thread, so every later
call and the exit's finalize waited forever; an interrupted call went on running behind its caller.
"""

from __future__ import annotations

import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from aio_datadist import LLMStatusCode

CHILD = pathlib.Path(__file__).with_name("compat_interrupt_child.py")
LIMIT_S = 60


def run_child(*args: str) -> dict:
    proc = subprocess.run([sys.executable, str(CHILD), *args], capture_output=True, text=True, timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize(("kind", "raised"), [("sync", "KeyboardInterrupt"), ("async", "SystemExit")])
def test_a_synchronizer_that_raises_an_interrupt_fails_its_task_and_nothing_else(kind: str, raised: str) -> None:
    out = run_child("synchronizer", kind, raised)
    assert out["link"] == LLMStatusCode.LLM_SUCCESS
    assert out["synchronize"] == LLMStatusCode.LLM_FAILED and out["seconds"] < 2, out
    assert out["facade_alive"] and out["facade_alive_after"], out
    assert out["links"] == [1], out  # the link is still up; the process then exited normally


@pytest.mark.parametrize(("kind", "raised"), [("sync", "SystemExit"), ("async", "KeyboardInterrupt")])
def test_a_synchronizers_interrupt_is_its_tasks_failure_and_never_leaves_the_task(kind: str, raised: str) -> None:
    """The other two cases, and what the facade's own catch hides: the transfer takes the synchronizer's
    interrupt as any other exception (``LLM_FAILED``); it never escapes the task through the loop's
    ``run_forever`` (the facade's last resort, which logs it), as it would stop a user's own loop."""
    proc = subprocess.run([sys.executable, str(CHILD), "synchronizer", kind, raised], capture_output=True, text=True,
                          timeout=LIMIT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["synchronize"] == LLMStatusCode.LLM_FAILED
    assert "escaped a task" not in proc.stderr, proc.stderr[-3000:]


def test_a_facade_call_that_raises_keyboard_interrupt_gives_it_to_its_caller_and_the_facade_goes_on() -> None:
    out = run_child("task")
    assert out == {"raised": "in a facade call", "facade_alive": True, "stats": 1}


def test_ctrl_c_in_a_blocking_call_cancels_the_call_before_it_is_raised() -> None:
    out = run_child("sigint")
    assert "returned" not in out and out["interrupted_after"] < 2, out
    assert out["tasks_left"] == [], out  # the link attempt ended before the interrupt reached the caller
    # the same cluster is linked anew (a silent listener again: a time-out of its own, not "another call")
    assert out["again"] == [LLMStatusCode.LLM_TIMEOUT, [LLMStatusCode.LLM_TIMEOUT]], out


def test_ctrl_c_before_the_loop_started_a_call_means_the_call_never_runs() -> None:
    """Row 151 for a call still queued (the loop busy with other work) when Ctrl-C reaches its caller: it is
    never started, so none of it runs behind the caller once the loop gets to it."""
    assert run_child("unstarted") == {"interrupted": True, "ran": []}


def test_ctrl_c_in_a_call_that_makes_a_cache_or_starts_a_transfer_leaves_nothing_it_made() -> None:
    """Before, a plain call the facade's loop had started ran whole, and the cancel that followed the interrupt
    threw its result away: the cache stayed allocated (its keys bound) with no handle to free it until finalize,
    a started transfer ran on (row 302; found by audit). v1's ``allocate_cache`` with ``lease_ms``, a call of its
    own, is interrupted too (audit, 2026-12-07: its undo could go unnoticed)."""
    out = run_child("made")
    transfers = {case: out.pop(f"{case} transfer") for case in ("during v2", "after v2", "during v1", "after v1")}
    assert len(out) == 18 and all(v is True for v in out.values()), out  # each cache released, its keys free
    cancelled = [LLMStatusCode.LLM_FAILED, True]  # and the caller was interrupted only once the call had ended
    # (the v1 transfer since an audit, 2026-12-07: only the v2 one was interrupted before)
    assert transfers == dict.fromkeys(transfers, cancelled), transfers


def test_ctrl_c_in_a_dialling_link_leaves_no_comm_dialling_behind_the_caller() -> None:
    """A dialler's ``link()`` is made in one step: interrupted there, the comm it made is unlinked before the
    interrupt reaches the caller. Before, the comm, its id never returned, dialled on for ``llm.LinkTotalTime``
    (found by review of row 302)."""
    out = run_child("link")
    assert out == {"interrupted": True, "comms_left": [], "tasks_left": []}, out


def _signal_child(mode: str) -> dict:
    """Run ``compat_signal_child.py`` in ``mode`` (its SIGUSR1 handler calls the facade), sending it SIGUSR1 every
    2 ms for 3.5 s; its counts."""
    import signal
    import time

    proc = subprocess.Popen([sys.executable, str(CHILD.with_name("compat_signal_child.py")), "4", mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and "ready" in proc.stdout.readline()
        end, sent = time.monotonic() + 3.5, 0
        while time.monotonic() < end and proc.poll() is None:
            proc.send_signal(signal.SIGUSR1)
            sent += 1
            time.sleep(0.002)
        out, err = proc.communicate(timeout=LIMIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, f"after {sent} signals: {err[-3000:]}"
    return json.loads(out.strip().splitlines()[-1])


def test_a_signal_handler_that_calls_the_facade_while_the_exit_holds_its_lock_is_refused_not_left_waiting() -> None:
    """Row 332, the lock the facade takes outside a call (the exit's ``refuse_calls``, ``loop()``): held, the
    thread counts as inside a call, so the handler's call is refused (found by the fix's review: it hung after
    1,642 signals)."""
    counts = _signal_child("refuse")
    # refused: some signals landed inside a call (hundreds do in a run); only a hang caught that before (audit)
    assert counts["rounds"] > 0 and counts["refused"] > 0 and counts["other"] == 0, counts


def test_a_signal_handler_that_calls_the_facade_inside_a_call_is_refused_at_once_not_left_waiting() -> None:
    """A signal handler runs on the main thread, inside whatever facade call it interrupted: its own facade call
    is refused at once (``LLM_FAILED``, naming the signal handler), one between calls runs. Before, it waited
    for good on the lock or the event of the call it interrupted (found by an audit: every run hung within
    about 1,700 signals, 2 ms apart)."""
    counts = _signal_child("calls")
    # refused: some signals landed inside a call (hundreds do in a run); only a hang caught that before (audit)
    assert counts["rounds"] > 0 and counts["refused"] > 0 and counts["other"] == 0, counts


def test_a_signal_handler_that_cancels_a_cache_task_inside_a_facade_call_is_not_left_waiting() -> None:
    """``CacheTask.cancel()`` from a signal handler (a graceful shutdown stopping the layer-wise transfer in flight)
    while the main thread makes facade calls: it takes none of the facade's locks, so it returns at once wherever
    the signal landed. Before, it took the facade's lock to find the loop, and a signal landing while the
    interrupted call held it left the handler waiting for good (3 of 3 runs hung; found by a hunt, 2026-12-07)."""
    counts = _signal_child("cancel")
    assert counts["rounds"] > 0 and counts["ran"] > 0 and counts["refused"] == counts["other"] == 0, counts


def test_ctrl_c_as_a_blocking_init_ends_leaves_no_endpoint_behind_the_caller() -> None:
    """The life an interrupted ``init`` started is finalized before the interrupt reaches its caller: nothing
    listens, the endpoint is finalized, and the next ``init`` starts a life; an interrupted second ``init`` (a
    no-op) leaves the life another call started. Before, init had nothing to undo it: the endpoint stayed
    initialised and listening behind the caller (found by the options audit, 2026-12-06; docs/clients.md)."""
    out = run_child("init")
    assert out == {"interrupted": True, "still_listening": False, "after": LLMStatusCode.LLM_ENGINE_FINALIZED,
                   "second_interrupted": True, "caches_after_second": 0}, out


def test_an_interrupted_init_leaves_the_life_another_threads_init_returned_on() -> None:
    """Thread T1's init starts the life and its caller is interrupted as it ends, while thread T2's init of the
    same endpoint returns on that life first: T1's undo leaves it, T2's caller holds it. The first form of the
    undo finalized it, and every call of T2's read LLM_ENGINE_FINALIZED after its init returned (found by its
    review)."""
    out = run_child("init_race")
    assert out == {"t1": "interrupted", "t2": "returned", "after": "live"}, out


SECOND_CTRL_C_CHILD = textwrap.dedent('''
    import asyncio, json, signal, socket, threading, time
    from aio_datadist import compat
    from aio_datadist.compat import LLMClusterInfo, LLMDataDist, LLMRole
    from aio_datadist.testing import loopback_options

    silent = socket.create_server(("127.0.0.1", 0))  # the kernel accepts the dial; nobody answers its handshake
    dd = LLMDataDist(LLMRole.DECODER, 2)
    dd.init(loopback_options())
    loop = compat._RUNNER.loop()
    main = threading.main_thread().ident
    interrupts = []

    def on_sigint(signum, frame):
        interrupts.append(time.monotonic())
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    HOLD_S = 1.0
    held = {}

    def hold():  # a callback of the caller's on the facade's loop (a blocking wait in an async synchronizer)
        held["from"] = time.monotonic()
        time.sleep(HOLD_S)
        held["to"] = time.monotonic()

    def ctrl_c_twice():
        time.sleep(0.3)
        loop.call_soon_threadsafe(hold)
        time.sleep(0.05)
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C: the call is cancelled, the caller waits for its end
        time.sleep(0.2)
        signal.pthread_kill(main, signal.SIGINT)  # Ctrl-C again, impatient

    threading.Thread(target=ctrl_c_twice, daemon=True).start()
    info = LLMClusterInfo()
    info.remote_cluster_id = 1
    info.append_remote_ip_info(*silent.getsockname())
    out = {}
    try:
        out["returned"] = str(dd.link_clusters([info], 8000))
    except KeyboardInterrupt:
        # The loop is held (it sleeps): reading its tasks from here is safe meanwhile.
        out["raised_at"] = time.monotonic()
        out["calls_running"] = sorted(t.get_coro().__qualname__ for t in asyncio.all_tasks(loop)
                                      if not t.done() and t.get_coro().__qualname__ == "_Call._run")
    time.sleep(HOLD_S + 0.3)
    out["interrupts"] = len(interrupts)
    out["raised_while_loop_held"] = "raised_at" in out and "to" in held and out["raised_at"] < held["to"]
    dd.finalize()
    print(json.dumps(out))
''')


def test_a_second_ctrl_c_while_a_cancelled_call_settles_does_not_leave_the_call_running() -> None:
    """Ctrl-C in a blocking call cancels the call and raises only once it ended (rows 151, 189), "so none of its
    work goes on (no byte lands) behind the caller". A second Ctrl-C while the caller waits for that end (the
    loop busy a moment) must not let the call run on behind the caller either (found by a hunt, 2026-12-07: it
    did; the interrupt is now raised once the call ended, ``INTERRUPT_SETTLE_S`` at most)."""
    proc = subprocess.run([sys.executable, "-c", SECOND_CTRL_C_CHILD], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "returned" not in out and out["interrupts"] == 2, out
    assert out["calls_running"] == [], out  # the call still ran on the facade's loop when its caller got the interrupt
