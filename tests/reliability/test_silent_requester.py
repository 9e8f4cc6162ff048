"""A requester that never sends DONE: the owner gives its request up past the request's own timeout.

The buggy peer is a real endpoint whose link to the owner is patched not to
send the ``DONE`` that ends a pull well; an honest second decoder then
pulls the same key. While the buggy request may still end (its timeout plus
``base.DONE_GRACE_S``, shortened here) the key stays claimed and the honest pull
is refused; past it the owner treats the request as failed (claim released, not
consumed) and the honest pull moves the key's bytes. A ``DONE`` that comes later
is ignored. TCP (the stream plane's posted pull), same-host and NIXL (both in place).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from _harness import endpoint
from peers import CACHE_DESC, TRANSPORTS, cluster_info, fill, port_of, same, snapshot

from aio_datadist import CacheKey, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from aio_datadist.links import Link
from aio_datadist.testing import link_to, nixl_agent_of, usable_link
from aio_datadist.transport import base
from aio_datadist.wire import Msg

pytestmark = pytest.mark.asyncio

PROMPT, BUGGY, HONEST = 71, 72, 73
#: The buggy requester's timeout, and the grace the owner gives it here (2 s by default).
TIMEOUT_MS, GRACE_S = 300, 0.2


async def _link(decoder: LLMDataDist, prompt: LLMDataDist) -> None:
    status, per = await decoder.link_clusters([cluster_info(PROMPT, port_of(prompt))], timeout=3000)
    assert (status, per) == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])


async def _prepared(prompt: LLMDataDist, cache: Any) -> None:
    """Until both decoders' links prepared ``cache`` for NIXL (until then its pulls take TCP)."""
    async with asyncio.timeout(5):
        for peer in (BUGGY, HONEST):
            link = link_to(prompt, peer)
            assert link is not None and link.nixl is not None
            while cache.cache_id not in link.nixl.prepared:
                await asyncio.sleep(0.005)


def _silence(monkeypatch: pytest.MonkeyPatch, buggy: LLMDataDist) -> None:
    """``buggy``'s link to the owner never sends the DONE that ends a pull well (a failed one still leaves)."""
    link = usable_link(buggy, PROMPT)

    def quiet(real: Any) -> Any:
        def send(msg: Msg, req_id: int, **fields: Any) -> None:
            if msg is Msg.DONE and fields.get("status") == LLMStatusCode.LLM_SUCCESS:
                return
            real(link, msg, req_id, **fields)

        return send

    monkeypatch.setattr(link, "send", quiet(Link.send))
    monkeypatch.setattr(link, "send_soon", quiet(Link.send_soon))  # how a pull's DONE leaves (after it returned)


def _owner_timers(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The timers ``base.await_done`` sets (one per answered request), as it sets them."""
    timers: list[Any] = []

    class Loop:
        def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
            self._loop = loop

        def __getattr__(self, name: str) -> Any:
            return getattr(self._loop, name)

        def call_at(self, *args: Any) -> Any:
            timers.append(self._loop.call_at(*args))
            return timers[-1]

    class Asyncio:
        def __getattr__(self, name: str) -> Any:
            return getattr(asyncio, name)

        @staticmethod
        def get_running_loop() -> Loop:
            return Loop(asyncio.get_running_loop())

    monkeypatch.setattr(base, "asyncio", Asyncio())
    return timers


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_a_requester_that_never_sends_done_loses_its_key_claim_past_its_timeout(
        monkeypatch: pytest.MonkeyPatch, caplog: Any, transport: str) -> None:
    caplog.set_level(logging.WARNING, logger="aio_datadist.links")
    monkeypatch.setattr(base, "DONE_GRACE_S", GRACE_S)
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True, transport=transport) as prompt, \
            endpoint(LLMRole.DECODER, BUGGY, transport=transport) as buggy, \
            endpoint(LLMRole.DECODER, HONEST, transport=transport) as honest:
        await _link(buggy, prompt)
        await _link(honest, prompt)
        _silence(monkeypatch, buggy)
        src = prompt.kv_cache_manager.allocate_cache(CACHE_DESC, [CacheKey(PROMPT, 10)])
        expected = fill(src, 7)
        key = CacheKey(PROMPT, 10)
        mine = buggy.kv_cache_manager.allocate_cache(CACHE_DESC)
        theirs = honest.kv_cache_manager.allocate_cache(CACHE_DESC)
        if transport == "nixl":
            await _prepared(prompt, src)
        await buggy.kv_cache_manager.pull_cache(key, mine, 0, timeout=TIMEOUT_MS)  # bytes moved, no DONE sent
        owner_link = link_to(prompt, BUGGY)
        assert owner_link is not None and len(owner_link.pull_acks) == 1
        assert owner_link.stats().kinds["served_pull"].transport in (None, transport), owner_link.stats()
        agent = nixl_agent_of(prompt)
        if transport == "nixl":
            assert agent is not None and agent.serving[src.cache_id] == 1  # the NIXL hold the request keeps
        # Within the buggy request's time the key is still claimed by it.
        with pytest.raises(LLMException) as refused:
            await honest.kv_cache_manager.pull_cache(key, theirs, 0, timeout=1000)
        assert refused.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, refused.value
        assert "being pulled by another request" in str(refused.value)
        # Long past the buggy request's timeout (and the owner's grace) the claim is given back, not consumed.
        await asyncio.sleep(TIMEOUT_MS / 1000 + GRACE_S + 0.3)
        held = dict(awaiting_done=len(owner_link.pull_acks), serving=len(owner_link.serving),
                    nixl_holds=0 if agent is None else sum(agent.serving.values()))
        try:
            await honest.kv_cache_manager.pull_cache(key, theirs, 0, timeout=1000)
            late = "moved"
        except LLMException as exc:
            late = str(exc)
        assert (held, late) == (dict(awaiting_done=0, serving=0, nixl_holds=0), "moved"), (held, late)
        assert same([t[0] for t in snapshot(theirs)], [t[0] for t in expected])
        # One request, one outcome: a stream pull's bytes moved (counted when they had), an in-place one's
        # end is known only from the DONE that never came (a failure at the request's deadline: a timeout; it
        # was counted LLM_FAILED).
        served = owner_link.stats().kinds["served_pull"]
        moved = transport == "tcp"
        assert (served.transfers, dict(served.failures), served.timeouts) == \
            ((1, {}, 0) if moved else (0, {"LLM_TIMEOUT": 1}, 1)), served
        # The buggy peer's DONE, now, is that of a request the owner no longer knows: ignored.
        buggy_link = link_to(buggy, PROMPT)
        assert buggy_link is not None
        req_id = buggy_link._next_req - 2  # the pull's id (the last request id the buggy peer took)
        Link.send(buggy_link, Msg.DONE, req_id, status=LLMStatusCode.LLM_SUCCESS, text="")
        await asyncio.sleep(0.05)
        # The honest pull sent DONE: the key is consumed (the late DONE did not consume it twice, nor free it).
        with pytest.raises(LLMException) as gone:
            await honest.kv_cache_manager.pull_cache(key, theirs, 1, timeout=1000)
        assert gone.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        assert "already pulled" in str(gone.value)
        warned = [r.getMessage() for r in caplog.records if "DONE" in r.getMessage()]
        assert len(warned) == 1, warned


async def test_a_link_that_closes_gives_back_the_silent_requests_claim_and_its_timer(
        monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """The claim goes with the link at once (as before), and the owner's timer with it: nothing fires later."""
    caplog.set_level(logging.WARNING, logger="aio_datadist.links")
    monkeypatch.setattr(base, "DONE_GRACE_S", GRACE_S)
    timers = _owner_timers(monkeypatch)
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as prompt, \
            endpoint(LLMRole.DECODER, BUGGY) as buggy, endpoint(LLMRole.DECODER, HONEST) as honest:
        await _link(buggy, prompt)
        await _link(honest, prompt)
        _silence(monkeypatch, buggy)
        src = prompt.kv_cache_manager.allocate_cache(CACHE_DESC, [CacheKey(PROMPT, 10)])
        expected = fill(src, 8)
        key = CacheKey(PROMPT, 10)
        mine = buggy.kv_cache_manager.allocate_cache(CACHE_DESC)
        theirs = honest.kv_cache_manager.allocate_cache(CACHE_DESC)
        await buggy.kv_cache_manager.pull_cache(key, mine, 0, timeout=TIMEOUT_MS)
        status, _ = await buggy.unlink_clusters([cluster_info(PROMPT, port_of(prompt))])
        assert status == LLMStatusCode.LLM_SUCCESS
        for _ in range(200):
            if link_to(prompt, BUGGY) is None:
                break
            await asyncio.sleep(0.01)
        assert link_to(prompt, BUGGY) is None
        # the link's end cancelled the silent request's timer (its expiry would find nothing, but would hold the
        # link until then: it passed with the cancel removed, audit 2026-12-07)
        assert [t.cancelled() for t in timers] == [True], timers
        await honest.kv_cache_manager.pull_cache(key, theirs, 0, timeout=2000)
        assert same([t[0] for t in snapshot(theirs)], [t[0] for t in expected])
        await asyncio.sleep(TIMEOUT_MS / 1000 + GRACE_S + 0.3)
        assert not [r.getMessage() for r in caplog.records if "DONE" in r.getMessage()]


async def test_an_honest_requester_is_unchanged_by_the_owners_timer(
        monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """A requester that sends DONE consumes the key, and nothing fires past its timeout."""
    caplog.set_level(logging.WARNING, logger="aio_datadist.links")
    monkeypatch.setattr(base, "DONE_GRACE_S", GRACE_S)
    timers = _owner_timers(monkeypatch)
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as prompt, \
            endpoint(LLMRole.DECODER, HONEST) as honest:
        await _link(honest, prompt)
        src = prompt.kv_cache_manager.allocate_cache(CACHE_DESC, [CacheKey(PROMPT, 10), CacheKey(PROMPT, 11)])
        fill(src, 9)
        theirs = honest.kv_cache_manager.allocate_cache(CACHE_DESC)
        await honest.kv_cache_manager.pull_cache(CacheKey(PROMPT, 10), theirs, 0, timeout=TIMEOUT_MS)
        await honest.kv_cache_manager.pull_cache(CacheKey(PROMPT, 11), theirs, 1, timeout=TIMEOUT_MS)
        await asyncio.sleep(TIMEOUT_MS / 1000 + GRACE_S + 0.3)
        owner_link = link_to(prompt, HONEST)
        assert owner_link is not None and not owner_link.pull_acks
        served = owner_link.stats().kinds["served_pull"]
        assert (served.transfers, dict(served.failures)) == (2, {}), served
        assert [t.cancelled() for t in timers] == [True, True], timers  # each DONE cancelled its timer
        with pytest.raises(LLMException) as gone:
            await honest.kv_cache_manager.pull_cache(CacheKey(PROMPT, 10), theirs, 2, timeout=1000)
        assert "already pulled" in str(gone.value)
        assert not [r.getMessage() for r in caplog.records if "DONE" in r.getMessage()]


async def test_a_silent_requesters_long_timeout_is_cut_at_the_owners_bound_and_warned_once(
        monkeypatch: pytest.MonkeyPatch, caplog: Any) -> None:
    """The owner's wait is the request's timeout *at most* ``MAX_SERVE_TIMEOUT_MS`` (shortened here to the
    300 ms of the tests above: the requester asks for 60 s), and two requests given up on one link make one
    warning (``OVERDUE_WARN_EVERY_S``). The tests above, one request each with a short timeout, passed with the
    bound and the warning's rate limit removed (audit, 2026-12-07)."""
    caplog.set_level(logging.WARNING, logger="aio_datadist.links")
    monkeypatch.setattr(base, "DONE_GRACE_S", GRACE_S)
    monkeypatch.setattr(base, "MAX_SERVE_TIMEOUT_MS", TIMEOUT_MS)
    async with endpoint(LLMRole.PROMPT, PROMPT, listen=True) as prompt, \
            endpoint(LLMRole.DECODER, BUGGY) as buggy, endpoint(LLMRole.DECODER, HONEST) as honest:
        await _link(buggy, prompt)
        await _link(honest, prompt)
        _silence(monkeypatch, buggy)
        keys = [CacheKey(PROMPT, 10), CacheKey(PROMPT, 11)]
        src = prompt.kv_cache_manager.allocate_cache(CACHE_DESC, keys)
        expected = fill(src, 6)
        mine = buggy.kv_cache_manager.allocate_cache(CACHE_DESC)
        theirs = honest.kv_cache_manager.allocate_cache(CACHE_DESC)
        for row, key in enumerate(keys):
            await buggy.kv_cache_manager.pull_cache(key, mine, row, timeout=60_000)  # no DONE sent
        owner_link = link_to(prompt, BUGGY)
        assert owner_link is not None and len(owner_link.pull_acks) == 2
        await asyncio.sleep(TIMEOUT_MS / 1000 + GRACE_S + 0.3)
        assert not owner_link.pull_acks and not owner_link.serving
        for row, key in enumerate(keys):
            await honest.kv_cache_manager.pull_cache(key, theirs, row, timeout=1000)
        assert same([t[:2] for t in snapshot(theirs)], [t[:2] for t in expected])
        warned = [r.getMessage() for r in caplog.records if "DONE" in r.getMessage()]
        assert len(warned) == 1, warned
