"""A layer-wise push (``transfer_cache_async``) to a linked peer that lies or stops on the control connection.

The destination is a hand-written peer (``_rawpeer.RawLink``, blocking sockets in a worker thread) that
links to the PROMPT on loopback as a DECODER, answers heartbeats, and answers the PROMPT's ``PUSH_REQ``
(its ids are even: the PROMPT accepted the link) as each test says:

- replies that carry ids of requests the PROMPT never sent it (the task's own watch of the link) must not
  take that watch away: the task still ends at once when the link goes while the prefill stalls;
- a reply of the wrong kind to a push (``PROBE_ACK``, ``UNLINK_ACK``, a successful ``DONE`` before any
  ``RESP``) ends the task with an ``LLMException``, never with an ``AttributeError`` out of the library;
- a receiver that stops answering part-way (no ``RESP``, bytes never read, no ``DONE``) ends the task within
  its timeout plus the bounded give-up.
"""

from __future__ import annotations

import asyncio
import contextlib
import select
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import torch
from _harness import endpoint, settle, state
from _rawpeer import RawLink, recv_exactly, recv_frame
from peers import fill, port_of

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
    wire,
)
from aio_datadist.testing import link_to
from aio_datadist.wire import Msg

pytestmark = pytest.mark.asyncio(loop_factories=["asyncio", "uvloop"])

S = LLMStatusCode
PROMPT, ATTACKER = 1, 2
#: 2 layers (K0, V0, K1, V1) of 4 blocks of 128 bytes.
BLOCKS = CacheDesc(4, (4, 4, 16), DataType.DT_FLOAT16, Placement.HOST)
TIMEOUT_MS = 300  # the PROMPT's sync_kv_timeout: each layer push's timeout
BOUND_S = 1.5  # what a task may take past its cause to end (the give-up waits ABORT_ACK_S, 1 s, at most)


class Gate(LayerSynchronizer):
    """Releases layer ``i`` once the test calls :meth:`open`; says when the transfer waits for a layer."""

    def __init__(self) -> None:
        self.released: dict[int, asyncio.Event] = {}
        self.waiting = asyncio.Event()

    def open(self, layer: int) -> None:
        self.released.setdefault(layer, asyncio.Event()).set()

    async def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        self.waiting.set()
        await self.released.setdefault(layer_index, asyncio.Event()).wait()
        return True


class Receiver:
    """The hostile DECODER: links, then serves its control connection in a thread until :meth:`stop`.

    ``on_push(raw, req_id, fields)`` is called for each ``PUSH_REQ``; the thread answers ``PROBE``s itself.
    ``act`` runs a callable on the thread between reads (the tests' way to make it send something now).
    """

    def __init__(self, address: tuple[str, int], on_push: Callable[[RawLink, int, dict], None]) -> None:
        self.raw = RawLink(address, ATTACKER, PROMPT, None)
        self.on_push = on_push
        self.pushes: list[int] = []
        self.probe_reply: Callable[[int], bytes] = lambda rid: wire.encode(Msg.PROBE_ACK, rid)
        self.unlink_reply: Callable[[int], bytes] | None = None  # None: UNLINK goes unanswered
        self.errors: list[BaseException] = []
        self._stop = threading.Event()
        self._todo: list[Callable[[RawLink], None]] = []
        self._thread = threading.Thread(target=self._run, name="hostile receiver", daemon=True)

    def start(self) -> None:
        self.raw.connect()
        self._thread.start()

    def act(self, what: Callable[[RawLink], None]) -> None:
        self._todo.append(what)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.raw.close()

    def _run(self) -> None:
        raw = self.raw
        try:
            while not self._stop.is_set():
                while self._todo:
                    self._todo.pop(0)(raw)
                if raw.ctl is None:
                    return
                readable, _, _ = select.select([raw.ctl], [], [], 0.02)
                if not readable:
                    continue
                msg, req_id, fields = recv_frame(raw.ctl)
                if msg is Msg.PROBE:
                    raw.send_raw(self.probe_reply(req_id))
                elif msg is Msg.UNLINK and self.unlink_reply is not None:
                    raw.send_raw(self.unlink_reply(req_id))
                elif msg is Msg.PUSH_REQ:
                    self.pushes.append(req_id)
                    self.on_push(raw, req_id, fields)
        except (OSError, ConnectionError) as exc:  # the PROMPT dropped the link
            self.errors.append(exc)


def push_total(fields: dict) -> int:
    """The bytes a ``PUSH_REQ`` of whole blocks carries: each tensor's rows, ``nbytes`` each."""
    return fields["tensor_count"] * len(fields["rows"]) * fields["nbytes"]


def accept(raw: RawLink, req_id: int, fields: dict) -> None:
    raw.send_raw(wire.encode(Msg.RESP, req_id, status=0, total=push_total(fields), cache_id=-1, row=-1, text=""))


def honest(raw: RawLink, req_id: int, fields: dict) -> None:
    """What an owner does: accept, read every byte, confirm."""
    accept(raw, req_id, fields)
    recv_exactly(raw.data[fields["channel"]], push_total(fields))
    raw.send_raw(wire.encode(Msg.DONE, req_id, status=0, text=""))


@contextlib.asynccontextmanager
async def prompt_and(on_push: Callable[[RawLink, int, dict], None]) -> AsyncIterator[tuple[Any, Receiver]]:
    """A listening PROMPT (TCP, ``TIMEOUT_MS``) and the hostile receiver linked to it."""
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="tcp", sync_kv_timeout=TIMEOUT_MS) as dd:
        receiver = Receiver(port_of(dd), on_push)
        await asyncio.to_thread(receiver.start)
        try:
            async with asyncio.timeout(5):
                while link_to(dd, ATTACKER) is None:
                    await asyncio.sleep(0.005)
            yield dd, receiver
        finally:
            await asyncio.to_thread(receiver.stop)


@contextlib.contextmanager
def source(dd: Any) -> Iterator[KvCache]:
    """A filled blocks cache of the PROMPT's, freed on the way out."""
    src = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS)
    fill(src, 7)
    try:
        yield src
    finally:
        dd.kv_cache_manager.deallocate_cache(src)


def start(dd: Any, src: KvCache, synchronizer: LayerSynchronizer) -> Any:
    """Push layers 0 and 1 of blocks 0 and 1 into blocks 2 and 3 of the receiver's blocks cache."""
    return dd.kv_cache_manager.transfer_cache_async(src, synchronizer, [
        TransferWithCacheKeyConfig(BlocksCacheKey(ATTACKER, 0))], [0, 1], [2, 3])


async def ended(task: Any, within: float) -> tuple[BaseException | None, float]:
    """How ``task`` ended (None: it succeeded) and how long it took; a task still running after ``within``
    seconds fails the test (it is cancelled first, so nothing is left behind)."""
    began = time.monotonic()
    try:
        async with asyncio.timeout(within):
            await task
    except TimeoutError:
        task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(asyncio.shield(asyncio.ensure_future(_wait(task))), 3)
        pytest.fail(f"the task was still running {within} s later")
    except BaseException as exc:  # the test says which ending it expects
        return exc, time.monotonic() - began
    return None, time.monotonic() - began


async def _wait(task: Any) -> None:
    with contextlib.suppress(BaseException):
        await task


def spray_replies(raw: RawLink) -> None:
    """Replies to every even id up to 64: ids of the PROMPT's, none of them asked of this peer
    (its heartbeat PROBEs aside, whose answers change nothing)."""
    frames = []
    for req_id in range(2, 66, 2):
        frames.append(wire.encode(Msg.DONE, req_id, status=0, text=""))
        frames.append(wire.encode(Msg.RESP, req_id, status=0, total=0, cache_id=-1, row=-1, text=""))
    raw.send_raw(b"".join(frames))


async def test_replies_to_requests_never_sent_do_not_take_the_tasks_link_watch():
    """The task watches its destination's link while the prefill stalls (a request id of its own, never sent):
    forged replies to that id used to complete the watch, so the link's end went unnoticed and the task
    waited on the synchronizer for ever."""
    async with prompt_and(honest) as (dd, receiver):
        baseline = state(dd)
        with source(dd) as src:
            gate = Gate()
            task = start(dd, src, gate)
            async with asyncio.timeout(2):
                await gate.waiting.wait()  # the driver waits for layer 0, its watch of the link in place
            loop = asyncio.get_running_loop()
            sent = loop.create_future()
            receiver.act(spray_replies)
            receiver.act(lambda raw: loop.call_soon_threadsafe(sent.set_result, None))
            await asyncio.wait_for(sent, 2)
            await asyncio.sleep(0.1)  # the forged replies are read
            link = link_to(dd, ATTACKER)
            assert link is not None and link.broken is None  # replies to unknown ids are dropped, as before
            await asyncio.to_thread(receiver.stop)  # the destination goes
            exc, _ = await ended(task, BOUND_S)
            del task, link
        assert isinstance(exc, LLMException) and exc.status_code == S.LLM_LINK_FAILED, repr(exc)
        assert not receiver.pushes  # the gate never opened
        del exc
        await settle(dd, baseline)


def answer_with(frame: Callable[[int], bytes]) -> Callable[[RawLink, int, dict], None]:
    def on_push(raw: RawLink, req_id: int, fields: dict) -> None:
        raw.send_raw(frame(req_id))
    return on_push


WRONG_KINDS = {
    "probe_ack": lambda rid: wire.encode(Msg.PROBE_ACK, rid),
    "unlink_ack": lambda rid: wire.encode(Msg.UNLINK_ACK, rid),
    "done_before_resp": lambda rid: wire.encode(Msg.DONE, rid, status=0, text=""),
}


@pytest.mark.parametrize("kind", list(WRONG_KINDS))
async def test_a_reply_of_the_wrong_kind_to_a_layer_push_ends_the_task_with_an_llm_exception(kind):
    assert await both_layers_pushed_to(answer_with(WRONG_KINDS[kind])) == S.LLM_LINK_FAILED


PROBE_WRONG_KINDS = {
    "resp": lambda rid: wire.encode(Msg.RESP, rid, status=0, total=0, cache_id=-1, row=-1, text=""),
    "done": WRONG_KINDS["done_before_resp"],
}


@pytest.mark.parametrize("kind", list(PROBE_WRONG_KINDS))
async def test_a_reply_of_the_wrong_kind_to_a_probe_breaks_the_link(kind):
    """``check_link_status`` waits for ``PROBE_ACK``: a transfer's reply (``RESP``, ``DONE``) in its place is a
    protocol error that fails the link and the probe with ``LLM_LINK_FAILED``, never an answer (row 139)."""
    async with prompt_and(honest) as (dd, receiver):
        receiver.probe_reply = PROBE_WRONG_KINDS[kind]
        with pytest.raises(LLMException) as raised:
            await asyncio.wait_for(dd.check_link_status(ATTACKER), BOUND_S)
        assert raised.value.status_code == S.LLM_LINK_FAILED, repr(raised.value)


@pytest.mark.parametrize("kind", list(PROBE_WRONG_KINDS))
async def test_a_reply_of_the_wrong_kind_to_the_unlink_of_a_closing_endpoint_breaks_the_link(kind):
    """The ``UNLINK`` a closing endpoint sends waits for ``UNLINK_ACK``: a transfer's reply in its place is a
    protocol error that fails the link (``LLM_LINK_FAILED``), never the peer's consent (row 139)."""
    async with prompt_and(honest) as (dd, receiver):
        receiver.unlink_reply = PROBE_WRONG_KINDS[kind]
        link = link_to(dd, ATTACKER)
        await asyncio.wait_for(dd.finalize(), BOUND_S)
        assert link.broken is not None and link.broken.status_code == S.LLM_LINK_FAILED, link.broken
        del link


async def both_layers_pushed_to(receive: Any) -> LLMStatusCode:
    """A layer-wise task whose two layers are ready at once, pushing to a raw receiver that answers with
    ``receive``: the status code of the LLMException it ended with (within its timeout + ``BOUND_S``); the
    receiver saw a push and the endpoint holds nothing afterwards."""
    async with prompt_and(receive) as (dd, receiver):
        baseline = state(dd)
        with source(dd) as src:
            gate = Gate()
            task = start(dd, src, gate)
            gate.open(0)
            gate.open(1)
            exc, _ = await ended(task, TIMEOUT_MS / 1000 + BOUND_S)
            del task
        assert isinstance(exc, LLMException), repr(exc)
        code = exc.status_code
        assert receiver.pushes
        del exc
        await settle(dd, baseline)
    return code


def no_resp(raw: RawLink, req_id: int, fields: dict) -> None:
    pass


def never_reads(raw: RawLink, req_id: int, fields: dict) -> None:
    accept(raw, req_id, fields)


def no_done(raw: RawLink, req_id: int, fields: dict) -> None:
    accept(raw, req_id, fields)
    recv_exactly(raw.data[fields["channel"]], push_total(fields))


STOPS = {"no_resp": no_resp, "accepts_and_never_reads": never_reads, "reads_and_never_confirms": no_done}


@pytest.mark.parametrize("where", list(STOPS))
async def test_a_receiver_that_stops_answering_mid_push_ends_the_task_within_its_timeout(where):
    """The sender's wait for the receiver's acknowledgement is bounded: the push's timeout, then its give-up
    (the ABORT's answer, ``ABORT_ACK_S``); the heartbeat is answered throughout, so only the timeouts end it.
    A v1 task's time-out reads ``LLM_WAIT_PROCESS_TIMEOUT`` (row 273)."""
    assert await both_layers_pushed_to(STOPS[where]) in (S.LLM_WAIT_PROCESS_TIMEOUT, S.LLM_LINK_FAILED)


# -- the receiving end: a pusher that stops part-way ------------------------------------------------------


def push_layer_half(address: tuple[str, int], report: Callable[[dict], None], after: threading.Event) -> None:
    """As a PROMPT: push layer 0 of blocks 2 and 3 into the DECODER's blocks cache (``BlocksCacheKey(ATTACKER,
    0)``) with a 100 ms timeout, send half of its bytes, answer PROBEs until the DECODER's ``DONE`` says it
    gave up, ``report`` what it said, then (once ``after`` is set) send the other half on the same channel."""
    total = 2 * 2 * BLOCKS.shape[1] * BLOCKS.shape[2] * 2  # 2 tensors x 2 blocks of 4 x 16 float16
    with RawLink(address, PROMPT, ATTACKER, None, role=LLMRole.PROMPT) as raw:
        raw.connect()
        rid = raw.new_req_id()
        raw.send_raw(wire.encode(
            Msg.PUSH_REQ, rid, channel=0, target_kind=wire.Target.BLOCKS_KEY, cluster_id=ATTACKER, cache_id=-1,
            key_req_id=2**64 - 1, prefix_id=2**64 - 1, model_id=0, batch_index=0, layer_first=0, layer_last=0,
            tensor_num_per_layer=2, tensor_count=2, data_type=int(BLOCKS.data_type.value), offset=0,
            nbytes=total // 4, flags=wire.ReqFlag.BLOCKS | wire.ReqFlag.EXACT, timeout_ms=100, rows=(2, 3)))
        _, resp = raw.answer(rid)
        assert resp["status"] == 0 and resp["total"] == total, resp
        raw.data[0].sendall(b"\x11" * (total // 2))
        aborted, done = False, None
        while not (aborted and done):  # the DECODER's serving timeout (100 ms + 1 s) ends it: DONE saying why,
            msg, got, fields = recv_frame(raw.ctl)  # then ABORT (the channel reset; row 314)
            if msg is Msg.PROBE:
                raw.send_raw(wire.encode(Msg.PROBE_ACK, got))
            aborted = aborted or msg is Msg.ABORT
            if msg is Msg.DONE and got == rid:
                done = fields
        report({"aborted": aborted, **done})
        after.wait(5)
        with contextlib.suppress(OSError):
            raw.data[0].sendall(b"\x22" * (total - total // 2))


async def test_a_pusher_that_stops_mid_layer_ends_its_serving_and_lands_nothing_afterwards():
    """The receiving end of a layer push: its ``PushWatch`` is completed only by pushes that succeed, and a
    pusher that stops part-way fails the watched layer once the DECODER stops serving the push, within its
    timeout + 1 s (``DONE`` with a failure, the channel reset): ``watch.wait()`` raises the serving's
    ``LLM_TIMEOUT`` then, and the bytes the pusher sends after that land nowhere."""
    async with endpoint(LLMRole.DECODER, ATTACKER, listen=True, transport="tcp") as dd:
        dst = dd.kv_cache_manager.allocate_blocks_cache(BLOCKS, BlocksCacheKey(ATTACKER, 0))
        try:
            baseline = state(dd)
            with dd.kv_cache_manager.watch_pushes(dst, [2, 3], range(0, 1)) as watch:
                after = threading.Event()
                loop = asyncio.get_running_loop()
                said: asyncio.Future = loop.create_future()

                def report(done: dict) -> None:
                    loop.call_soon_threadsafe(said.set_result, done)

                pushing = asyncio.ensure_future(asyncio.to_thread(push_layer_half, port_of(dd), report, after))
                try:
                    done = await asyncio.wait_for(said, 3)
                    assert done["aborted"] and done["status"] != 0, done
                    gave_up = [t.clone() for t in dst.tensors]
                    after.set()
                    await asyncio.wait_for(pushing, 3)
                finally:
                    after.set()
                    await asyncio.wait([pushing], timeout=5)
                assert watch.layer(0).done(), "the push that failed part-way left the watched layer pending"
                with pytest.raises(LLMException) as info:
                    await watch.wait(timeout=300)
                assert info.value.status_code == S.LLM_TIMEOUT and "did not land" in str(info.value), info.value
                await asyncio.sleep(0.3)  # the late bytes have their 300 ms to land
                assert all(torch.equal(a, b) for a, b in zip(gave_up, dst.tensors, strict=True))
            await settle(dd, baseline)
        finally:
            dd.kv_cache_manager.deallocate_cache(dst)


async def test_a_link_that_went_before_the_task_first_ran_still_ends_it():
    """The link goes in the pass the task was started in, before its driver took its watch: the watch of a
    link down already fails at once, so the stalled task still ends with ``LLM_LINK_FAILED``."""
    async with prompt_and(honest) as (dd, receiver):
        baseline = state(dd)
        with source(dd) as src:
            task = start(dd, src, Gate())
            link_to(dd, ATTACKER).fail(LLMException("gone", status_code=S.LLM_LINK_FAILED))
            exc, _ = await ended(task, BOUND_S)
            del task
        assert isinstance(exc, LLMException) and exc.status_code == S.LLM_LINK_FAILED, repr(exc)
        del exc
        await settle(dd, baseline)
