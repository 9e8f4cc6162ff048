"""The NIXL worker's pieces (``nixl_engine.CHUNK_BYTES``) against a scripted agent: no NIXL needed.

The agent says when each posting call returns (``DONE`` or ``PROC``) and what
``check_xfer_state`` answers, so the worker's paths between pieces run in a set
order: a close while a piece is in progress, the next piece posted from the
worker's check of transfers in progress, a refusal to post.
"""
from __future__ import annotations

import threading
import time
import types

import numpy as np
import pytest

from aio_datadist.transport import nixl_engine


class FakeQueue:
    def __init__(self):
        self.records = []
        self.lock = threading.Lock()

    def post(self, token, status, aux):
        with self.lock:
            self.records.append((token, status, aux))


class Handle:
    def __init__(self, idx, notif):
        self.idx = list(idx)
        self.notif = notif
        self.released = False

    def release(self):
        self.released = True


def make_api(agent_holder):
    class Agent:
        backends = ["UCX"]

        def __init__(self, name, config):
            self.handles = []
            self.state = {}          # id(handle) -> state for check_xfer_state
            self.on_transfer = None  # hook(handle) -> state
            self.check_hook = None
            agent_holder.append(self)

        def get_agent_metadata(self):
            return b""

        def get_backend_mem_types(self, b):
            return []

        def make_prepped_xfer(self, op, local, local_idx, remote, remote_idx, notif):
            h = Handle(local_idx, notif)
            self.handles.append(h)
            return h

        def transfer(self, handle, notif):
            return self.on_transfer(handle) if self.on_transfer else "DONE"

        def check_xfer_state(self, handle):
            if self.check_hook:
                return self.check_hook(handle)
            return self.state.get(id(handle), "PROC")

        def get_new_notifs(self):
            return {}

    return types.SimpleNamespace(nixl_agent_config=lambda **kw: None, nixl_agent=Agent)


def engine(monkeypatch, chunk):
    holder = []
    monkeypatch.setattr(nixl_engine, "load_nixl", lambda: make_api(holder))
    monkeypatch.setattr(nixl_engine, "CHUNK_BYTES", chunk)
    q = FakeQueue()
    eng = nixl_engine.NixlEngine(q, "fake")
    return eng, holder[0], q


def wait_for(pred, t=5.0):
    end = time.monotonic() + t
    while not pred():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


def test_a_transfer_in_pieces_that_the_close_stops_is_reported_cancelled(monkeypatch):
    # 3 rows of 10 bytes, 10-byte pieces: 3 pieces. The first stays PROC until the engine is closing.
    eng, agent, q = engine(monkeypatch, 10)
    agent.on_transfer = lambda h: "PROC"
    agent.check_hook = lambda h: "DONE" if eng._closing else "PROC"
    idx = np.arange(3, dtype=np.int32)
    eng.xfer(7, "READ", object(), idx, object(), idx, b"peer", b"", 30)
    wait_for(lambda: 7 in eng._active)
    eng.close()
    assert len(agent.handles) == 1  # only the first piece was ever posted
    assert q.records == [(7, -nixl_engine.errno.ECANCELED, 0)], q.records  # not (7, 0, 30): a success


def test_in_flight_counts_a_transfer_while_its_next_piece_is_posted(monkeypatch):
    # piece 1 PROC then DONE from _check_active; piece 2 posted from _check_active: in_flight() while inside it.
    eng, agent, q = engine(monkeypatch, 10)
    seen = []
    inside = threading.Event()
    go = threading.Event()

    def on_transfer(h):
        if len(agent.handles) == 1:
            return "PROC"
        inside.set()
        go.wait(5)
        return "DONE"

    agent.on_transfer = on_transfer
    agent.check_hook = lambda h: "DONE"
    idx = np.arange(2, dtype=np.int32)
    eng.xfer(9, "READ", object(), idx, object(), idx, b"peer", b"", 20)
    assert inside.wait(5)
    seen.append(eng.in_flight())
    seen.append(eng.copying(9))
    go.set()
    wait_for(lambda: q.records)
    eng.close()
    assert seen == [1, True], "in_flight() must count a transfer whose next piece is inside NIXL's posting call"
    assert q.records == [(9, 0, 20)]
    assert (eng.posted, eng.posted_bytes) == (1, 20)


def test_a_write_in_pieces_notifies_with_its_last_piece_only(monkeypatch):
    eng, agent, q = engine(monkeypatch, 20)
    idx = np.arange(4, dtype=np.int32)
    eng.xfer(5, "WRITE", object(), idx, object(), idx, b"peer", b"N", 40)
    wait_for(lambda: q.records)
    eng.close()
    assert [h.notif for h in agent.handles] == [b"", b"N"]
    assert q.records == [(5, 0, 40)]


@pytest.mark.parametrize("refusing", ["make_prepped_xfer", "transfer"])  # the handle, or the posting call
def test_a_transfer_nixl_refuses_is_not_counted_as_posted(monkeypatch, refusing):
    eng, agent, q = engine(monkeypatch, 10)

    def refuse(*a, **k):
        raise RuntimeError("NIXL_ERR_BACKEND")

    setattr(agent, refusing, refuse)
    idx = np.arange(2, dtype=np.int32)
    eng.xfer(3, "READ", object(), idx, object(), idx, b"peer", b"", 20)
    wait_for(lambda: q.records)
    eng.close()
    assert (eng.posted, eng.posted_bytes) == (0, 0), "a transfer NIXL refused (nothing posted) was counted"
    assert q.records == [(3, -nixl_engine.errno.EIO, 0)]


def test_a_cut_transfer_counts_only_the_pieces_it_posted(monkeypatch):
    # 3 pieces of 10 bytes; the first stays in progress until the cut, then reports DONE: no further piece.
    eng, agent, q = engine(monkeypatch, 10)
    agent.on_transfer = lambda h: "PROC"
    cut = threading.Event()
    agent.check_hook = lambda h: "DONE" if cut.is_set() else "PROC"
    idx = np.arange(3, dtype=np.int32)
    eng.xfer(4, "READ", object(), idx, object(), idx, b"peer", b"", 30)
    wait_for(lambda: 4 in eng._active)
    eng.cancel(4)
    cut.set()
    wait_for(lambda: q.records)
    eng.close()
    assert len(agent.handles) == 1
    assert q.records == [(4, -nixl_engine.errno.ECANCELED, 0)]
    assert (eng.posted, eng.posted_bytes) == (1, 10)


def test_pieces_split_rows_and_carry_the_notification_last():
    idx = np.arange(5, dtype=np.int32)
    pieces = list(nixl_engine._pieces("WRITE", None, idx, None, idx, b"N", 5 * (nixl_engine.CHUNK_BYTES // 2)))
    assert [p[2].tolist() for p in pieces] == [[0, 1], [2, 3], [4]]
    assert [p[5] for p in pieces] == [b"", b"", b"N"]
    assert sum(p[6] for p in pieces) == 5 * (nixl_engine.CHUNK_BYTES // 2)
    one = list(nixl_engine._pieces("READ", None, idx[:0], None, idx[:0], b"", 0))
    assert len(one) == 1 and one[0][6] == 0
