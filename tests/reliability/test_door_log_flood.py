"""Refused links do not flood the log (docs/security.md: as the vLLM side channel's refusals, at most one
WARNING every 30 s with a count, DEBUG for the rest).

- 300 connections without the secret give one WARNING (``authentication
  failed``) and 299 DEBUG lines, and an honest peer links afterwards;
- 100 links refused for their fds (``RLIMIT_NOFILE``) give one WARNING
  and 99 DEBUG lines.
"""

from __future__ import annotations

import asyncio
import logging
import os
import types

import pytest

from aio_datadist import LLMRole, LLMStatusCode, fd_budget, listener, refusal_log, wire
from aio_datadist.wire import Msg
from peers import cluster_info, port_of

from _harness import endpoint
from _rawpeer import RawLink, Refused, dial, recv_frame

S = LLMStatusCode


def _unauthenticated(address: tuple[str, int], n: int) -> int:
    """``n`` handshakes with a forged proof: how many were refused."""
    refused = 0
    for i in range(n):
        with dial(address) as sock:
            sock.sendall(wire.encode(Msg.HELLO, 0, nonce=os.urandom(32)))
            assert recv_frame(sock)[0] is Msg.HELLO_ACK
            sock.sendall(wire.encode(Msg.AUTH, 0, proof=os.urandom(32), cluster_id=70 + i, role=2, peer_id=1,
                                     instance=bytes(32), bilateral=0))
            msg, _, ok = recv_frame(sock)
            refused += msg is Msg.LINK_OK and ok["status"] != 0
    return refused


def _over_budget(address: tuple[str, int], n: int) -> list[int]:
    """``n`` honest handshakes: the codes they were refused with."""
    codes = []
    for i in range(n):
        try:
            RawLink(address, 70 + i, 1, None).connect().close()
            codes.append(0)
        except Refused as exc:
            codes.append(exc.code)
    return codes


def _lines(caplog: pytest.LogCaptureFixture, text: str) -> tuple[int, int]:
    """How many WARNING and DEBUG records hold ``text``."""
    records = [r for r in caplog.records if text in r.getMessage()]
    return (sum(r.levelno == logging.WARNING for r in records), sum(r.levelno == logging.DEBUG for r in records))


@pytest.mark.asyncio
async def test_failed_authentications_do_not_flood_the_log(caplog):
    caplog.set_level(logging.DEBUG, logger="aio_datadist")
    async with endpoint(LLMRole.PROMPT, 1, listen=True, transport="tcp", shared_secret="s3cret") as dd, \
            endpoint(LLMRole.DECODER, 2, transport="tcp", shared_secret="s3cret") as honest:
        assert await asyncio.to_thread(_unauthenticated, port_of(dd), 300) == 300
        assert _lines(caplog, "authentication failed") == (1, 299)
        assert (await honest.link_clusters([cluster_info(1, port_of(dd))]))[0] == S.LLM_SUCCESS


@pytest.mark.asyncio
async def test_links_refused_for_their_fds_do_not_flood_the_log(caplog, monkeypatch):
    caplog.set_level(logging.DEBUG, logger="aio_datadist")
    async with endpoint(LLMRole.PROMPT, 1, listen=True, transport="tcp") as dd:
        monkeypatch.setattr(fd_budget, "soft_limit", lambda: fd_budget.open_count())  # room for no link
        codes = await asyncio.to_thread(_over_budget, port_of(dd), 100)
        assert codes == [S.LLM_CLUSTER_NUM_EXCEED_LIMIT] * 100
        assert _lines(caplog, "RLIMIT_NOFILE") == (1, 99)


def test_the_refusal_log_warns_again_after_its_interval_with_the_count(caplog, monkeypatch):
    """One WARNING per ``REFUSAL_LOG_EVERY_S`` with how many were refused since the last, DEBUG for the rest, and
    a WARNING again once the interval passed (the tests above count lines within one interval, and passed with a
    warning once ever and no count; audit, 2026-12-07). The clock is the test's."""
    caplog.set_level(logging.DEBUG, logger="aio_datadist")
    now = [1000.0]
    monkeypatch.setattr(refusal_log, "time", types.SimpleNamespace(monotonic=lambda: now[0]))  # that module's only
    refusals = listener.RefusalLog()
    refusals.note("refused %s", "x")  # WARNING: the first
    now[0] += listener.REFUSAL_LOG_EVERY_S - 0.001
    refusals.note("refused %s", "x")  # DEBUG: just inside the interval
    for _ in range(3):
        refusals.note("refused %s", "x")
    now[0] += 0.001
    refusals.note("refused %s", "x")  # WARNING: the interval passed, with the 5 since
    refusals.note("refused %s", "x")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert listener.REFUSAL_LOG_EVERY_S == 30
    assert len(warnings) == 2, warnings
    assert "(1 refused since" in warnings[0] and "(5 refused since" in warnings[1], warnings  # 4 DEBUG + this one
    assert len([r for r in caplog.records if r.levelno == logging.DEBUG]) == 5


@pytest.mark.asyncio
async def test_a_linked_peers_unusable_nixl_offers_do_not_flood_the_log(caplog):
    """A linked peer sends NIXL offers whose metadata does not load, again and again (each load is paced, but each
    failure wrote a WARNING: 15,000 in a run, found by a hunt, 2026-12-07): one WARNING with the count, DEBUG for
    the rest. (NixlPeer's handler of a failed load, called as the agent's worker would, on a stand-in peer.)"""
    from aio_datadist.transport import nixl

    caplog.set_level(logging.DEBUG, logger="aio_datadist")
    peer = types.SimpleNamespace(cluster_id=7)
    loop = asyncio.get_running_loop()
    for _ in range(50):
        failed = loop.create_future()
        failed.set_exception(RuntimeError("nixlMismatchError"))
        nixl.NixlPeer._loaded(peer, failed, False)  # type: ignore[arg-type]
    said = [r for r in caplog.records if "NIXL metadata not usable" in r.getMessage()]
    assert len(said) == 50 and sum(r.levelno >= logging.WARNING for r in said) <= 1
