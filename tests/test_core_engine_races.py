"""The native engines' own API from several threads at once, and waits given a timeout that passed already.

Reachable through the core's public module only (``LLMDataDist`` never does this). Each case runs a script in
a process of its own (killed whole on a time-out), so a crash or a hang cannot take the test run down. Each
failed before:

* ``HostCopyEngine.submit`` racing ``close()``: the submit checked the engine open, read its triples without
  the GIL while the close joined every copy thread, then divided by the thread count, 0 (SIGFPE);
* ``SocketEngine.submit_recv`` racing ``close()``: the job was queued behind the engine thread's STOP and
  never applied: no record ever came and ``pending()`` stayed 1;
* ``close()`` from two threads at once (``HostCopyEngine``, ``SocketEngine``, ``HostStream``,
  ``StreamNotifier``): both joined the same thread (one hung) or drained and freed the same bookkeeping;
* ``HostStream.synchronize`` and ``StreamNotifier.close`` with a negative timeout on a held stream spun
  without the GIL for ever (``pthread_cond_timedwait`` refused the deadline's negative nanoseconds).
"""

from __future__ import annotations

import textwrap

import pytest
from test_core_fork import FREEZER
from test_core_fork import run as run_script


#: A notifier ``n`` (on queue ``q``) and a host stream ``s`` held by its gate ``g``, for a child script.
HELD_NOTIFIER = """
    from aio_datadist import _core

    q = _core.CompletionQueue()
    s = _core.HostStream()
    n = _core.StreamNotifier(q, "host")
    g = s.gate()
"""


def run(script: str, *args: str, timeout: float = 20) -> str:
    """Run ``script`` with ``args`` in a process of its own; its stdout (a crash or a time-out fails the test)."""
    return run_script(textwrap.dedent(script), args=args, timeout=timeout)


#: A submit whose triples (or pairs) take the engine a while to read without the GIL, closed from the main
#: thread meanwhile: 1-byte segments 2 bytes apart, so none coalesce. Prints what became of the job.
SUBMIT_VS_CLOSE = """
    import select, socket, sys, threading, time
    import numpy as np
    from aio_datadist import _core

    kind = sys.argv[1]
    n = 1_000_000
    buf = np.zeros(4 << 20, dtype=np.uint8)
    addrs = buf.ctypes.data + 2 * np.arange(n, dtype=np.uint64)
    if kind.startswith("copy"):
        segs = np.ones(3 * n, dtype=np.uint64)
        segs[0::3] = addrs
        segs[1::3] = buf.ctypes.data + (2 << 20)
    else:
        segs = np.ones(2 * n, dtype=np.uint64)
        segs[0::2] = addrs
    q = _core.CompletionQueue()
    a, b = socket.socketpair()
    a.setblocking(False)
    before = tids()
    eng = _core.HostCopyEngine(q, threads=2) if kind.startswith("copy") else _core.SocketEngine(q)
    if kind == "copy-held":  # the close joins a copy thread frozen for 1 s: the submit's read ends meanwhile
        freeze(min(tids() - before))
    outcome = []
    started = threading.Event()

    def submit():
        started.set()
        try:
            if kind.startswith("copy"):
                eng.submit(7, segs)
            else:
                eng.submit_recv(7, a.fileno(), segs)
            outcome.append("accepted")
        except ValueError as exc:
            outcome.append(f"refused: {exc}")

    th = threading.Thread(target=submit)
    th.start()
    started.wait()
    time.sleep(0.003)  # the submit reads its segments without the GIL now
    eng.close()
    th.join()
    if outcome == ["accepted"]:
        # Accepted before the close: the close cancels it, and its record still comes.
        got = q.drain() if select.select([q.fileno()], [], [], 3)[0] else []
        print("RECORDS", got, "PENDING", eng.pending())
    else:
        print("OUTCOME", outcome)
    q.close()
    a.close()
    b.close()
"""


@pytest.mark.parametrize("kind", ["copy", "copy-held", "socket"])
def test_submit_racing_close_is_refused_or_gets_its_record(kind):
    out = run_script(FREEZER, SUBMIT_VS_CLOSE, args=(kind,))
    closed = "SocketEngine is closed" if kind == "socket" else "HostCopyEngine is closed"
    assert f"OUTCOME ['refused: {closed}']" in out or ("RECORDS [(7, -125, " in out and "PENDING 0" in out), out


def test_a_submit_the_leaving_socket_thread_never_looked_at_gets_its_record():
    """The engine thread leaves (its epoll_wait fails) with a job queued since its last look at the commands:
    the job still ends with its record (CANCELLED), and a later submit is refused."""
    out = run_script(FREEZER, """
    import select, socket
    import numpy as np

    def epolls():
        found = set()
        for fd in os.listdir("/proc/self/fd"):
            try:
                if os.readlink(f"/proc/self/fd/{fd}") == "anon_inode:[eventpoll]":
                    found.add(int(fd))
            except OSError:  # the listing's own descriptor, closed already
                pass
        return found

    q = _core.CompletionQueue()
    a, b = socket.socketpair()
    a.setblocking(False)
    threads, polls = tids(), epolls()
    eng = _core.SocketEngine(q)
    (io_tid,) = tids() - threads
    (epfd,) = epolls() - polls
    freeze(io_tid)
    for _ in range(100_000):  # until it sleeps in its handler, out of epoll_wait
        if open(f"/proc/self/task/{io_tid}/syscall").read().split()[0] in ("35", "230"):
            break
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, epfd)  # its next epoll_wait fails (EINVAL): the thread leaves without another look
    os.close(null)
    buf = np.zeros(2, np.uint8)
    eng.submit_recv(7, a.fileno(), np.array([buf.ctypes.data, 1], np.uint64))
    got = q.drain() if select.select([q.fileno()], [], [], 3)[0] else []
    print("RECORDS", got, "PENDING", eng.pending())
    try:
        eng.submit_recv(8, a.fileno(), np.array([buf.ctypes.data + 1, 1], np.uint64))
    except ValueError as exc:
        print("LATER", exc)
    eng.close()
    q.close()
    a.close()
    b.close()
    """)
    assert "RECORDS [(7, -125, 0)] PENDING 0" in out and "LATER SocketEngine is closed" in out, out


#: Two threads close one object at once, many times over; both must return, and every object is let go of. An
#: engine or stream has work under way (a 4 MiB copy, a receive, a wait on a gate): whichever close() returns,
#: that has ended by then (pending() is 0).
DOUBLE_CLOSE = """
    import socket, sys, threading, time
    import numpy as np
    from aio_datadist import _core

    kind, rounds = sys.argv[1], int(sys.argv[2])
    src, dst = np.ones(4 << 20, np.uint8), np.zeros(4 << 20, np.uint8)
    for i in range(rounds):
        q = _core.CompletionQueue()
        stream = gate = None
        if kind == "copy":
            obj = _core.HostCopyEngine(q, threads=2)
            obj.submit(1, np.array([dst.ctypes.data, src.ctypes.data, dst.nbytes], np.uint64))
        elif kind == "socket":
            obj = _core.SocketEngine(q)
            a, b = socket.socketpair()
            a.setblocking(False)
            buf = np.zeros(1, np.uint8)
            obj.submit_recv(1, a.fileno(), np.array([buf.ctypes.data, 1], np.uint64))
        elif kind == "stream":
            obj = _core.HostStream()
            held = obj.gate()  # the close releases it
        else:
            obj = _core.StreamNotifier(q, "host")
            stream = _core.HostStream()
            gate = stream.gate()
            obj.notify(1, stream.handle)  # both closes wait on it, until the gate opens
        both = threading.Barrier(3 if gate else 2)
        said, left = [], []

        def close():
            both.wait()
            said.append(obj.close())
            if kind != "notifier":
                left.append(obj.pending())

        threads = [threading.Thread(target=close, daemon=True) for _ in range(2)]
        for t in threads:
            t.start()
        if gate:
            both.wait()
            time.sleep(0.001)
            gate.open()
        for t in threads:
            t.join(3)
        if any(t.is_alive() for t in threads):
            print("HUNG at round", i, flush=True)
            sys.exit(3)
        if kind == "notifier":
            assert said == [True, True], said
            stream.close()
        else:
            assert left == [0, 0], (i, left)
        if kind == "socket":
            a.close()
            b.close()
        q.close()
    print("LIVE", {k: v for k, v in _core.live_objects().items() if v})
"""


@pytest.mark.parametrize("kind", ["copy", "socket", "stream", "notifier"])
def test_close_from_two_threads_at_once_returns_in_both(kind):
    assert "LIVE {}" in run(DOUBLE_CLOSE, kind, "100" if kind == "notifier" else "300")


def test_a_second_close_is_not_woken_early_by_another_objects_close():
    """A close() that waits for another thread's close() of the same engine (joining a copy thread frozen for
    1 s) returns only once that one has finished, even when another object's close() wakes every waiter
    meanwhile (they share one condition variable): the copy threads are gone by then."""
    out = run_script(FREEZER, """
        import threading

        q = _core.CompletionQueue()
        other = _core.HostStream()
        before = tids()
        eng = _core.HostCopyEngine(q, threads=1)
        (worker,) = tids() - before
        freeze(worker)
        first = threading.Thread(target=eng.close)
        first.start()
        while _core.live_objects().get("HostCopyEngine"):  # the first close() has claimed the shutdown
            pass
        second = threading.Thread(target=lambda: (eng.close(), print("SECOND, threads", eng.threads, flush=True)))
        second.start()
        time.sleep(0.1)  # the second close() waits (nothing to await: the first is frozen for 1 s)
        other.close()  # wakes every close() waiting
        second.join(5)
        first.join(5)
        q.close()
    """, timeout=10)
    assert "SECOND, threads 0" in out, out


def test_close_while_another_thread_closes_returns_once_closed():
    """The later close() waits for the first one: when it returns, the engine is closed (its records came)."""
    out = run_script(HELD_NOTIFIER, """
        import select, threading

        n.notify(5, s.handle)
        first = threading.Thread(target=n.close, args=(5,))
        first.start()
        while not n.closed:  # the first close() is under way, waiting on the gate
            pass
        print("TIMED OUT", n.close(0.05))  # the first still runs
        threading.Timer(0.05, g.open).start()
        print("WAITED", n.close(5), q.drain() if select.select([q.fileno()], [], [], 0)[0] else [])
        first.join()
        s.close()
        q.close()
    """, timeout=20)
    assert "TIMED OUT False" in out and "WAITED True [(5, 0, 0)]" in out, out


def test_synchronize_with_a_timeout_that_passed_returns_at_once():
    """A negative timeout has passed: ``synchronize`` on a held stream returns False at once; an infinite one
    waits for as long as it takes; NaN raises ValueError (as ``HostCopyEngine.wait`` does, here on a job its
    frozen copy thread has not run: False at once for a negative timeout, True once it ran for an infinite one)."""
    out = run_script(FREEZER, """
        import math, threading
        import numpy as np

        q = _core.CompletionQueue()
        s = _core.HostStream()
        before = tids()
        eng = _core.HostCopyEngine(q, threads=1)
        (worker,) = tids() - before
        g = s.gate()
        print("SYNC", s.synchronize(-0.999), s.synchronize(-math.inf), flush=True)
        for call in (lambda: s.synchronize(math.nan), lambda: eng.wait(1, math.nan)):
            try:
                call()
                print("NAN accepted")
            except ValueError as exc:
                print("NAN", exc)
        freeze(worker)  # for 1 s: job 2 waits for it
        for _ in range(100_000):  # until it sleeps in its handler
            if open(f"/proc/self/task/{worker}/syscall").read().split()[0] in ("35", "230"):
                break
        src, dst = np.ones(64, np.uint8), np.zeros(64, np.uint8)
        eng.submit(2, np.array([dst.ctypes.data, src.ctypes.data, 64], np.uint64))
        print("COPY", eng.wait(2, -0.999), flush=True)
        threading.Timer(0.05, g.open).start()
        print("INF", s.synchronize(math.inf), eng.wait(2, math.inf), eng.pending(), flush=True)
        s.close()
        eng.close()
        q.close()
    """, timeout=10)
    assert "SYNC False False" in out and "COPY False" in out and "INF True True 0" in out, out
    assert out.count("NAN timeout must be a number of seconds, got nan") == 2, out


def test_notifier_close_with_a_timeout_that_passed_returns_at_once():
    """``StreamNotifier.close`` with a negative timeout and a notification the held stream has not reached
    returns False at once (the bookkeeping is left to the host function, with a ResourceWarning)."""
    out = run_script(HELD_NOTIFIER, """
        n.notify(1, s.handle)
        print("CLOSE", n.close(-0.999), flush=True)
        g.open()
        s.close()
        q.close()
    """, timeout=10)
    assert "CLOSE False" in out, out


def test_notifier_close_with_a_nan_or_infinite_timeout():
    """Row 260, the notifier's part: ``StreamNotifier.close(nan)`` raises ValueError and ``close(inf)`` waits
    without a bound, as ``synchronize`` and ``HostCopyEngine.wait`` (the tests above check those two only)."""
    out = run_script(HELD_NOTIFIER, """
        import math, threading

        n.notify(1, s.handle)
        try:
            n.close(math.nan)
            print("NAN accepted")
        except ValueError as exc:
            print("NAN", exc)
        threading.Timer(0.05, g.open).start()
        print("INF", n.close(math.inf), flush=True)
        s.close()
        q.close()
    """, timeout=10)
    assert "NAN timeout must be a number of seconds, got nan" in out and "INF True" in out, out
