"""A data channel of ours is handed to one transfer at a time, whatever the peer does to it.

- A peer's ``ABORT`` naming the current generation of a channel of ours that no transfer holds resets it
  and has it redialled; the redialled channel is free once, not twice, so two transfers never run on it
  at once (before: each such ``ABORT`` queued the channel once more, two pulls then read each other's
  answers on one socket and two pushes interleaved their bytes there and both reported success).
- A redial that ends after the link failed closes its new connection instead of installing it into the
  broken link, where nothing would close it.
- Requests of the peer's that name a channel we are redialling wait for it at most
  ``links.MAX_SERVED_PER_CHANNEL`` at a time; the rest are refused at once, so a peer that holds the
  redial's ``ATTACH_OK`` cannot have us keep its requests' rows without bound.

The peer's records are sent by its own endpoint's link object (in this process), as a buggy peer would.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import torch
from peers import LOCALHOST, cluster_info, fill, port_of
from tls_certs import client_context, make_pki, server_context

from aio_datadist import (
    CacheDesc,
    CacheIndex,
    CacheKey,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    wire,
)
from aio_datadist.links import MAX_SERVED_PER_CHANNEL
from aio_datadist.testing import link_to
from aio_datadist.wire import Msg, encode

pytestmark = pytest.mark.asyncio
PKI = make_pki("channel-queue")
SMALL = CacheDesc(2, (4, 64 << 10), DataType.DT_FLOAT16, Placement.HOST)  # 4 rows of 128 KiB per tensor
BIG = CacheDesc(2, (2, 2 << 20), DataType.DT_FLOAT16, Placement.HOST)  # 2 rows of 4 MiB per tensor


@contextlib.asynccontextmanager
async def _endpoint(role: LLMRole, cluster_id: int, *, listen: bool = False,
                    tls: bool = False) -> AsyncIterator[LLMDataDist]:
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.transport = "tcp"
    cfg.data_channels = 1  # one channel per direction: a second transfer must wait for it
    if listen:
        cfg.listen_ip_info = f"{LOCALHOST}:0"
        if tls:
            cfg.tls_server_context = server_context(PKI)
    if tls:
        cfg.tls_client_context = client_context(PKI)
    async with LLMDataDist(role, cluster_id) as dd:
        await dd.init(cfg.generate_options())
        yield dd


@contextlib.asynccontextmanager
async def _pair(tls: bool = False) -> AsyncIterator[tuple[LLMDataDist, LLMDataDist]]:
    async with _endpoint(LLMRole.PROMPT, 1, listen=True, tls=tls) as prompt, \
            _endpoint(LLMRole.DECODER, 2, tls=tls) as decoder:
        assert (await decoder.link_clusters([cluster_info(1, port_of(prompt))]))[0] == LLMStatusCode.LLM_SUCCESS
        yield prompt, decoder


async def _until(what: Callable[[], bool], bound: float = 5.0) -> None:
    async with asyncio.timeout(bound):
        while not what():
            await asyncio.sleep(0.005)


def _queued(link: Any, index: int) -> int:
    return list(link.free._queue).count(index)


async def _abort_idle(victim: Any, sender: Any, index: int) -> None:
    """``sender`` (the peer's end) aborts ``victim``'s idle channel ``index`` at its current generation, as
    an owner that cut a transfer there would; wait until the channel is back."""
    await _until(lambda: _queued(victim, index) == 1)
    generation = victim.channels[index].generation
    sender.send(Msg.ABORT, 0, channel=index, generation=generation)
    sender.send(Msg.ABORT, 0, channel=index, generation=generation)  # the same word twice
    await _until(lambda: victim.channels[index].generation == generation + 1
                 and victim.channels[index].sock is not None)
    await asyncio.sleep(0.05)


def _one_job_at_a_time(link: Any) -> list[int]:
    """Wraps ``link.move``: the list's last item is the most jobs that ran at once on one channel."""
    running: dict[int, int] = {}
    most = [0]
    move = link.move

    def counted(index: int, *args: Any, **kwargs: Any) -> Any:
        fut = move(index, *args, **kwargs)
        running[index] = running.get(index, 0) + 1
        most[0] = max(most[0], running[index])
        fut.add_done_callback(lambda _: running.__setitem__(index, running[index] - 1))
        return fut

    link.move = counted
    return most


@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_a_channel_the_peer_aborted_while_idle_is_handed_to_one_pull_at_a_time(tls: bool) -> None:
    async with _pair(tls) as (prompt, decoder):
        source = prompt.kv_cache_manager.allocate_cache(SMALL, [CacheKey(1, 1), CacheKey(1, 2)])
        values = fill(source, 7)
        first, second = (decoder.kv_cache_manager.allocate_cache(SMALL) for _ in range(2))
        ours, theirs = link_to(decoder, 1), link_to(prompt, 2)
        assert list(ours.own) == [0]
        await _abort_idle(ours, theirs, 0)
        assert _queued(ours, 0) == 1
        most = _one_job_at_a_time(ours)
        async with asyncio.timeout(10):
            await asyncio.gather(
                decoder.kv_cache_manager.pull_cache(CacheKey(1, 1), first, batch_index=0, timeout=3000),
                decoder.kv_cache_manager.pull_cache(CacheKey(1, 2), second, batch_index=0, timeout=3000))
        assert most[0] == 1
        for dst, row in ((first, 0), (second, 1)):
            assert all(torch.equal(d[0], v[row]) for d, v in zip(dst.tensors, values, strict=True))
        assert ours.broken is None and theirs.broken is None


async def test_two_pushes_after_the_peer_reset_our_idle_channel_land_their_own_rows() -> None:
    """The honest form: the decoder resets (and redials) the prompt's idle channel; the prompt's two pushes
    then take turns on it. Before, both ran on it at once and both rows landed wrong with a success."""
    async with _pair() as (prompt, decoder):
        source = prompt.kv_cache_manager.allocate_cache(BIG)
        values = fill(source, 11)
        dst = decoder.kv_cache_manager.allocate_cache(BIG)
        pusher, receiver = link_to(prompt, 2), link_to(decoder, 1)
        assert list(pusher.own) == [1]
        await _until(lambda: _queued(pusher, 1) == 1)
        generation = pusher.channels[1].generation
        receiver.reset_channel(1, tell_peer=True)
        await _until(lambda: pusher.channels[1].generation == generation + 1 and pusher.channels[1].sock is not None)
        await asyncio.sleep(0.05)
        assert _queued(pusher, 1) == 1
        async with asyncio.timeout(15):
            await asyncio.gather(*(
                prompt.kv_cache_manager.push_cache(CacheIndex(2, dst.cache_id, row), source, src_batch_index=row,
                                                   timeout=5000) for row in (0, 1)))
        for row in (0, 1):
            assert all(torch.equal(d[row], v[row]) for d, v in zip(dst.tensors, values, strict=True)), row


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("tls", [False, True], ids=["tcp", "tls"])
async def test_a_redial_that_ends_after_the_link_failed_is_closed_not_installed(tls: bool) -> None:
    async with _pair(tls) as (_prompt, decoder):
        link = link_to(decoder, 1)
        dial = link._redial_data
        dialled: list[int] = []

        async def dial_then_fail(*args: Any) -> Any:
            conn = await dial(*args)  # attached: the peer acknowledged it
            plain = conn if not hasattr(conn, "_transport") else conn._transport.get_extra_info("socket")
            dialled.append(os.dup(plain.fileno()))  # to see the connection's end from here
            link.fail(LLMException("failed while redialling", status_code=LLMStatusCode.LLM_LINK_FAILED))
            return conn

        link._redial_data = dial_then_fail
        link.reset_channel(0, tell_peer=True)
        await _until(lambda: 0 not in link.redialling)
        assert link.channels[0].sock is None, "a redialled connection was installed into a broken link"
        try:
            # The connection is closed: the peer's end of it (the whole link) goes, and our dup sees its end.
            await _until(lambda: _peer_gone(dialled[0]), 3.0)
        finally:
            os.close(dialled[0])


def _peer_gone(fd: int) -> bool:
    import socket

    with socket.socket(fileno=os.dup(fd)) as sock:
        sock.setblocking(False)
        try:
            return sock.recv(1, socket.MSG_PEEK) == b""
        except BlockingIOError:
            return False
        except OSError:
            return True


def _pull_request(req_id: int, channel: int, rows: tuple[int, ...] | None = None) -> bytes:
    """A pull of ``rows`` (``wire.MAX_ROWS`` of them, 512 KiB, by default) of a cache the owner does not have."""
    return encode(Msg.PULL_REQ, req_id, channel=channel, target_kind=0, cluster_id=2, cache_id=987654,
                  key_req_id=0, prefix_id=0, model_id=0, batch_index=0, layer_first=0, layer_last=-1,
                  tensor_num_per_layer=2, tensor_count=2, data_type=1, offset=0, nbytes=16, flags=0,
                  timeout_ms=1000, rows=ROWS if rows is None else rows)


ROWS = tuple(range(1 << 40, (1 << 40) + 65536))  # wire.MAX_ROWS rows


def _waiting(link: Any) -> int:
    """Requests of the peer's held for a redial (each task holds its rows)."""
    return sum(1 for task in link._tasks if not task.done() and "_request_after_redial" in repr(task.get_coro()))


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("how", ["distinct", "one-id", "aborted"])
async def test_requests_for_a_channel_being_redialled_wait_a_bounded_number_at_a_time(how: str) -> None:
    """40 requests of 65,536 rows on the peer's channel while we redial it and the peer holds its ATTACH_OK:
    with distinct ids, all under one id, or each aborted after it was sent (its wait goes on until the redial
    ends). At most ``MAX_SERVED_PER_CHANNEL`` wait; the rest are refused at once (review and audit found the
    one-id and aborted forms passing the first form of the bound)."""
    async with _pair() as (prompt, decoder):
        ours, theirs = link_to(decoder, 1), link_to(prompt, 2)
        dial = ours._redial_data
        held: list[int] = []
        release = asyncio.Event()

        async def slow_dial(*args: Any) -> Any:  # the peer holds its ATTACH_OK (it may, for up to 10 s)
            with contextlib.suppress(TimeoutError):  # until the test looked (at most 8 s)
                await asyncio.wait_for(release.wait(), 8.0)
            held.append(_waiting(ours))
            return await dial(*args)

        ours._redial_data = slow_dial
        generation = ours.channels[1].generation  # the peer's channel: we dial it
        theirs.send(Msg.ABORT, 0, channel=1, generation=generation)
        await _until(lambda: 1 in ours.redialling)
        one = theirs.new_req_id()
        ids = [one if how == "one-id" else theirs.new_req_id() for _ in range(40)]
        answers = {req_id: theirs.expect(req_id) for req_id in ids}
        for req_id in ids:
            theirs.writer.write(_pull_request(req_id, 1))
            if how == "aborted":
                theirs.send(Msg.ABORT, req_id, channel=1, generation=wire.NO_GENERATION)
        await asyncio.sleep(0.3)
        if how == "distinct":  # the rest are refused while the redial still waits (a loaded CI run took > 0.3 s)
            refused = [answers[req_id] for req_id in ids[MAX_SERVED_PER_CHANNEL:]]
            await _until(lambda: all(answer.done() for answer in refused))
            assert all(answer.result().status == LLMStatusCode.LLM_LINK_FAILED for answer in refused)
        assert 1 in ours.redialling
        assert _waiting(ours) <= MAX_SERVED_PER_CHANNEL and len(ours.deferred) <= MAX_SERVED_PER_CHANNEL
        release.set()
        await _until(lambda: not ours.redialling)
        assert held and held[0] <= MAX_SERVED_PER_CHANNEL
        if how == "distinct":  # the deferred ones are served once it is back (and refused: they are bad)
            async with asyncio.timeout(3):
                statuses = {(await answers[req_id]).status for req_id in ids[:MAX_SERVED_PER_CHANNEL]}
            assert LLMStatusCode.LLM_LINK_FAILED not in statuses and LLMStatusCode.LLM_SUCCESS not in statuses
        for answer in answers.values():
            answer.cancel()
        await _until(lambda: not ours.deferred and not _waiting(ours))
        assert ours.broken is None


@pytest.mark.loops_take_turns
async def test_the_peers_reset_of_the_connection_we_are_redialling_has_it_dialled_again() -> None:
    """The accepting end installs our redial of its channel and answers, then resets that channel itself (its
    push gave up there) before our redial installed it: its ``ABORT`` names the generation we are dialling.
    We dial the next one (only the dialler can), and the accepting end's transfers go on. Before, the
    ``ABORT`` was dropped (our channel still had the old generation), we installed a connection the peer had
    closed, and its channel stayed down for good: its pushes timed out (found by review)."""
    async with _pair() as (prompt, decoder):
        client, server = link_to(decoder, 1), link_to(prompt, 2)
        assert list(server.own) == [1]
        source = prompt.kv_cache_manager.allocate_cache(SMALL, [CacheKey(1, 1)])
        values = fill(source, 5)
        dst = decoder.kv_cache_manager.allocate_cache(SMALL)
        dial = client._redial_data
        attached = asyncio.Event()

        async def dial_then_lag(*args: Any) -> Any:
            conn = await dial(*args)  # the server installed it and said ATTACH_OK
            attached.set()
            await asyncio.sleep(0.3)  # our task resumes a little later
            return conn

        client._redial_data = dial_then_lag
        generation = server.channels[1].generation
        client.reset_channel(1, tell_peer=True)
        async with asyncio.timeout(3):
            await attached.wait()
        await _until(lambda: server.channels[1].generation == generation + 1 and server.channels[1].sock is not None)
        server.reset_channel(1, tell_peer=True)
        await _until(lambda: not client.redialling)
        await _until(lambda: server.channels[1].sock is not None, 2.0)
        assert server.channels[1].generation == client.channels[1].generation == generation + 2
        async with asyncio.timeout(10):
            await prompt.kv_cache_manager.push_cache(CacheIndex(2, dst.cache_id, 0), source, src_batch_index=0,
                                                     timeout=3000)
        assert all(torch.equal(d[0], v[0]) for d, v in zip(dst.tensors, values, strict=True))


async def _redialling_the_peers_channel(prompt: LLMDataDist, decoder: LLMDataDist) -> tuple[Any, Any]:
    """The decoder's and the prompt's links, once the prompt reset its channel 1 and the decoder redials it,
    a redial that waits (up to 10 s) as if the prompt held its ``ATTACH_OK``."""
    ours, theirs = link_to(decoder, 1), link_to(prompt, 2)
    dial = ours._redial_data

    async def stalled_dial(*args: Any) -> Any:
        await asyncio.sleep(10)
        return await dial(*args)

    ours._redial_data = stalled_dial
    theirs.send(Msg.ABORT, 0, channel=1, generation=ours.channels[1].generation)
    await _until(lambda: 1 in ours.redialling)
    return ours, theirs


async def test_a_link_closed_while_a_request_waits_for_a_redial_ends_its_tasks_cleanly() -> None:
    """Closing the link cancels a request's wait for the redial, never the redial's own future. Before, the
    redial's end then raised ``InvalidStateError`` in a task nobody awaited (found by audit)."""
    async with _pair() as (prompt, decoder):
        ours, theirs = await _redialling_the_peers_channel(prompt, decoder)
        theirs.writer.write(_pull_request(theirs.new_req_id(), 1))
        await _until(lambda: bool(ours.deferred))
        tasks, redial = list(ours._tasks), ours.redialling[1]
        async with asyncio.timeout(10):
            await ours.close("test")
        assert not redial.cancelled() and not ours.redialling, "the close cancelled the redial's own future"
        failed = [(task.get_coro().__qualname__, repr(task.exception())) for task in tasks
                  if task.done() and not task.cancelled() and task.exception() is not None]
        assert not failed


async def test_a_request_deferred_in_the_chunk_that_unlinks_leaves_nothing_counted() -> None:
    """The peer's ``UNLINK`` and then a request for the channel we redial arrive in one chunk: the close
    cancels the request's wait before it ever ran (no ``finally`` of it runs), and the redial's too. Their
    bookkeeping is done by done-callbacks, so the closed link keeps no wait counted and no redial listed
    (found by review)."""
    async with _pair() as (prompt, decoder):
        ours, theirs = await _redialling_the_peers_channel(prompt, decoder)
        unlink = theirs.new_req_id()
        theirs.expect(unlink, Msg.UNLINK_ACK)
        theirs.writer.write(encode(Msg.UNLINK, unlink) + _pull_request(theirs.new_req_id(), 1, (0,)))
        await _until(lambda: ours.closed)
        await asyncio.sleep(0.05)
        assert not ours.deferred and not ours._deferring and not ours.redialling


async def test_a_stale_holders_release_does_not_hand_out_the_channel_a_new_transfer_holds() -> None:
    """A transfer gives back only the generation it took: one whose channel was reset and redialled, and taken
    by a second transfer meanwhile, gives back late and must not queue the channel the second one holds (the
    tests above passed with the generation check in ``release`` removed; audit, 2026-12-07)."""
    async with _pair() as (prompt, decoder):
        ours = link_to(decoder, 1)
        index = await ours.acquire()  # transfer 1 takes generation g
        generation = ours.channels[index].generation
        ours.reset_channel(index, tell_peer=False)  # it went out of step; the client redials g + 1
        await _until(lambda: ours.channels[index].generation == generation + 1 and _queued(ours, index) == 1)
        again = await ours.acquire()  # transfer 2 holds g + 1
        assert again == index and _queued(ours, index) == 0
        ours.release(index, generation)  # transfer 1 gives back late: not its channel any more
        assert _queued(ours, index) == 0, "the channel transfer 2 holds was queued for a third transfer"
        ours.release(again, generation + 1)
        assert _queued(ours, index) == 1
        assert ours.broken is None
