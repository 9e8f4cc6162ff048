"""Bilateral links: what ``LLMDataDist.link``, ``query_register_mem_status`` and ``unlink`` keep.

LLM-DataDist's ``link(comm_name, cluster_rank_info, rank_table)`` builds an
HCCL communication domain that every member joins with the same call. Here a
``link()`` call is a :class:`Comm`: for every other cluster it names, the link
table makes one of our links (``LinkTable.start_bilateral``). Of each pair
the lower rank id dials the higher one's address (``ranktable.rank_address``)
and the higher one waits for that dial; a dial is taken only while the other
end's own ``link()`` waits for it, so a comm is OK only once both ends called
``link()``. The end that has to take a dial listens on its own rank's
address, starting the listener if the endpoint does not listen yet.

A comm's status is computed when asked: PREPARING while a link of it is
still being made, OK when all are up (on both ends once the dialler set its
link up: its transport settled and both ends' ``aio.RequireTransport`` met),
FAILED when one could not be made within the link time
(``llm.LinkTotalTime``; 0: ``HCCL_CONNECT_TIMEOUT``, else 120 s), when one
went down (the peer unlinked, finalized or died), when the pair was linked
otherwise meanwhile (``link_clusters``), or at once for a second comm with a
cluster that is linked already (``LLM_ALREADY_LINK``, as LLM-DataDist fails
it).
``unlink`` closes the comm's links and tells the peers, whose comms then
report FAILED. A comm that turns FAILED stops its attempts to its other peers
at once (a link one of them made as it stopped is unlinked, the peer told):
they would take the dials of a newer comm of the same pair.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
import os
from collections.abc import Callable

from aio_datadist._checks import UINT32_MAX, check_uint, param_invalid
from aio_datadist._settle import gather_own_cancel, settle
from aio_datadist.link_table import LinkTable
from aio_datadist.links import Link
from aio_datadist.option_checks import DEFAULT_LINK_TOTAL_TIME_S
from aio_datadist.ranktable import check_cluster_rank_info, check_comm_name, parse_rank_table, rank_address
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import RegisterMemStatus

__all__ = ["Comm", "CommTable"]

log = logging.getLogger("aio_datadist.links")

#: How long ``unlink`` waits for each peer to acknowledge (it closes its end regardless).
UNLINK_TIMEOUT_MS = 3000
#: Bound on an ``unlink`` in all (stopping link attempts, telling the peers).
UNLINK_LIMIT_S = 10.0
#: Comm ids skip these values, so that no comm id equals a status code (MindIE compares link()'s
#: result with LLM_ALREADY_LINK).
_STATUS_VALUES = frozenset(int(code) for code in LLMStatusCode)
_WILDCARD = ("0.0.0.0", "")


@dataclasses.dataclass(eq=False)
class Comm:
    """One ``link()`` call: its peers (cluster id -> rank id) and the attempts and links to them."""

    comm_id: int
    name: str
    peers: dict[int, int]
    attempts: dict[int, asyncio.Task[Link | LLMStatusCode]] = dataclasses.field(default_factory=dict)
    refused: str = ""  # why the comm failed at once (a cluster already linked)
    watches: list[asyncio.Future] = dataclasses.field(default_factory=list)  # of its links' ends (Link.watch)
    stopping: asyncio.Task[None] | None = None  # its attempts stopping once it failed (CommTable._stop)

    def made(self) -> dict[int, Link]:
        """The links made so far, by peer cluster id."""
        made = {}
        for cluster, attempt in self.attempts.items():
            link = _outcome(attempt)
            if isinstance(link, Link):
                made[cluster] = link
        return made


def _hccl_connect_timeout_s() -> int:
    """The link time when ``llm.LinkTotalTime`` is 0: ``HCCL_CONNECT_TIMEOUT`` (s) when it is a positive
    integer, as LLM-DataDist reads it, else HCCL's default."""
    text = os.environ.get("HCCL_CONNECT_TIMEOUT", "").strip().lstrip("0")
    if text.isascii() and text.isdigit():
        # At most llm.LinkTotalTime's bound (int() refuses over 4300 digits, a float over 308: found by a hunt)
        return min(int(text), UINT32_MAX) if len(text) <= len(str(UINT32_MAX)) else UINT32_MAX
    return DEFAULT_LINK_TOTAL_TIME_S


def _outcome(attempt: asyncio.Task[Link | LLMStatusCode]) -> Link | LLMStatusCode | None:
    """The attempt's result; None while it runs, when it was cancelled, or when it raised (a failed
    attempt, as LLM-DataDist reports an unknown native value: FAILED)."""
    if not attempt.done() or attempt.cancelled() or attempt.exception() is not None:
        return None
    return attempt.result()


def _log_raised(cluster: int) -> Callable[[asyncio.Task[Link | LLMStatusCode]], None]:
    def log_raised(attempt: asyncio.Task[Link | LLMStatusCode]) -> None:
        if not attempt.cancelled() and (exc := attempt.exception()) is not None:
            log.error("link(): the attempt to link cluster %s failed: %r", cluster, exc, exc_info=exc)

    return log_raised


class CommTable:
    """The comms of one endpoint's link table (see the module docstring)."""

    def __init__(self, links: LinkTable) -> None:
        self.links = links
        self.comms: dict[int, Comm] = {}
        self._next_id = 1

    def _new_id(self) -> int:
        comm_id = self._next_id
        while comm_id in _STATUS_VALUES or comm_id in self.comms:
            comm_id += 1
        self._next_id = comm_id + 1
        return comm_id

    async def link(self, comm_name: object, cluster_rank_info: object, rank_table: object) -> int:
        """Check the arguments, start the comm's links and return its id at once (see ``LLMDataDist.link``)."""
        links = self.links
        name = check_comm_name(comm_name)
        info = check_cluster_rank_info(cluster_rank_info, links.cluster_id)
        entries = parse_rank_table(rank_table, info.values())
        settings = links.runtime.settings
        link_time_s = settings.link_total_time_s or _hccl_connect_timeout_s()  # before the comm is in the table
        addresses = {rank: rank_address(entry, settings.link_port, settings.rank_addresses)
                     for rank, entry in entries.items()}
        seen: dict[tuple[str, int], int] = {}
        for rank, address in addresses.items():
            other = seen.setdefault(address, rank)
            if other != rank:
                raise param_invalid("rank_table", f"ranks {other} and {rank} both map to {address[0]}:{address[1]}; "
                                    "give them different device_ip values or aio.RankAddresses")
        own_rank = info[links.cluster_id]
        peers = {cluster: rank for cluster, rank in info.items() if cluster != links.cluster_id}
        if any(rank > own_rank for rank in peers.values()):
            links.check_can_dial()
        # switch_role neither moves the listener nor changes the role while a comm starts (it checks for
        # comms being linked first).
        async with links.listening:
            if links.closing:  # finalized while a switch_role held the lock: calls after finalize are refused
                raise LLMException("LLMDataDist was finalized during link()",
                                   status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
            for earlier in self.comms.values():
                if self.status_of(earlier) is RegisterMemStatus.FAILED:
                    self._failed(earlier)  # it failed in this loop pass (its attempts would take our dials)
            comm = Comm(self._new_id(), name, peers)
            taken = self._taken(peers)
            self.comms[comm.comm_id] = comm
            if taken is not None:
                comm.refused = f"cluster {taken} is already linked"
                log.warning("link(%r): %s; this comm fails (unlink it)", name, comm.refused)
                return comm.comm_id
            try:
                if any(rank < own_rank for rank in peers.values()):
                    await self._listen(addresses[own_rank], own_rank)
            except BaseException:
                del self.comms[comm.comm_id]
                raise
            loop = asyncio.get_running_loop()
            deadline = loop.time() + link_time_s
            for cluster, rank in peers.items():
                attempt = links.start_bilateral(cluster, addresses[rank], dial=own_rank < rank, deadline=deadline)
                attempt.add_done_callback(_log_raised(cluster))
                attempt.add_done_callback(functools.partial(self._attempted, comm, cluster))
                comm.attempts[cluster] = attempt
            log.info("link(%r): comm %s, rank %s, peers %s", name, comm.comm_id, own_rank, peers)
            return comm.comm_id

    def _attempted(self, comm: Comm, cluster: int, attempt: asyncio.Task[Link | LLMStatusCode]) -> None:
        """An attempt of ``comm`` ended: the comm failed unless its link is up, and fails when that goes down."""
        if self.comms.get(comm.comm_id) is not comm or self.links.closing:
            return  # unlinked (its attempts were stopped), or finalize
        link = _outcome(attempt)
        if not isinstance(link, Link) or self.links.live(cluster) is not link:
            self._failed(comm)
            return
        watch = link.watch()
        comm.watches.append(watch)
        watch.add_done_callback(lambda w: None if w.cancelled() else self._went_down(comm, w))

    def _went_down(self, comm: Comm, watch: asyncio.Future) -> None:
        watch.exception()  # the link's end, which the comm's status says
        if self.comms.get(comm.comm_id) is comm and not self.links.closing:
            self._failed(comm)

    def _failed(self, comm: Comm) -> None:
        """``comm`` is FAILED: stop its attempts still running."""
        running = [attempt for attempt in comm.attempts.values() if not attempt.done()]
        if not running or comm.stopping is not None:
            return
        for attempt in running:
            attempt.cancel()
        comm.stopping = asyncio.get_running_loop().create_task(self._stop(comm, running))
        log.info("link(%r): comm %s failed; its attempts to clusters %s stop", comm.name, comm.comm_id,
                 [cluster for cluster, attempt in comm.attempts.items() if attempt in running])

    async def _stop(self, comm: Comm, running: list[asyncio.Task[Link | LLMStatusCode]]) -> None:
        """Wait for the stopped attempts; unlink a link one made in the loop pass it was stopped (the peer's
        comm took it, and fails once told)."""
        await asyncio.wait(running)
        made = [cluster for cluster, attempt in comm.attempts.items()
                if attempt in running and isinstance(link := _outcome(attempt), Link)
                and self.links.links.get(cluster) is link and not link.closed]
        await gather_own_cancel(*(self.links.disconnect(cluster, UNLINK_TIMEOUT_MS, force=False) for cluster in made))

    def _taken(self, peers: dict[int, int]) -> int | None:
        """A cluster of ``peers`` that has a link already, or is in another comm that did not fail."""
        for cluster in peers:
            if self.links.live(cluster) is not None:
                return cluster
        for other in self.comms.values():
            if self.status_of(other) is not RegisterMemStatus.FAILED:
                for cluster in peers:
                    if cluster in other.peers:
                        return cluster
        return None

    async def _listen(self, address: tuple[str, int], rank: int) -> None:
        """Listen on this endpoint's rank address, unless it listens there already (``links.listening`` held)."""
        links = self.links
        current = links.listen_address
        if current is None:
            try:
                await links.listen(*address)
            except LLMException as exc:
                if exc.status_code != LLMStatusCode.LLM_LINK_FAILED:
                    raise
                raise LLMException(f"link: cannot listen on {address[0]}:{address[1]}, the address of this "
                                   f"endpoint's rank {rank} (see aio.RankAddresses, aio.LinkPort): {exc}",
                                   status_code=LLMStatusCode.LLM_LINK_FAILED) from exc
        elif current[1] != address[1] or (current[0] != address[0] and current[0] not in _WILDCARD):
            raise param_invalid("rank_table", f"this endpoint's rank {rank} maps to {address[0]}:{address[1]}, "
                                f"but the endpoint listens on {current[0]}:{current[1]}; map the rank to "
                                "that address (aio.RankAddresses)")

    def _comm(self, comm_id: object) -> Comm:
        comm = self.comms.get(check_uint("comm_id", comm_id))
        if comm is None:
            raise LLMException(f"comm {comm_id} is not linked (never returned by link(), or unlinked)",
                               status_code=LLMStatusCode.LLM_NOT_YET_LINK)
        return comm

    def status(self, comm_id: object) -> RegisterMemStatus:
        """The comm's status (see the module docstring); ``LLM_NOT_YET_LINK`` for an unknown id."""
        return self.status_of(self._comm(comm_id))

    def preparing(self) -> list[int]:
        """The ids of the comms whose links are still being made."""
        return [comm_id for comm_id, comm in self.comms.items() if self.status_of(comm) is RegisterMemStatus.PREPARING]

    def status_of(self, comm: Comm) -> RegisterMemStatus:
        if comm.refused:
            return RegisterMemStatus.FAILED
        preparing = False
        for cluster, attempt in comm.attempts.items():
            if not attempt.done():
                preparing = True
                continue
            link = _outcome(attempt)
            if not isinstance(link, Link) or self.links.live(cluster) is not link:
                return RegisterMemStatus.FAILED
        return RegisterMemStatus.PREPARING if preparing else RegisterMemStatus.OK

    async def unlink(self, comm_id: object) -> None:
        """Stop the comm's attempts, close its links (telling the peers, all at once) and forget it."""
        comm = self._comm(comm_id)
        del self.comms[comm.comm_id]
        work = asyncio.ensure_future(self._close(comm))
        try:
            done = await settle(work, UNLINK_LIMIT_S)
        finally:
            if not work.done():
                # Peers slower to answer than the bound (or our caller cancelled, which settle held back until
                # the bound): each disconnect closes its link as it is cancelled.
                work.cancel()
                await settle(work, None)
                if not work.cancelled() and work.exception() is not None:
                    log.warning("unlink(%s): %r", comm.comm_id, work.exception())
        if not done:
            log.warning("unlink(%s): not done within %s s; its links closed without the peers' answer",
                        comm.comm_id, UNLINK_LIMIT_S)
            return
        work.result()

    async def _close(self, comm: Comm) -> None:
        for watch in comm.watches:
            watch.cancel()
        running = [attempt for attempt in comm.attempts.values() if not attempt.done()]
        for attempt in running:
            attempt.cancel()
        if running:
            await asyncio.wait(running)
        if comm.stopping is not None:
            await comm.stopping
        made = [cluster for cluster, link in comm.made().items()
                if self.links.links.get(cluster) is link and not link.closed]
        statuses = await gather_own_cancel(*(self.links.disconnect(cluster, UNLINK_TIMEOUT_MS, force=False)
                                          for cluster in made))
        for cluster, status in zip(made, statuses, strict=True):
            if status != LLMStatusCode.LLM_SUCCESS:  # the peer let go first (it unlinked too): fine
                log.info("unlink(%s): cluster %s: %s", comm.comm_id, cluster, status.name)
