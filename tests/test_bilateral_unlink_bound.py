"""``unlink`` of a comm of several peers that are slow to answer: it closes every link of the comm within its
bound, not only those it reached one after another before the bound cut it off."""

from __future__ import annotations

import asyncio
import json

import pytest
from test_bilateral_link import free_port, rank_table, settled, v2_options

from aio_datadist import LLMDataDist, LLMRole, RegisterMemStatus, bilateral, protocol
from aio_datadist.links import Link
from aio_datadist.testing import link_to

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize("answer_ms,cancel", [(600, False), (3000, False), (3000, True)],
                         ids=["answer_within_bound", "answer_past_bound", "unlink_cancelled"])
async def test_unlink_closes_every_link_of_the_comm_when_its_peers_do_not_answer(monkeypatch, answer_ms, cancel):
    """With ``cancel``, the caller cancels its ``unlink`` 0.1 s in: the cancel ends it at its bound, with the
    links closed too (it ended with the closes going on behind it)."""
    ips = [f"127.0.2.{i}" for i in range(1, 5)]  # the hub is rank 0: it dials the three others
    addresses = {ip: f"{ip}:{free_port(ip)}" for ip in ips}
    config = {"rank_addresses": json.dumps(addresses), "link_total_time": 20, "copy_threads": 1}
    # Each peer's UNLINK_ACK is waited for answer_ms (it never comes: below), and the whole unlink may take 1 s:
    # one after another, the first two waits took the bound; past it, the first took it all.
    monkeypatch.setattr(bilateral, "UNLINK_TIMEOUT_MS", answer_ms)
    monkeypatch.setattr(bilateral, "UNLINK_LIMIT_S", 1.0)
    async with LLMDataDist(LLMRole.MIX, 200) as hub:
        await hub.init(v2_options(**config))
        peers = [LLMDataDist(LLMRole.PROMPT, 201 + i) for i in range(3)]
        try:
            for peer in peers:
                await peer.init(v2_options(**config))
            info = {200: 0, **{peer.cluster_id: i + 1 for i, peer in enumerate(peers)}}
            table = rank_table(*ips)
            comms = await asyncio.gather(hub.link("all", info, table), *(p.link("all", info, table) for p in peers))
            assert [await settled(dd, c) for dd, c in zip([hub, *peers], comms, strict=True)] == \
                [RegisterMemStatus.OK] * 4
            hub_rt = hub._endpoint.runtime
            dispatch = Link._dispatch

            def deaf(self: Link, event: object) -> None:  # the peers never answer the hub's UNLINK
                if isinstance(event, protocol.Unlink) and self.runtime is not hub_rt:
                    return
                dispatch(self, event)

            monkeypatch.setattr(Link, "_dispatch", deaf)
            loop = asyncio.get_running_loop()
            start = loop.time()
            made = [link_to(hub, peer.cluster_id) for peer in peers]
            unlinking = asyncio.ensure_future(hub.unlink(comms[0]))
            if cancel:
                await asyncio.sleep(0.1)
                unlinking.cancel()
            await asyncio.wait([unlinking], timeout=10)
            assert unlinking.cancelled() if cancel else unlinking.result() is None
            took = loop.time() - start
            left = [peer.cluster_id for peer, link in zip(peers, made, strict=True)
                    if link_to(hub, peer.cluster_id) is not None or not link.closed
                    or not all(task.done() for task in link._tasks)]  # its close ended, not only begun
            assert left == [] and took < 1.5, (left, took)
        finally:
            monkeypatch.undo()
            for peer in peers:
                await peer.finalize()
