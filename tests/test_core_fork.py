"""The native core across ``fork``, and a cancel that comes after its job ended.

Each case runs a script in a process of its own (and its own session, killed whole on a time-out), so a
hang cannot take the test run down. Each failed before:

* a forked child of a process with engines never exited: freeing the inherited ``HostCopyEngine`` destroyed
  condition variables the parent's copy threads waited on (they do not exist in the child), ``HostStream``
  joined a thread that is not there, ``SocketEngine.detach`` waited for the parent's engine thread, and a
  lock a parent's thread held at the fork stayed held in the child;
* ``SocketEngine.cancel(t)`` applied after job ``t`` ended hit the next job submitted under ``t`` (freed it
  while its submit was still queued: a double free), or, on a socket with no jobs yet, dereferenced a null
  fd state.
"""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]

#: What every script starts with: ``reap(pid)`` waits for a forked child at most ``bound`` seconds and kills
#: it past that ("hung").
PRELUDE = '''
import os, signal, sys, time
from aio_datadist import _core


def reap(pid, bound=3.0):
    deadline = time.monotonic() + bound
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    return "hung"
'''


def run(*parts: str, args: tuple[str, ...] = (), timeout: float = 30) -> str:
    """Run ``PRELUDE`` and ``parts`` with ``args``; its stdout (a non-zero exit or a time-out fails the test)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
           "CUDA_VISIBLE_DEVICES": ""}
    script = "\n".join(map(textwrap.dedent, (PRELUDE, *parts)))
    proc = subprocess.Popen([sys.executable, "-c", script, *args], cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s: {out}\n{err[-3000:]}") from None
    assert proc.returncode == 0, (proc.returncode, out, err[-3000:])
    return out


#: ``freeze(tid)`` stops thread ``tid`` for 1 s wherever it is (a SIGHUP handler that is ``sleep``: sleep(1)),
#: with no GIL and no Python involved; ``tids()`` lists the process's threads.
FREEZER = '''
import ctypes

libc = ctypes.CDLL(None, use_errno=True)
libc.signal.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.signal.restype = ctypes.c_void_p
libc.signal(signal.SIGHUP, ctypes.cast(libc.sleep, ctypes.c_void_p).value)


def tids():
    return {int(t) for t in os.listdir("/proc/self/task")}


def freeze(tid):
    libc.syscall(234, os.getpid(), tid, signal.SIGHUP)  # tgkill
'''


# The parent's objects, each with a thread waiting (or a lock shared with one), as in any idle endpoint;
# a notification waits behind a gate on the host stream.
ENGINES = '''
import array
import numpy as np

q = _core.CompletionQueue()
copier = _core.HostCopyEngine(q, threads=2)
sockets = _core.SocketEngine(q)
stream = _core.HostStream()
notifier = _core.StreamNotifier(q, "host")
line = _core._HostFnLine(q)
gate = stream.gate()
notifier.notify(7, stream.handle)
line.enqueue(8)
src, dst = np.arange(64, dtype=np.uint8), np.zeros(64, np.uint8)
triples = array.array("Q", [dst.ctypes.data, src.ctypes.data, 64])
time.sleep(0.1)


def parent_still_works():
    """After the child: the parent's objects are untouched (its fds open, its threads there)."""
    gate.open()
    assert stream.synchronize(2.0)
    copier.submit(1, triples)
    got, deadline = [], time.monotonic() + 2
    while len(got) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
        got += q.drain()
    assert sorted(got) == [(1, 0, 64), (7, 0, 0)], got
    assert bytes(dst) == bytes(src)
    line.close(); notifier.close(); stream.close(); sockets.close(); copier.close(); q.close()
    assert not any(_core.live_objects().values()), _core.live_objects()
    return "ok"
'''


def test_a_forked_child_lets_go_of_the_parents_engines_and_exits():
    """The child ends (its interpreter frees the parent's objects), drops them, or closes them: each way it
    exits at once, its counts of live objects end at zero, and the parent's objects go on working."""
    out = run(ENGINES, '''
    results = {}
    for mode in ("exit", "drop", "close"):
        pid = os.fork()
        if pid == 0:
            if mode == "drop":
                del q, copier, sockets, stream, notifier, line, gate
                import gc; gc.collect()
            elif mode == "close":
                for obj in (line, notifier, stream, sockets, copier, q, line, copier):  # twice: idempotent
                    obj.close()
                gate = None
                assert not any(_core.live_objects().values()), _core.live_objects()
                assert q.closed
            sys.exit(0)
        results[mode] = reap(pid)
    print("children:", results)
    print("parent:", parent_still_works())
    ''')
    assert "children: {'exit': 0, 'drop': 0, 'close': 0}" in out, out
    assert "parent: ok" in out, out


def test_a_forked_child_of_a_process_with_an_endpoint_exits_and_leaves_its_ledger():
    """An initialised endpoint (its copy threads idle), then a fork: a child that just ends, and one that first
    lets go of the parent's endpoint as documented (``finalize`` in the child), both exit; and neither clears
    the parent's read ledger, a memfd both map (before, the child's ``Ledger`` zeroed every word it held when
    it was collected: the parent's same-host peers then asked for every pull; found by review)."""
    out = run('''
    import asyncio
    from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMDataDist, LLMRole, Placement
    from aio_datadist.testing import link_table_of
    from peers import options

    loop = asyncio.new_event_loop()
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    loop.run_until_complete(dd.init(options(transport="local")))
    cache = dd.kv_cache_manager.allocate_blocks_cache(CacheDesc(2, (8, 64), DataType.DT_FLOAT16, Placement.HOST),
                                                      BlocksCacheKey(7, 0))
    ledger = link_table_of(dd)._ledger
    words = [ledger.word(cache.cache_id)]
    time.sleep(0.1)
    results = {}
    for mode in ("exit", "finalize"):
        pid = os.fork()
        if pid == 0:
            if mode == "finalize":
                asyncio.run(dd.finalize())
                del dd, cache, ledger
                import gc; gc.collect()
            sys.exit(0)
        results[mode] = reap(pid)
        words.append(ledger.word(cache.cache_id))
    print("children:", results)
    print("ledger words:", words == [cache.cache_id] * 3, words)
    dd.kv_cache_manager.deallocate_cache(cache)
    loop.run_until_complete(dd.finalize())
    loop.close()
    ''')
    assert "children: {'exit': 0, 'finalize': 0}" in out, out
    assert "ledger words: True" in out, out


@pytest.mark.parametrize("stop", ["finalize", "switch_role"])
def test_a_forked_child_does_not_keep_the_parents_finalized_listeners(stop):
    """A child forked from a process with a listening endpoint (TCP door and same-host share socket) lives on,
    holding its copies of the fds, and even lets go of the parent's endpoint (``finalize`` there): once the
    parent stopped listening (its ``finalize``, or ``switch_role`` to DECODER without ``llm.listenIpInfo``), a
    dial of either listener is refused at once and the TCP port can be listened on again. Before, closing the
    parent's fd left the child's copy listening: a dial was taken into the backlog and never answered (a peer's
    link_clusters waited out its whole time-out) and listening on the port again failed ``EADDRINUSE`` for as
    long as the child lived (row 285; found by audit)."""
    out = run(f"STOP = {stop!r}", '''
    import asyncio, socket
    from aio_datadist import LLMDataDist, LLMRole
    from aio_datadist.testing import share_listener_of
    from peers import options

    loop = asyncio.new_event_loop()
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    loop.run_until_complete(dd.init(options(listen=True, transport="auto", switch_role=True)))
    address, share = dd.listen_address, share_listener_of(dd).name
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(w)
        asyncio.run(dd.finalize())  # lets go: the parent's endpoint
        os.read(r, 1)  # lives on until the parent says
        os._exit(0)
    os.close(r)
    if STOP == "finalize":
        loop.run_until_complete(dd.finalize())
    else:
        loop.run_until_complete(dd.switch_role(LLMRole.DECODER))
        print("listens:", dd.listen_address, share_listener_of(dd))
    for family, kind, where in ((socket.AF_INET, socket.SOCK_STREAM, address),
                                (socket.AF_UNIX, socket.SOCK_SEQPACKET, share)):
        with socket.socket(family, kind) as sock:
            sock.settimeout(2)
            try:
                sock.connect(where)
                print("dial: taken", family)
            except (ConnectionRefusedError, FileNotFoundError):
                print("dial: refused", family)
    again = LLMDataDist(LLMRole.PROMPT, 8)
    config = options(listen=True, transport="tcp")
    config["llm.listenIpInfo"] = f"{address[0]}:{address[1]}"
    loop.run_until_complete(again.init(config))
    print("listens again:", again.listen_address == address)
    loop.run_until_complete(again.finalize())
    loop.run_until_complete(dd.finalize())
    os.write(w, b"x")
    print("child:", reap(pid))
    loop.close()
    ''')
    assert out.count("dial: refused") == 2, out
    assert stop == "finalize" or "listens: None None" in out, out
    assert "listens again: True" in out and "child: 0" in out, out


def test_a_forked_child_is_refused_work_on_the_parents_objects_and_can_make_its_own():
    """Each call that would submit, wait or read the parent's eventfd raises at once in the child (it would
    hang, or steal the parent's wake-ups); objects the child makes work there."""
    out = run(ENGINES, '''
    pid = os.fork()
    if pid == 0:
        refused = []
        calls = {
            "drain": q.drain, "post": lambda: q.post(1), "fileno": q.fileno,
            "copy": lambda: copier.submit(2, triples), "copy.cancel": lambda: copier.cancel(2),
            "copy.wait": lambda: copier.wait(2, 1.0), "copy.pending": copier.pending,
            "send": lambda: sockets.submit_send(3, 0, array.array("Q", [0, 0])),
            "recv": lambda: sockets.submit_recv(3, 0, array.array("Q", [0, 0])),
            "socket.cancel": lambda: sockets.cancel(3), "detach": lambda: sockets.detach(0),
            "socket.pending": sockets.pending,
            "enqueue": lambda: stream.enqueue_copies(*(array.array("Q", [v]) for v in triples)),
            "synchronize": lambda: stream.synchronize(1.0), "gate": stream.gate,
            "notify": lambda: notifier.notify(9, stream.handle), "notify.cancel": lambda: notifier.cancel(7),
            "line": lambda: line.enqueue(9), "fire": lambda: line.fire(1),
            "engine on its queue": lambda: _core.HostCopyEngine(q),
        }
        for name, call in calls.items():
            try:
                call()
            except RuntimeError as exc:
                if "forked child" in str(exc) and str(os.getpid()) in str(exc):
                    refused.append(name)
        q2 = _core.CompletionQueue()
        copier2 = _core.HostCopyEngine(q2, threads=1)
        dst[:] = 0
        copier2.submit(1, triples)
        got, deadline = [], time.monotonic() + 2
        while not got and time.monotonic() < deadline:
            time.sleep(0.01)
            got = q2.drain()
        own = "ok" if got == [(1, 0, 64)] and bytes(dst) == bytes(src) else f"failed: {got}"
        copier2.close(); q2.close()
        print("refused:", sorted(set(calls) - set(refused)) or "all", "own:", own, flush=True)
        os._exit(0)
    print("child:", reap(pid))
    print("parent:", parent_still_works())
    ''')
    assert "refused: all own: ok" in out, out
    assert "child: 0" in out and "parent: ok" in out, out


def test_a_forked_child_closes_a_queue_whose_lock_a_parent_thread_held():
    """The copy threads post a stream of records, each under the queue's lock (and slow: 256 epoll sets watch
    the queue's eventfd), when they are stopped where they are for 1 s (a SIGHUP handler that sleeps, on
    those threads only), one of them as a rule inside a post; the process forks then. The child closes the
    inherited queue, and exits. Two rounds, since a round catches the lock held about nine times in ten."""
    out = run(FREEZER, '''
    import array, select
    q = _core.CompletionQueue()
    watchers = [select.epoll() for _ in range(256)]
    for w in watchers:
        w.register(q.fileno(), select.EPOLLIN)
    before = tids()
    copier = _core.HostCopyEngine(q, threads=2)
    time.sleep(0.02)
    workers = tids() - before
    empty = array.array("Q")
    children = []
    for first in (1, 20001):
        for token in range(first, first + 20000):  # jobs without bytes: the threads do little but post
            copier.submit(token, empty)
        for tid in workers:
            freeze(tid)
        time.sleep(0.01)
        pid = os.fork()
        if pid == 0:
            q.close()
            os._exit(0)
        children.append(reap(pid, 1.0))
        while copier.pending():  # the threads are back and done
            time.sleep(0.02)
        q.drain()
    print("children:", children)
    copier.close(); q.close()
    for w in watchers:
        w.close()
    ''')
    assert "children: [0, 0]" in out, out


# The engine thread is held for 1 s inside epoll_wait (a SIGHUP handler that sleeps, on that thread only);
# meanwhile job 1 becomes able to end, 60 other sockets fill, and then cancel(1) is posted. When the thread
# wakes it ends job 1, then spends a while reading the 60 sockets, during which the caller sees job 1's
# record and submits a new job under token 1 (on the same socket, or on a fresh one the engine has no state
# for); the stale cancel is applied after that.
CANCEL_REUSE = '''
import array, select, socket, threading
import numpy as np


def pair():
    a, b = socket.socketpair()
    for s in (a, b):
        s.setblocking(False)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 1 << 20)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1 << 20)
    return a, b


where = sys.argv[1]
q = _core.CompletionQueue()
before = tids()
eng = _core.SocketEngine(q)
time.sleep(0.05)
(io_tid,) = tids() - before
a, a2 = pair()
fresh, fresh2 = pair()
others = [pair() for _ in range(60)]
CHUNK = 1 << 20
bufs = [np.empty(CHUNK * 4, np.uint8) for _ in others]  # never touched: the reads fault their pages in
one = np.zeros(8, np.uint8)
eng.submit_recv(1, a.fileno(), array.array("Q", [one.ctypes.data, 1]))
for i, ((b, _), buf) in enumerate(zip(others, bufs)):
    eng.submit_recv(100 + i, b.fileno(), array.array("Q", [buf.ctypes.data, buf.nbytes]))
if where != "detached":  # the newest job, queued behind 1 on its socket: not the cancel's
    eng.submit_recv(2, a.fileno(), array.array("Q", [one.ctypes.data + 2, 1]))
time.sleep(0.05)
freeze(io_tid)
time.sleep(0.05)
a2.send(b"x")
payload = b"z" * CHUNK
for _, b2 in others:
    view = memoryview(payload)
    while view:
        try:
            view = view[b2.send(view):]
        except BlockingIOError:
            break
if where == "detached":  # the cancel is applied after a detach of its fd: it finds no state there
    detacher = threading.Thread(target=eng.detach, args=(a.fileno(),))
    detacher.start()
    time.sleep(0.05)
print("cancel(1):", eng.cancel(1), flush=True)
records, resubmitted = [], False
deadline = time.monotonic() + 5
while time.monotonic() < deadline:
    select.select([q.fileno()], [], [], 0.05)
    for rec in q.drain():
        records.append(rec)
        if rec[0] == 1 and not resubmitted:
            resubmitted = True  # token 1 is over: the caller may use it again
            sock, peer = (fresh, fresh2) if where == "fresh" else (a, a2)
            eng.submit_recv(1, sock.fileno(), array.array("Q", [one.ctypes.data + 1, 1]))
            if where != "detached":
                a2.send(b"c")  # token 2's byte (on the same socket, it comes before the new job's)
            peer.send(b"y")
    if resubmitted and sum(1 for r in records if r[0] in (1, 2)) >= (2 if where == "detached" else 3):
        break
print("token 1 records:", [r for r in records if r[0] == 1], flush=True)
print("second byte:", bytes(one[1:2]), flush=True)
print("token 2 records:", [r for r in records if r[0] == 2], "byte:", bytes(one[2:3]), flush=True)
if where == "detached":
    detacher.join(5)
eng.close(); q.close()
'''


@pytest.mark.parametrize("where", ["same", "fresh", "detached"])
def test_a_stale_cancel_does_not_hit_the_next_job_under_its_token(where):
    """The new job under token 1 (on the same socket, or on one the engine has no state for yet) is not
    cancelled: both records are successes and the new job's byte lands; nor is the job queued behind the
    cancelled one on its socket (token 2). A cancel applied after its fd was detached is skipped."""
    out = run(FREEZER, CANCEL_REUSE, args=(where,))
    assert "cancel(1): True" in out, out
    assert "token 1 records: [(1, 0, 1), (1, 0, 1)]" in out, out
    assert "second byte: b'y'" in out, out
    if where != "detached":
        assert "token 2 records: [(2, 0, 1)] byte: b'c'" in out, out  # the cancel took no other job on its socket


@pytest.mark.skipif(not os.access("/proc/sys/kernel/ns_last_pid", os.W_OK),
                    reason="choosing a child's process id needs a writable /proc/sys/kernel/ns_last_pid")
def test_a_grandchild_that_gets_its_dead_grandparents_process_id_is_still_refused_its_objects():
    """A makes the objects, forks C and exits; C forks grandchildren until one gets A's process id. The maker is
    told by the forks between it and here, not by the id, so that grandchild is refused work as any other
    descendant (before, it took A's engine for its own: a submit was queued for threads not there, and a close
    would take a lock one of them may have held; found by review)."""
    out = run('''
    import array, select
    told_r, told_w = os.pipe()  # A's id, then EOF once A is reaped
    over_r, over_w = os.pipe()  # EOF once C is done
    maker = os.fork()
    if maker == 0:  # A
        q = _core.CompletionQueue()
        copier = _core.HostCopyEngine(q, threads=1)
        time.sleep(0.05)
        if os.fork() == 0:  # C
            os.close(told_w)
            os.close(over_r)
            a = int(os.read(told_r, 64))
            while os.read(told_r, 64):
                pass
            for _attempt in range(20):
                with open("/proc/sys/kernel/ns_last_pid", "w") as f:
                    f.write(str(a - 1))
                grandchild = os.fork()
                if grandchild == 0:
                    if os.getpid() != a:
                        os._exit(3)
                    try:
                        copier.submit(1, array.array("Q"))
                        print("grandchild with A's id: submit accepted", flush=True)
                    except RuntimeError:
                        print("grandchild with A's id: submit refused", flush=True)
                    copier.close()
                    q.close()
                    os._exit(0)
                if reap(grandchild) != 3:
                    break
            os._exit(0)
        os.close(told_r)
        os.write(told_w, str(os.getpid()).encode())
        os._exit(0)
    os.close(told_r)
    os.close(over_w)
    reap(maker)  # A is gone: its id is free
    os.close(told_w)
    select.select([over_r], [], [], 20)  # C is not ours to wait for: its end of the pipe closes as it exits
    ''', timeout=30)
    assert "grandchild with A's id: submit refused" in out, out


def test_a_forked_child_reading_streamed_jobs_of_a_parents_copier_does_not_hang():
    """``HostCopyEngine.streamed_jobs`` takes the engine's lock, which a parent's copy thread holds for a moment
    at each job it takes and ends: forked while the threads work through a backlog of jobs without bytes, a
    child must be refused it at once (RuntimeError, as ``pending()`` is), not wait for ever on a lock no
    thread of the child will let go of."""
    out = run(FREEZER, '''
    import array
    q = _core.CompletionQueue()
    before = tids()
    copier = _core.HostCopyEngine(q, threads=2)
    time.sleep(0.02)
    workers = tids() - before
    for tid in workers:
        freeze(tid)  # 1 s: the backlog below is queued meanwhile
    empty = array.array("Q")
    for token in range(1, 300001):
        copier.submit(token, empty)
    deadline = time.monotonic() + 3
    while copier.pending() == 300000 and time.monotonic() < deadline:
        pass  # until the threads are back at work
    pids = []
    while copier.pending() > 20000 and len(pids) < 40:
        pid = os.fork()
        if pid == 0:
            try:
                copier.streamed_jobs
                os._exit(3)  # answered: the lock was free at the fork
            except RuntimeError:
                os._exit(0)
        pids.append(pid)
    time.sleep(0.5)  # each child's call is at once or never: reaped together, each waited for no longer
    children = [reap(pid, 0.05) for pid in pids]
    print("hung:", children.count("hung"), "answered:", children.count(3), "of", len(children))
    while copier.pending():
        time.sleep(0.01)
        q.drain()
    q.drain()
    copier.close(); q.close()
    ''')
    assert "hung: 0 answered: 0 of" in out, out


def test_a_child_forked_while_links_are_made_gets_none_of_their_fd_claims():
    """A child forked while the parent's links are being made (a serving framework forking workers as links come
    up) does not inherit the fds promised to them: they are the parent's, never made in the child, and nothing
    there would give them back. Before, the child kept them promised for its whole life: under an fd limit of 320,
    with 41 fds open, its own link was refused ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` (found by a hunt)."""
    out = run('''
    import asyncio, resource, socket
    from aio_datadist import LLMDataDist, LLMRole, fd_budget
    from aio_datadist.testing import loopback_options
    from peers import cluster_info

    resource.setrlimit(resource.RLIMIT_NOFILE, (320, 320))

    async def own_link():
        prompt, decoder = LLMDataDist(LLMRole.PROMPT, 11), LLMDataDist(LLMRole.DECODER, 12)
        await prompt.init({**loopback_options(listen=True), "aio.MaxPendingHandshakes": "1"})  # a small reserve
        await decoder.init(loopback_options())
        try:
            return (await decoder.link_clusters([cluster_info(11, prompt.listen_address)], timeout=3000))[0]
        finally:
            await decoder.finalize()
            await prompt.finalize()

    async def main():
        stall = socket.create_server(("127.0.0.1", 0), backlog=64)  # takes the dials, never answers
        decoder = LLMDataDist(LLMRole.DECODER, 2)
        await decoder.init({**loopback_options(), "aio.DataChannels": "8"})  # 18 fds promised per link
        dials = [asyncio.ensure_future(decoder.link_clusters([cluster_info(100 + i, stall.getsockname())],
                                                             timeout=10000)) for i in range(12)]
        deadline = time.monotonic() + 5
        while fd_budget._promised < 12 * 18 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        print("promised at the fork:", fd_budget._promised, flush=True)
        held = fd_budget.claim(5, 0)  # a parent's claim that the child lets go of: it gives back none of the child's
        pid = os.fork()
        if pid == 0:
            promised = fd_budget._promised
            held.release()
            promised = min(promised, fd_budget._promised)
            code = asyncio.run(own_link())
            print("child: promised", promised, "own link", code.name, flush=True)
            os._exit(0)
        print("child:", reap(pid, 10))
        held.release()
        for dial in dials:
            dial.cancel()
        await asyncio.gather(*dials, return_exceptions=True)
        await decoder.finalize()
        stall.close()
        print("parent: promised", fd_budget._promised)

    asyncio.run(main())
    ''')
    assert "promised at the fork: 216" in out, out  # (before the 5 of ``held``)
    assert "child: promised 0 own link LLM_SUCCESS" in out and "child: 0" in out, out
    assert "parent: promised 0" in out, out


@pytest.mark.parametrize("lock", ["datadist._STARTING", "metrics._EXPORTERS_LOCK"])
def test_a_child_forked_while_a_parent_thread_holds_a_module_lock_does_not_hang_on_it(lock):
    """``init`` takes ``datadist._STARTING`` for a few assignments, ``instrument`` ``metrics._EXPORTERS_LOCK``: a
    fork from another thread in that moment left the child a copy held by a thread it does not have, and its
    first ``init`` (``instrument``) waited for ever. Each is made anew in the child."""
    out = run(f'''
    import asyncio, threading
    from aio_datadist import LLMDataDist, LLMRole, datadist, metrics
    from aio_datadist.testing import loopback_options

    held, release = threading.Event(), threading.Event()

    def hold():
        with {lock}:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait(5)
    pid = os.fork()
    if pid == 0:
        async def main():
            dd = LLMDataDist(LLMRole.PROMPT, 1)
            await dd.init(loopback_options())
            if "{lock}".startswith("metrics"):
                from prometheus_client import CollectorRegistry
                metrics.instrument(dd, CollectorRegistry())
            await dd.finalize()
        asyncio.run(main())
        print("child: done", flush=True)
        os._exit(0)
    print("child:", reap(pid, 10))
    release.set()
    holder.join()
    ''')
    assert "child: done" in out and "child: 0" in out, out
