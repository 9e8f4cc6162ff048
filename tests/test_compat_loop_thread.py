"""The blocking facade's loop thread outlives code on its loop that stops the loop, and a call waiting when
the thread ends anyway (the exit stops it) fails instead of hanging.

Each case runs a private ``_LoopThread``, as the facade's own: a facade loop that hangs would hang every later
test of the run. Before: a ``loop.stop()`` from code on the loop (an async synchronizer treating the loop as
its own) ended the facade's thread, and ``run()`` waited on a future nothing would complete, with no liveness
check: that call, every later call and the process hung (row 303; found by audit).
"""

from __future__ import annotations

import asyncio
import linecache
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from aio_datadist import LLMException, LLMStatusCode, compat


def in_thread(call) -> tuple[threading.Thread, dict]:
    """``call()`` started in a thread of its own, and what it will have returned or raised."""
    box: dict = {}

    def run() -> None:
        try:
            box["returned"] = call()
        except Exception as exc:
            box["raised"] = exc

    thread = threading.Thread(target=run, daemon=True)  # one that hangs must not hold the test run's exit
    thread.start()
    return thread, box


def test_code_that_stops_the_facades_loop_does_not_end_it(caplog: pytest.LogCaptureFixture) -> None:
    runner = compat._LoopThread()

    async def stopper() -> str:
        asyncio.get_running_loop().stop()
        return "stopped"

    try:
        with caplog.at_level(logging.ERROR, logger="aio_datadist.compat"):
            thread, out = in_thread(lambda: [runner.run(stopper()), runner.run(stopper()),
                                             runner.call(lambda: "later")])
            thread.join(1)
        assert out == {"returned": ["stopped", "stopped", "later"]}
        assert [r.getMessage() for r in caplog.records] == [
            "aio_datadist.compat: code on the blocking facade's loop stopped it (loop.stop()); the loop goes on"]
    finally:
        runner.stop()


def test_a_call_waiting_when_the_loop_thread_ends_fails_instead_of_hanging() -> None:
    runner = compat._LoopThread()
    started = threading.Event()

    async def forever() -> None:
        started.set()
        await asyncio.Event().wait()

    try:
        thread, out = in_thread(lambda: runner.run(forever()))
        assert started.wait(1)
        runner.stop()  # as the exit does
        thread.join(1)
        raised = out.get("raised")
        assert isinstance(raised, LLMException) and raised.status_code == LLMStatusCode.LLM_FAILED, out
        assert "event-loop thread has ended (the facade's loop was stopped (the process exits))" in str(raised)
        assert runner.call(lambda: "later") == "later"  # the next call starts a loop of its own
    finally:
        runner.stop()


def test_a_call_whose_loop_thread_cannot_start_leaves_nothing_counted_as_being_sent(monkeypatch):
    """A call is counted as being sent to the loop until it is (the exit's stop waits for those, row 327). A
    loop thread that cannot start ("can't start new thread"; at interpreter shutdown on 3.12) counted it for
    good, and every later stop waited ``STOP_CALLS_S`` for a call that did not exist (the second review)."""
    runner = compat._LoopThread()

    def cannot(self: threading.Thread) -> None:
        raise RuntimeError("can't start new thread")

    async def one() -> int:
        return 1

    with monkeypatch.context() as patched:
        patched.setattr(threading.Thread, "start", cannot)
        with pytest.raises(RuntimeError):
            runner.run(one())
    assert not runner._sending
    assert runner.run(one()) == 1 and not runner._sending
    runner.stop()


def _interrupting(function: str, event: str, line: str | None) -> Callable[..., Any]:
    """A trace function that raises KeyboardInterrupt (as a SIGINT checked there would) once, at ``event`` in
    ``function`` (at the source line containing ``line``, if given)."""
    fired: list[int] = []

    def tracer(frame: Any, what: str, arg: Any) -> Any:
        if frame.f_code.co_name != function:
            return None
        if not fired and what == event and (line is None or line in linecache.getline(frame.f_code.co_filename,
                                                                                        frame.f_lineno)):
            fired.append(1)
            raise KeyboardInterrupt
        return tracer

    return tracer


@pytest.mark.parametrize("function, event, line", [
    ("_start_locked", "line", "return self._loop, self._end"),  # a SIGINT checked as its lock is let go: counted
    ("_sent", "call", None),  # ... as the uncount begins
])
def test_an_interrupt_between_counting_a_call_and_sending_it_does_not_hold_the_stop(function, event, line):
    """A KeyboardInterrupt (the main thread's) that lands where the count of calls being sent and its uncount
    are not one step left the count up for good, and the exit's stop waited ``STOP_CALLS_S`` for a call that
    did not exist (the third review). The stop waits only for other threads' calls: only the main thread is
    interrupted, and the exit runs there."""
    runner = compat._LoopThread()

    async def one() -> int:
        return 1

    try:
        assert runner.run(one()) == 1
        sys.settrace(_interrupting(function, event, line))
        try:
            with pytest.raises(KeyboardInterrupt):
                runner.run(one())
        finally:
            sys.settrace(None)
        assert runner.run(one()) == 1
        assert not runner._others_sending()
    finally:
        started = time.monotonic()
        runner.stop()
    assert time.monotonic() - started < compat.STOP_CALLS_S


def test_a_loop_held_during_the_last_finalizes_gets_no_late_wait(monkeypatch):
    """Row 327: the exit's wait for calls sent late (``compat.LATE_CALLS_S``) runs only once the last finalizes
    ended; on a loop a callback holds meanwhile it would wait 3 s more for nothing (found by a review)."""
    import time

    monkeypatch.setattr(compat, "EXIT_FINALIZE_S", 0.2)
    monkeypatch.setattr(compat, "EXIT_CANCEL_S", 0.0)
    monkeypatch.setattr(compat, "STOP_JOIN_S", 0.5)
    runner = compat._LoopThread()
    release = threading.Event()

    async def nothing() -> None:
        return None

    runner.run(nothing())  # the loop runs

    async def held_last() -> None:
        release.wait(10)  # a callback holds the loop while the last finalizes run

    loop, thread = runner._loop, runner._thread
    assert loop is not None and thread is not None
    started = time.monotonic()
    runner.stop(last=held_last)
    took = time.monotonic() - started
    release.set()
    thread.join(5)  # the held loop was left running (its thread did not stop within the join): ended here
    assert not thread.is_alive()
    loop.close()
    # the last finalizes get EXIT_FINALIZE_S + EXIT_CANCEL_S + 1 = 1.2 s, then the join 0.5 s: about 1.7 s
    assert took < 2.5, f"stop took {took:.1f} s"


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # (interrupted before it ran)
@pytest.mark.parametrize("via", ["loop", "run"])
def test_an_interrupt_anywhere_as_the_facade_takes_its_lock_leaves_it_free_and_the_thread_unmarked(via):
    """Row 332: a KeyboardInterrupt raised at any call or return in the facade's code (or a context manager's)
    in ``loop()`` or a call, where CPython delivers a signal's (a trace function raises it at the n-th such
    event, for every n), leaves the facade's lock free and the thread not marked inside a call, so the next call
    of this thread and of another run. Before (found by a review), the lock was taken in a context manager of
    Python's, and an interrupt as its ``__enter__`` returned left the lock held (another thread's call then
    waited, the exit hung) and the thread marked for good."""
    import contextlib
    import sys

    watched = {compat.__file__, contextlib.__file__}

    runner = compat._LoopThread()

    async def nothing() -> None:
        return None

    def target() -> None:
        runner.loop() if via == "loop" else runner.run(nothing())

    try:
        runner.run(nothing())
        lock, marked = runner._lock, []

        class Watched:  # the facade's lock, noting whether the thread is marked inside a call as it takes it
            def __enter__(self) -> bool:
                marked.append(getattr(runner._inside, "call", False))
                return lock.__enter__()

            def __exit__(self, *exc: object) -> None:
                lock.__exit__(*exc)

        runner._lock = Watched()  # type: ignore[assignment]
        try:
            target()
        finally:
            runner._lock = lock
        assert marked and all(marked), marked  # held only marked (a handler's call then is refused, not stuck)
        interrupted = 0
        for n in range(1, 400):
            seen = [0]

            def local(frame, event, arg, n=n, seen=seen):  # noqa: ANN001, ANN202
                if event in ("call", "return"):  # (a line event is no point a signal is delivered at)
                    seen[0] += 1
                    if seen[0] == n:
                        raise KeyboardInterrupt
                return local

            def tracer(frame, event, arg, local=local):  # noqa: ANN001, ANN202
                return local(frame, event, arg) if frame.f_code.co_filename in watched else None

            sys.settrace(tracer)
            try:
                target()
            except KeyboardInterrupt:
                interrupted += 1
            finally:
                sys.settrace(None)
            assert not runner._lock.locked(), n
            assert not getattr(runner._inside, "call", False), n
            if seen[0] < n:  # it ran to its end before the n-th event: every point was tried
                break
        assert interrupted > 5
        done = threading.Event()
        threading.Thread(target=lambda: (runner.run(nothing()), done.set()), daemon=True).start()
        assert done.wait(5)
        runner.run(nothing())
        import gc

        gc.collect()  # the coroutines an interrupt left unstarted warn here, under this test's filter
    finally:
        if not runner._lock.locked():  # (held, the stop would wait for it for good: the failure is reported)
            runner.stop()


@pytest.mark.filterwarnings("ignore:coroutine .* was never awaited:RuntimeWarning")  # (interrupted before it ran)
def test_an_interrupt_as_the_facades_first_call_starts_its_loop_leaves_one_loop_for_the_next_call():
    """A KeyboardInterrupt at any call or return of the facade's code while its first call starts the loop, or as
    a call of ``threading``'s it makes there returns (the thread's ``start``, the wait for it), leaves one loop:
    the next call runs on it and the stop ends its thread. Before (found by a review), an interrupt as the start
    or the wait returned left the loop's thread running without the facade knowing it; the next call started a
    second one, and the first ran, with its fds, until the process ended."""
    import gc
    import sys

    async def nothing() -> None:
        return None

    ours = "aio_datadist-compat"
    for n in range(1, 300):
        runner = compat._LoopThread()
        before = {t for t in threading.enumerate() if t.name == ours}
        seen = [0]

        def local(frame, event, arg, n=n, seen=seen):  # noqa: ANN001, ANN202
            if event in ("call", "return"):
                seen[0] += 1
                if seen[0] == n:
                    raise KeyboardInterrupt
            return local

        def tracer(frame, event, arg, local=local):  # noqa: ANN001, ANN202
            name = frame.f_code.co_filename
            if name == compat.__file__:
                return local(frame, event, arg)
            if name == threading.__file__ and frame.f_back is not None and \
                    frame.f_back.f_code.co_filename == compat.__file__:  # a call of threading's the facade made
                return lambda f, e, a: local(f, e, a) if e == "return" else None
            return None

        sys.settrace(tracer)
        try:
            runner.run(nothing())
        except KeyboardInterrupt:
            pass
        finally:
            sys.settrace(None)
        runner.run(nothing())  # the next call
        runner.stop()
        left = [t for t in threading.enumerate() if t.name == ours and t not in before and t.is_alive()]
        assert not left, n
        if seen[0] < n:
            break
    gc.collect()  # the coroutines an interrupt left unstarted warn here, under this test's filter


def test_an_exit_finalize_still_running_past_its_bound_is_cancelled_before_the_loop_stops(monkeypatch, caplog):
    """Row 238: the exit's finalizes get ``EXIT_FINALIZE_S``; one still waiting then (for a busy device) is
    cancelled and ended before ``_finalize_taken`` returns (the loop stops next), not left pending with it."""
    import types

    assert compat.EXIT_FINALIZE_S > compat.QUIESCE_S  # a finalize waits QUIESCE_S for a busy device: not cut short
    monkeypatch.setattr(compat, "EXIT_FINALIZE_S", 0.2)
    monkeypatch.setattr(compat, "EXIT_CANCEL_S", 1.0)
    cancelled = threading.Event()

    async def finalize_for_a_busy_device() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    live = [types.SimpleNamespace(_dd=types.SimpleNamespace(finalize=finalize_for_a_busy_device))]

    async def exit_finalize() -> tuple[float, bool]:
        started = time.monotonic()
        await compat._finalize_taken(live)  # type: ignore[arg-type]
        return time.monotonic() - started, cancelled.is_set()

    with caplog.at_level(logging.WARNING, logger=compat.log.name):
        took, ended = asyncio.run(asyncio.wait_for(exit_finalize(), 5))
    assert ended and took < 1.5, (took, ended)
    assert "1 endpoint(s) not finalized within" in caplog.text

    # the exit itself (``_finalize_at_exit``) waits for those finalizes, not STOP_JOIN_S only, before the stop
    monkeypatch.setattr(compat, "STOP_JOIN_S", 0.05)
    endpoint = type("Endpoint", (), {})()
    endpoint._dd = live[0]._dd
    monkeypatch.setattr(compat, "_LIVE", {endpoint})
    monkeypatch.setattr(compat, "_EXIT_FINALIZED", set())
    cancelled.clear()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert compat._finalize_at_exit(loop)
        assert cancelled.is_set()  # ended before the loop stops, not left pending with it
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        loop.close()
