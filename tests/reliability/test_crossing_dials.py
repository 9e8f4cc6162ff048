"""Two endpoints that call ``link_clusters`` for each other at the same moment end with one link (row 280).

Each takes the other's dial while its own still sets up its data channels, so each dial finds the cluster
linked once it is ready. Both ends now keep the link dialled by the endpoint of the lower instance (random per
endpoint, told in the handshake: ``AUTH`` and ``LINK_OK``): that dial replaces the other's link there, and the
other endpoint drops its own dial. Before, each end dropped its own dial and acted on the other's ``UNLINK``:
both calls reported ``LLM_ALREADY_LINK`` and no link was left. A link from another endpoint using the cluster
id (an old instance of it) is never replaced by our dial: the second test guards that.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from peers import cluster_info, port_of

from _harness import endpoint
from aio_datadist import LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode
from aio_datadist.links import Link
from aio_datadist.testing import link_table_of, link_to

pytestmark = pytest.mark.asyncio

S = LLMStatusCode
A, B = 81, 82
LOW, HIGH = bytes([1]) * 32, bytes([2]) * 32


@contextlib.contextmanager
def dials_held_until_accepted(dd: LLMDataDist, remote_id: int) -> Iterator[None]:
    """``dd``'s dials attach their first data channel only once it has accepted a link from ``remote_id``: the
    moment of a crossing, made certain. Later channels and redials go through: held too, a winner still dialling
    its next channel when the loser dropped its dial (and with it the link the winner had accepted) waited here
    until its call timed out."""
    table = link_table_of(dd)
    real = table.dial_data

    async def dial_data(address: Any, token: bytes, index: int, generation: int) -> object:
        if index == 0 and generation == 0:
            async with asyncio.timeout(5):
                while (link := table.links.get(remote_id)) is None or link.is_client:
                    await asyncio.sleep(0.001)
        return await real(address, token, index, generation)

    table.dial_data = dial_data  # type: ignore[method-assign]
    try:
        yield
    finally:
        table.dial_data = real  # type: ignore[method-assign]


SECRET = "crossing dials"


@contextlib.asynccontextmanager
async def listening(cluster_id: int, instance: bytes, secret: str | None = SECRET) -> AsyncIterator[LLMDataDist]:
    """A listening endpoint of ``instance`` (a shared secret by default: crossings are told apart only then)."""
    config = {} if secret is None else {"shared_secret": secret}
    async with endpoint(LLMRole.PROMPT, cluster_id, listen=True, transport="tcp", **config) as dd:
        link_table_of(dd).instance = instance
        yield dd


@pytest.mark.parametrize("lower", ["first", "second"])
async def test_crossing_link_clusters_calls_leave_one_link_both_ends_keep(lower: str) -> None:
    async with listening(A, LOW if lower == "first" else HIGH) as a, \
            listening(B, HIGH if lower == "first" else LOW) as b:
        with dials_held_until_accepted(a, B), dials_held_until_accepted(b, A):
            (_, [code_a]), (_, [code_b]) = await asyncio.gather(
                a.link_clusters([cluster_info(B, port_of(b))], timeout=5000),
                b.link_clusters([cluster_info(A, port_of(a))], timeout=5000))
        winner, loser = (a, b) if lower == "first" else (b, a)
        assert (code_a, code_b) == ((S.LLM_SUCCESS, S.LLM_ALREADY_LINK) if lower == "first"
                                    else (S.LLM_ALREADY_LINK, S.LLM_SUCCESS))
        await asyncio.sleep(0.3)  # whatever either end sent the other about the dropped dial has been acted on
        kept_a, kept_b = link_to(a, B), link_to(b, A)
        assert kept_a is not None and kept_b is not None
        assert kept_a.token == kept_b.token  # one link: the same one at both ends
        assert link_to(winner, A if winner is b else B).is_client  # dialled by the lower instance
        assert len(link_table_of(a).links) == len(link_table_of(b).links) == 1
        await a.check_link_status(B)  # a probe's round trip each way over it
        await b.check_link_status(A)
        assert loser is not winner


async def test_a_dial_reaching_another_instance_of_the_cluster_never_replaces_the_link_its_peer_made() -> None:
    """Our dial reaches an old endpoint of cluster B (its address was stale) while the new one dials us: the
    new one's link is kept, whatever the instances, and our dial dropped (the rule above needs the endpoint our
    dial reached to be the one whose link it would replace). A tie-break without it took the old endpoint's."""
    async with listening(A, LOW) as a, listening(B, HIGH) as old, listening(B, HIGH[:-1] + b"\x03") as new:
        with dials_held_until_accepted(a, B):
            (_, [ours]), (_, [theirs]) = await asyncio.gather(
                a.link_clusters([cluster_info(B, port_of(old))], timeout=5000),
                new.link_clusters([cluster_info(A, port_of(a))], timeout=5000))
        assert (ours, theirs) == (S.LLM_ALREADY_LINK, S.LLM_SUCCESS)
        await asyncio.sleep(0.3)
        kept, theirs_link = link_to(a, B), link_to(new, A)
        assert kept is not None and theirs_link is not None and kept.token == theirs_link.token
        assert link_to(old, A) is None
        await new.check_link_status(A)


@contextlib.contextmanager
def dialled_links(dd: LLMDataDist) -> Iterator[list[Link]]:
    """Every link ``dd``'s dials make, as they are made."""
    table = link_table_of(dd)
    real, made = table._new_link, []

    def new_link(*args: Any, **kwargs: Any) -> Link:
        link = real(*args, **kwargs)
        made.append(link)
        return link

    table._new_link = new_link  # type: ignore[method-assign]
    try:
        yield made
    finally:
        table._new_link = real  # type: ignore[method-assign]


@pytest.mark.parametrize("cut", ["finalize", "timeout"])
async def test_a_call_cut_while_it_replaces_the_crossed_link_leaves_no_link_behind(monkeypatch: Any, cut: str) -> None:
    """The winner is finalized, or its call's time runs out (a close of 0.8 s: a TLS peer slow to answer
    close_notify), as it closes the link its dial replaces: its own dial is unlinked and
    closed, so no end holds a link the other does not (found by review: it was left neither registered nor
    closed, its fds open, and the loser kept a live link to it). The loser's later data channels wait until the
    winner's close began: a loser that finished first dropped its dial, and the winner found nothing to replace
    (it linked, ``LLM_SUCCESS``, on a loaded machine)."""
    real_close = Link.close
    loop = asyncio.get_running_loop()
    timeout_ms = 5000 if cut == "finalize" else 500
    replacing = asyncio.Event()

    async def close(link: Link, why: str = "unlinked", **kwargs: Any) -> None:
        if why.startswith("replaced: the peer's dial"):
            replacing.set()
            if cut == "finalize":
                finalizing.append(loop.create_task(a.finalize()))
                await asyncio.sleep(0)
            else:
                await asyncio.sleep(0.8)
        await real_close(link, why, **kwargs)

    finalizing: list[asyncio.Task] = []
    async with listening(A, LOW) as a, listening(B, HIGH) as b:
        monkeypatch.setattr(Link, "close", close)
        table_b = link_table_of(b)
        last = 2 * table_b.runtime.settings.data_channels - 1  # the loser's last data-channel dial (both ways)

        async def loser_waits(address: Any, token: bytes, index: int, generation: int) -> object:
            if index == last and generation == 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(5):
                        await replacing.wait()
            return await gated(address, token, index, generation)

        with dials_held_until_accepted(a, B), dials_held_until_accepted(b, A), dialled_links(a) as made:
            gated = table_b.dial_data  # b's gate, which loser_waits goes through (restored on leaving)
            table_b.dial_data = loser_waits  # type: ignore[method-assign]
            (_, [code_a]), (_, [code_b]) = await asyncio.gather(
                a.link_clusters([cluster_info(B, port_of(b))], timeout=timeout_ms),
                b.link_clusters([cluster_info(A, port_of(a))], timeout=5000))
        await asyncio.gather(*finalizing)
        # (finalize: or the call got through before finalize reached it, and finalize then closed the link)
        assert code_a in ((S.LLM_LINK_FAILED, S.LLM_SUCCESS) if cut == "finalize" else (S.LLM_TIMEOUT,))
        assert code_b == S.LLM_ALREADY_LINK, code_b  # the winner cut the loser's dial as it set up (row 280)
        async with asyncio.timeout(3):  # the peer hears our dial's UNLINK
            while (left := link_to(b, A)) is not None and not left.down:
                await asyncio.sleep(0.01)
        assert all(link.closed for link in made), [(link.is_client, link.closed, link.down) for link in made]
        if cut == "timeout":
            assert link_to(a, B) is None


async def test_a_claimed_instance_never_displaces_a_link_that_was_up_before_the_dial() -> None:
    """Without a secret anyone learns an endpoint's instance by linking to it (``LINK_OK`` carries it). A dial
    of ours without a cluster id that reaches a process claiming B and B's instance reports
    ``LLM_ALREADY_LINK`` and leaves B's link, up before the dial began, alone: only a link accepted while the
    dial ran can have crossed it (found by review: ours replaced B's honest link when our instance was lower)."""
    async with listening(A, LOW) as a, listening(B, HIGH) as b:
        assert (await b.link_clusters([cluster_info(A, port_of(a))], timeout=5000))[1] == [S.LLM_SUCCESS]
        honest = link_to(a, B)
        async with listening(B, HIGH) as claimant:
            anywhere = LLMClusterInfo()  # no remote_cluster_id: whichever cluster listens there
            anywhere.append_remote_ip_info(*port_of(claimant))
            assert (await a.link_clusters([anywhere], timeout=5000))[1] == [S.LLM_ALREADY_LINK]
            await asyncio.sleep(0.3)
            assert link_to(a, B) is honest and not honest.down
            assert link_to(claimant, A) is None
        await b.check_link_status(A)


async def test_without_a_secret_a_claimant_our_dial_reaches_never_displaces_a_link_that_crossed_it() -> None:
    """No secret: any process may link, learn an endpoint's instance from its ``LINK_OK`` and claim it. One
    at an address we dial (a stale address it took over) that claims B and B's instance, answering slowly
    while honest B links to us, must not have our dial replace B's link: crossings are resolved only between
    peers that proved a shared secret; here our dial finds B linked and drops itself, as before row 280 (found
    by review: B's link was unlinked after its call reported success)."""
    async with listening(A, LOW, None) as a, listening(B, HIGH, None) as b, listening(B, HIGH, None) as claimant:
        with dials_held_until_accepted(a, B):
            ours = asyncio.ensure_future(a.link_clusters([cluster_info(B, port_of(claimant))], timeout=5000))
            await asyncio.sleep(0.2)  # our dial waits in its data channels: the claimant is slow
            assert (await b.link_clusters([cluster_info(A, port_of(a))], timeout=5000))[1] == [S.LLM_SUCCESS]
            assert (await ours)[1] == [S.LLM_ALREADY_LINK]
        await asyncio.sleep(0.3)
        honest, kept = link_to(b, A), link_to(a, B)
        assert honest is not None and not honest.down and kept is not None and kept.token == honest.token
