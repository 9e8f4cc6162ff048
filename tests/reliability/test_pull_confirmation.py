"""A pull that consumes a key succeeds only if the owner consumed the key (docs/reliability.md row 177).

A pull of a ``CacheKey`` of an allocated cache ends with the requester's ``DONE``, on which the owner
consumes the key; a same-host pull is the requester's own copy out of the owner's memory, which the owner
holds for it until that ``DONE``. Whatever ends the link under such a pull (the owner's unlink, forced or
not; the requester's own unlink or finalize; a reset of the control connection), the pull either succeeds
and the key is gone, or fails with a link code and the next pull gets the key. Each test checks the key
afterwards with a pull of another decoder.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any

import pytest

from aio_datadist import (
    CacheDesc,
    CacheKey,
    DataType,
    KvCache,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    links,
    wire,
)
from aio_datadist.testing import link_to
from aio_datadist.transport import base as transport_base
from aio_datadist.transport.tls import LINGER_RESET
from peers import CacheSpec, EndpointSpec, cluster_info, port_of
from tls_certs import client_context, make_pki, server_context

from _forked import forked
from _harness import endpoint
from _slowpath import SlowPath

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
PROMPT, DECODER, OTHER = 63, 64, 65

PKI = make_pki("pull confirmation")

BIG = CacheDesc(4, (1, 32 << 20), DataType.DT_UINT8, Placement.HOST)  # 128 MiB: a copy of 20-100 ms here
SMALL = CacheDesc(4, (1, 1 << 10), DataType.DT_UINT8, Placement.HOST)

#: (the pull, a later pull of its key by another decoder): what may be seen.
CONSISTENT = {("done", "LLM_KV_CACHE_NOT_EXIST"), ("LLM_NOT_YET_LINK", "done"), ("LLM_LINK_FAILED", "done")}


async def _outcome(call: Any) -> str:
    try:
        await call
        return "done"
    except LLMException as exc:
        return exc.status_code.name


def _held_key(prompt: LLMDataDist, trial: int) -> tuple[CacheKey, KvCache]:
    """A 128 MiB cache of ``prompt`` filled with ``5 + trial``, bound to a key a pull consumes."""
    key = CacheKey(PROMPT, 10 + trial)
    src = prompt.kv_cache_manager.allocate_cache(BIG, [key])
    for t in src.tensors:
        t.fill_(5 + trial)
    return key, src


async def _big_pull_copying(dec: LLMDataDist, info: Any, key: CacheKey, trial: int) -> asyncio.Future:
    """``dec`` links and pulls ``key`` (of :func:`_held_key`) into a cache of its own; the pull, once its first
    bytes landed (bounded: 20,000 polls of 0.5 ms)."""
    dst = dec.kv_cache_manager.allocate_cache(BIG)
    assert (await dec.link_clusters([info], timeout=10_000))[0] == S.LLM_SUCCESS
    task = asyncio.ensure_future(dec.kv_cache_manager.pull_cache(key, dst, timeout=20_000))
    for _ in range(20_000):
        if task.done() or bool((dst.tensors[0][0, :4096] == 5 + trial).any()):
            break
        await asyncio.sleep(0.0005)
    return task


async def _key_left(prompt: LLMDataDist, key: CacheKey, desc: CacheDesc, transport: str = "local",
                    **config: Any) -> str:
    """Another decoder's pull of ``key``: "done", or the status it failed with."""
    async with endpoint(LLMRole.DECODER, OTHER, transport=transport, **config) as other:
        info = cluster_info(PROMPT, port_of(prompt))
        assert (await other.link_clusters([info], timeout=10_000))[0] == S.LLM_SUCCESS
        outcome = await _outcome(other.kv_cache_manager.pull_cache(key, other.kv_cache_manager.allocate_cache(desc),
                                                                   timeout=20_000))
        await other.unlink_clusters([info])
        return outcome


def _hold_done(link: links.Link, seconds: float) -> None:
    """The requester's ``DONE`` leaves ``seconds`` after the pull returned (as from a process descheduled
    right then), unless the link writes what it holds first (its own close does). A keyed pull writes its
    ``DONE`` with ``send`` as it returns (row 272), another pull with ``send_soon``: both are held."""
    loop = asyncio.get_running_loop()
    real_send = link.send

    def send_soon(msg: Any, req_id: int, **fields: Any) -> None:
        if not link._soon:
            loop.call_later(seconds, link._flush_soon)
        link._soon.append(wire.encode(msg, req_id, **fields))

    def send(msg: Any, req_id: int, **fields: Any) -> None:
        (send_soon if msg is wire.Msg.DONE else real_send)(msg, req_id, **fields)

    link.send_soon = send_soon  # type: ignore[method-assign]
    link.send = send  # type: ignore[method-assign]


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize("when", ["in_copy", "after_return"])
@pytest.mark.parametrize("force", [False, True])
async def test_a_keyed_pull_under_its_owners_unlink_succeeds_only_if_the_key_was_consumed(
        force: bool, when: str, transport: str) -> None:
    """The owner unlinks (forced or not) either just after it answered, early in a 128 MiB pull (``in_copy``),
    or once the pull returned but before the owner read its DONE (``after_return``). Before, a same-host copy
    cut early went on after the link closed, the pull succeeded, its DONE went nowhere and the key could be
    pulled again (3 of 3, both unlinks); a forced unlink after the return closed before it read the DONE on
    its way (3 of 3, both transports)."""
    outcomes = []
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport=transport))
        dec = await stack.enter_async_context(endpoint(LLMRole.DECODER, DECODER, transport=transport))
        desc = BIG if when == "in_copy" else SMALL
        dst = dec.kv_cache_manager.allocate_cache(desc)
        info = cluster_info(PROMPT, port_of(prompt))
        for trial in range(3):
            key = CacheKey(PROMPT, 10 + trial)
            src = prompt.kv_cache_manager.allocate_cache(desc, [key])
            for t in src.tensors:
                t.fill_(5 + trial)
            assert (await dec.link_clusters([info], timeout=10_000))[0] == S.LLM_SUCCESS
            owner_link, dec_link = link_to(prompt, DECODER), link_to(dec, PROMPT)
            assert owner_link is not None and dec_link is not None
            if when == "after_return":
                _hold_done(dec_link, 0.05)
            task = asyncio.ensure_future(dec.kv_cache_manager.pull_cache(key, dst, timeout=20_000))
            for _ in range(20_000):  # bounded: until the owner answered (in_copy) or the pull returned
                if task.done() or (when == "in_copy" and owner_link.pull_acks):
                    break
                await (asyncio.sleep(0.0005) if when == "in_copy" else asyncio.sleep(0))
            cut = bool(owner_link.pull_acks)  # the owner had not read the pull's DONE yet
            await prompt.unlink_clusters([cluster_info(DECODER, ("127.0.0.1", 1))], force=force)
            first = await _outcome(task)
            if force:
                await asyncio.sleep(0.05)  # the decoder hears that the link went
                await dec.unlink_clusters([info], force=True)
            outcomes.append((cut, first, await _key_left(prompt, key, desc, transport)))
            prompt.kv_cache_manager.deallocate_cache(src)
    assert any(cut for cut, _, _ in outcomes), outcomes  # the unlink came before the owner heard DONE
    assert all((first, again) in CONSISTENT for _, first, again in outcomes), outcomes


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("how", ["unlink", "finalize"])
async def test_a_keyed_pull_under_the_requesters_own_unlink_succeeds_only_if_the_key_was_consumed(how: str) -> None:
    """The decoder unlinks (or finalizes) while its own 128 MiB same-host pull of a key copies, through a path
    of 50 ms each way: the owner reads the UNLINK, ends its side (the key given back, unconsumed), and its
    answer takes 50 ms to come back. Before, a copy that ended in that window sent a DONE after the UNLINK,
    which the owner never read, and the pull succeeded (4 of 4; found by a review of row 177)."""
    outcomes = []
    async with contextlib.AsyncExitStack() as stack:
        prompt = await stack.enter_async_context(endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="local"))
        path = await stack.enter_async_context(SlowPath(port_of(prompt), 1e9, 0.05))
        info = cluster_info(PROMPT, path.address)
        for trial in range(2):
            key, src = _held_key(prompt, trial)
            async with endpoint(LLMRole.DECODER, DECODER, transport="local") as dec:
                task = await _big_pull_copying(dec, info, key, trial)
                await (dec.unlink_clusters([info]) if how == "unlink" else dec.finalize())
                first = await _outcome(task)
            outcomes.append((first, await _key_left(prompt, key, BIG)))
            prompt.kv_cache_manager.deallocate_cache(src)
    assert all(outcome in CONSISTENT for outcome in outcomes), outcomes


@pytest.mark.parametrize("transport", ["local", "tcp"])
@pytest.mark.parametrize("prefix", [False, True], ids=["key", "prefix"])
async def test_a_keyed_pull_that_ends_once_its_requester_sent_unlink_fails_and_leaves_the_key(
        monkeypatch: pytest.MonkeyPatch, transport: str, prefix: bool) -> None:
    """The requester's UNLINK left just as its pull's copy ended (made so: sent from the pull's ``finish``): the
    owner ends what it serves once it reads the UNLINK, so a DONE after it would find nothing to act on. The pull
    fails ``LLM_NOT_YET_LINK`` and the key is left for the next pull (``Link.check_heard``). ``prefix``: a pull
    that consumes nothing fails so too (its copy may have read memory the owner freed since; it passed with the
    check made for consuming pulls only: audit, 2026-12-07)."""
    real = transport_base.Request.finish

    async def finish(self: Any) -> None:
        if self.ack is None and not self.link.unlinking:  # a pull: our UNLINK leaves first
            req_id = self.link.new_req_id()
            self.link.expect(req_id, wire.Msg.UNLINK_ACK)
            self.link.send_unlink(req_id)
        await real(self)

    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport=transport) as prompt:
        key = CacheKey(PROMPT, 2**64 - 1, prefix_id=7) if prefix else CacheKey(PROMPT, 10)
        prompt.kv_cache_manager.allocate_cache(SMALL, [key])
        async with endpoint(LLMRole.DECODER, DECODER, transport=transport) as dec:
            info = cluster_info(PROMPT, port_of(prompt))
            assert (await dec.link_clusters([info], timeout=10_000))[0] == S.LLM_SUCCESS
            monkeypatch.setattr(transport_base.Request, "finish", finish)
            first = await _outcome(dec.kv_cache_manager.pull_cache(key, dec.kv_cache_manager.allocate_cache(SMALL),
                                                                   timeout=5_000))
            monkeypatch.undo()
        assert (first, await _key_left(prompt, key, SMALL, transport)) == ("LLM_NOT_YET_LINK", "done")


class _ResettingRelay:
    """A loopback TCP relay run by threads, whose connections :meth:`reset` ends with a TCP reset at once,
    whatever the event loops of the two ends are doing (a middlebox, or a peer that closed with bytes
    unread)."""

    def __init__(self, target: tuple[str, int]) -> None:
        self.target = target
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = self.listener.getsockname()[:2]
        self.socks: list[socket.socket] = []
        self.threads = [threading.Thread(target=self._accept, daemon=True)]
        self.threads[0].start()

    def _accept(self) -> None:
        while True:
            try:
                down, _ = self.listener.accept()
                up = socket.create_connection(self.target)
            except OSError:
                return  # closed
            self.socks += [down, up]
            for a, b in ((down, up), (up, down)):
                pump = threading.Thread(target=self._pump, args=(a, b), daemon=True)
                pump.start()
                self.threads.append(pump)

    @staticmethod
    def _pump(a: socket.socket, b: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := a.recv(1 << 16):
                b.sendall(data)
            b.shutdown(socket.SHUT_WR)

    def reset(self) -> None:
        socks, self.socks = self.socks, []
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RD)  # wakes its pump; sends nothing
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, LINGER_RESET)
            sock.close()

    def close(self) -> None:
        self.listener.close()
        self.reset()
        for thread in self.threads:
            thread.join(2)


@pytest.mark.loops_take_turns  # the race is the loop's pass, not which loop runs it
@pytest.mark.parametrize("secure", [False, True], ids=["tcp", "tls"])
async def test_a_keyed_pull_whose_control_connection_is_reset_as_it_ends_succeeds_only_if_the_key_was_consumed(
        secure: bool) -> None:
    """The decoder's loop is held (0.3 s) while its same-host copy of a 128 MiB key ends, and its control
    connection is reset meanwhile: the loop then reads the copy's completion and the reset in one pass. The
    transport is closing at once, the link hears of it a callback later, and the pull's end runs in between.
    Before, the link's check passed there, the DONE was dropped unsent (the transport was closing), and the
    pull succeeded with its key left to be pulled again (3 of 3; found by a review of row 177); over TLS also
    with the transport's closing state checked, as the TLS transport closes a callback after its TCP one (3 of
    3; found by a second review)."""
    outcomes = []
    async with contextlib.AsyncExitStack() as stack:
        server, client = ({"tls_server_context": server_context(PKI)}, {"tls_client_context": client_context(PKI)}) \
            if secure else ({}, {})
        prompt = await stack.enter_async_context(endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport="local",
                                                          **server))
        relay = _ResettingRelay(port_of(prompt))
        stack.callback(relay.close)
        info = cluster_info(PROMPT, relay.address)

        def held_then_reset() -> None:
            time.sleep(0.3)  # the loop is busy: the copy thread ends the copy meanwhile
            relay.reset()
            time.sleep(0.05)  # the reset reaches the decoder's sockets

        for trial in range(3):
            key, src = _held_key(prompt, trial)
            async with endpoint(LLMRole.DECODER, DECODER, transport="local", **client) as dec:
                task = await _big_pull_copying(dec, info, key, trial)
                assert not task.done()
                asyncio.get_running_loop().call_soon(held_then_reset)
                first = await _outcome(task)
            outcomes.append((first, await _key_left(prompt, key, BIG, **client)))
            prompt.kv_cache_manager.deallocate_cache(src)
    assert all(outcome in CONSISTENT for outcome in outcomes), outcomes


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_a_keyed_pull_consumed_its_key_though_the_caller_held_the_loop_right_after_it(
        fork_server: None, transport: str) -> None:
    """The caller's own synchronous work right after ``await pull_cache`` (a model step, a blocking call) holds
    its event loop past the owner's wait for the pull's DONE (the pull's 300 ms and ``DONE_GRACE_S``, 2 s). The
    DONE left before the pull returned, so the owner (another process) consumed the key: a second decoder's
    pull of it is refused. Before, the DONE waited for the end of the loop pass, the owner gave the request up
    and dropped the late DONE, and the second decoder pulled the key again (row 272; found by audit)."""
    spec = EndpointSpec(LLMRole.PROMPT, PROMPT, listen=True, caches=(CacheSpec("src", SMALL, 3, req_ids=(5,)),),
                        config=(("transport", transport),))
    async with forked(spec) as (owner,):
        info = cluster_info(PROMPT, owner.address)
        async with endpoint(LLMRole.DECODER, DECODER, transport=transport) as dec:
            assert (await dec.link_clusters([info], timeout=10_000))[0] == S.LLM_SUCCESS
            dst = dec.kv_cache_manager.allocate_cache(SMALL)
            await dec.kv_cache_manager.pull_cache(CacheKey(PROMPT, 5), dst, 0, timeout=300)
            time.sleep(2.6)  # the loop held: nothing of ours runs meanwhile
            await asyncio.sleep(0.3)
        async with endpoint(LLMRole.DECODER, OTHER, transport=transport) as other:
            assert (await other.link_clusters([info], timeout=10_000))[0] == S.LLM_SUCCESS
            again = other.kv_cache_manager.allocate_cache(SMALL)
            with pytest.raises(LLMException) as refused:
                await other.kv_cache_manager.pull_cache(CacheKey(PROMPT, 5), again, 0, timeout=2000)
            assert refused.value.status_code == S.LLM_KV_CACHE_NOT_EXIST
