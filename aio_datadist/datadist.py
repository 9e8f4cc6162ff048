"""LLMDataDist: one endpoint of a disaggregated serving cluster.

Owns the runtime (engines, caches) between ``init`` and ``finalize``, and the
links to peers. Several instances may live in one process, each with its own
listener, links and caches (cache ids count from 1 per instance).
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any

from aio_datadist._checks import (
    check_bool,
    check_instance,
    check_sint,
    check_uint,
    param_invalid,
    param_type_error,
)
from aio_datadist._settle import gather_own_cancel
from aio_datadist.bilateral import CommTable
from aio_datadist.cache_manager import CacheManager
from aio_datadist.endpoint import Endpoint, forks
from aio_datadist.leases import active_leases, end_leases
from aio_datadist.link_table import LinkTable
from aio_datadist.manager import KvCacheManager
from aio_datadist.option_checks import parse_listen
from aio_datadist.options import Settings, cache_manager_mode, parse_options
from aio_datadist.owner import handle_request
from aio_datadist.owners import Owners, end_shutdown_guard, finalize_at_loop_shutdown
from aio_datadist.runtime import Runtime
from aio_datadist.stats import EndpointStats
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import LLMClusterInfo, LLMRole, RegisterMemStatus

__all__ = ["LLMDataDist"]

#: Held while an ``init`` makes the life it started the endpoint's (inits on two threads' loops at once).
_STARTING = threading.Lock()


def _after_fork_in_child() -> None:
    global _STARTING
    _STARTING = threading.Lock()  # a parent's thread may have held it at the fork: it is not here to let go of it


os.register_at_fork(after_in_child=_after_fork_in_child)

MAX_CLUSTERS_PER_CALL = 16

log = logging.getLogger("aio_datadist.links")



def _timeout_ms(value: object) -> int:
    """A link call's ``timeout``: an int32 (``ValueError`` outside, as LLM-DataDist checks it), at least 1 ms."""
    timeout = check_sint("timeout", value, 32)
    if timeout < 1:
        raise param_invalid("timeout", f"must be at least 1 ms, got {timeout}")
    return timeout

class LLMDataDist:
    """A PROMPT, DECODER or MIX endpoint that moves KV caches to and from peers.

    :param role: the :class:`LLMRole` of this endpoint.
    :param cluster_id: a uint64 unique among the peers that link to each other.
    :raises LLMException: ``LLM_PARAM_INVALID`` for a bad role or cluster id.

    Use it as ``async with LLMDataDist(role, cluster_id) as dd: await dd.init(opts)``
    or call :meth:`init` and :meth:`finalize` yourself. Its links live on the
    loop ``init`` ran on: its link coroutines (``link_clusters``,
    ``unlink_clusters``, ``check_link_status``, ``link``, ``unlink``,
    ``switch_role``) raise ``LLM_FAILED`` from another loop.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        check_instance("role", role, LLMRole)
        self._endpoint = Endpoint(role, check_uint("cluster_id", cluster_id))
        self._manager = KvCacheManager(self._endpoint)
        self._cache_manager = CacheManager(KvCacheManager(self._endpoint, v1=False))
        self._comms: CommTable | None = None  # link() comms, made with the first link()
        # Collected without finalize while its loop runs, with neither manager kept: finalized there, warned.
        owners = self._endpoint.owners = Owners(self._endpoint, finalize_endpoint)
        for owner in (self, self._manager, self._cache_manager):
            owners.watch(owner)

    # -- properties --------------------------------------------------------

    @property
    def cluster_id(self) -> int:
        """This endpoint's cluster id."""
        return self._endpoint.cluster_id

    @property
    def role(self) -> LLMRole:
        """This endpoint's current role."""
        return self._endpoint.role

    @property
    def kv_cache_manager(self) -> KvCacheManager:
        """The :class:`KvCacheManager` of this endpoint (KvCacheManager mode, v1).

        :raises LLMException: ``LLM_PARAM_INVALID`` once ``init`` selected
            CacheManager mode (use :attr:`cache_manager`).
        """
        self._endpoint.require_mode("kv_cache_manager", cache_manager=False)
        return self._manager

    @property
    def cache_manager(self) -> CacheManager:
        """The :class:`CacheManager` of this endpoint (CacheManager mode, v2: ``init`` options with
        ``llm.EnableCacheManager = "1"`` or ``llm.LocalCommRes``).

        :raises LLMException: ``LLM_PARAM_INVALID`` once ``init`` selected
            KvCacheManager mode (use :attr:`kv_cache_manager`).
        """
        self._endpoint.require_mode("cache_manager", cache_manager=True)
        return self._cache_manager

    @property
    def listen_address(self) -> tuple[str, int] | None:
        """``(ip, port)`` actually listened on (port 0 resolved), or None."""
        return None if self._links is None else self._links.listen_address

    @property
    def _runtime(self) -> Runtime | None:
        return self._endpoint.runtime

    @property
    def _links(self) -> LinkTable | None:
        return self._endpoint.links

    def _require_runtime(self) -> Runtime:
        return self._endpoint.require_runtime()

    def _require_links(self) -> LinkTable:
        return self._endpoint.require_links()

    def _home_links(self, call: str) -> LinkTable:
        """The link table, for ``call`` from the loop the endpoint was initialised on (``LLM_FAILED`` from
        another): a link, its listener and their answers live there; one made from a helper loop is dead when
        that loop ends, and answers settled from the endpoint's thread would not wake it."""
        links = self._require_links()
        self._endpoint.home_loop(call)
        return links

    def stats(self) -> EndpointStats:
        """A snapshot of what this endpoint holds and what its links did (see ``docs/observability.md``).

        Cheap enough to call every second: it copies counters the transfers
        keep anyway. Each link's counts start when the link came up.

        :raises LLMException: ``LLM_FAILED`` before ``init``,
            ``LLM_ENGINE_FINALIZED`` after ``finalize``.
        """
        return endpoint_stats(self._endpoint)

    # -- lifecycle ---------------------------------------------------------

    async def init(self, options: Mapping[str, Any]) -> None:
        """Start the engines and, when ``llm.listenIpInfo`` is set, listen.

        :param options: the dict from :meth:`LLMConfig.generate_options`.
        :raises LLMException: ``LLM_PARAM_INVALID`` for a bad option (naming
            its key; also ``aio.TlsServerContext`` when only a TLS client
            context is given to a listening endpoint),
            ``LLM_FEATURE_NOT_ENABLED`` for an unsupported device or transport,
            ``LLM_LINK_FAILED`` if the listen address cannot be bound,
            ``LLM_FAILED`` naming the resource when the process has no file
            descriptor or thread left for the endpoint's engines, or when a
            ``finalize`` on another event loop is still releasing the previous
            ``init``'s engines.
        A second ``init`` is a no-op. After ``finalize`` the endpoint may be
        initialised again, as LLM-DataDist's finalize resets its object: a new
        life with nothing of the last (caches, keys, links and comms are gone,
        cache ids count from 1 again, ``init`` chooses the mode anew); the
        managers and observers taken before carry on with it.
        """
        await self._open(options)

    async def _open(self, options: Mapping[str, Any]) -> Runtime | None:
        """:meth:`init`; the runtime of the life this call started (None: a second init, a no-op)."""
        endpoint = self._endpoint
        if endpoint.runtime is not None:
            endpoint.joins += 1
            return None
        settings = parse_options(options)  # (a finalized endpoint stays so when they are refused)
        v2 = cache_manager_mode(options)
        last = await self._reopen() if endpoint.finalized else None
        if endpoint.runtime is not None:  # another init of it won meanwhile: this one is the second
            endpoint.joins += 1
            return None
        try:
            if not await self._start(settings, v2):  # another thread's init started a life meanwhile
                endpoint.joins += 1
                return None
        except BaseException:
            if last is not None and endpoint.runtime is None and not endpoint.finalized:
                # A new life that did not start (its engines, its NIXL agent, its listen address): the endpoint
                # is finalized as before, not "not initialized" (its calls say LLM_ENGINE_FINALIZED, the mode
                # it had is kept until an init starts one).
                endpoint.finalized = True
                endpoint.settings, endpoint.cache_manager_mode, endpoint.released = last
            raise
        endpoint.joins = 0
        return endpoint.runtime

    async def _close_alone(self, life: Runtime | None) -> None:
        """Finalize the life an ``init`` started (``life``, what :meth:`_open` returned) unless it has ended or
        another ``init`` returned on it since: what the blocking facade's interrupted ``init`` undoes."""
        endpoint = self._endpoint
        if life is not None and endpoint.runtime is life and not endpoint.joins:
            await self.finalize()

    async def _start(self, settings: Settings, v2: bool) -> bool:
        """Start the engines, the link table and the listener of ``settings``; the endpoint's new life. False
        (what it started closed again) when an ``init`` on another thread's loop started one meanwhile."""
        endpoint = self._endpoint
        try:
            runtime = Runtime(settings)
        except OSError as exc:  # no fd for a completion queue or socket engine, no thread for an engine's worker
            raise LLMException(f"cannot start the endpoint's engines: {exc}",
                               status_code=LLMStatusCode.LLM_FAILED) from exc
        runtime.observers = endpoint.observers
        runtime.loop = asyncio.get_running_loop()
        try:
            # with aio.Transport=nixl this starts the NIXL agent
            links = LinkTable(runtime, endpoint.cluster_id, lambda: endpoint.role,
                              lambda link, msg, req_id, fields: handle_request(runtime, link, msg, req_id, fields))
        except BaseException:
            runtime.close()
            raise
        try:
            if settings.listen is not None:
                await links.listen(*settings.listen)
        except BaseException:
            await links.close()
            runtime.close()
            raise
        with _STARTING:  # an init on another thread's loop may be here too: one life is the endpoint's
            won = endpoint.runtime is None
            if won:
                endpoint.settings = settings
                endpoint.cache_manager_mode = v2
                endpoint.runtime = runtime
                endpoint.links = links
                endpoint.forks = forks()
        if not won:
            try:
                await links.close()
            finally:
                runtime.close()
            return False
        finalize_at_loop_shutdown(endpoint, finalize_endpoint)
        return True

    async def _reopen(self) -> tuple[Settings | None, bool | None, asyncio.Future[None] | None] | None:
        """Make a finalized endpoint initialisable again, once its last life is released: a ``finalize`` still
        releasing it is waited for, and one its loop's shutdown cut short is finished here (as a second
        ``finalize`` would); one still releasing on another running loop refuses the ``init``. The finalized
        state it left (settings, mode, the release done), for an ``init`` whose life cannot start to put back;
        None when another init reopened it meanwhile."""
        endpoint = self._endpoint
        await finalize_endpoint(endpoint)
        if not endpoint.finalized:  # another init reopened it meanwhile
            return None
        released = endpoint.released
        if endpoint.cut_release is not None or (released is not None and not released.done()):
            raise LLMException("LLMDataDist: its finalize on another event loop is still releasing the engines; "
                               "init once that finalize returned", status_code=LLMStatusCode.LLM_FAILED)
        last = (endpoint.settings, endpoint.cache_manager_mode, released)
        endpoint.finalized = False
        endpoint.released = None
        endpoint.settings = None
        endpoint.cache_manager_mode = None  # chosen anew by this init
        self._comms = None  # the last life's link() comms went with its links
        return last

    async def finalize(self) -> None:
        """Unlink every peer, fail pending work, free every cache. Idempotent.

        Link attempts still in their handshake are stopped (``link_clusters``
        reports ``LLM_LINK_FAILED`` for them) and never register afterwards;
        every link is closed after its peer acknowledged the unlink (at most
        1 s), so a new endpoint with this cluster id can link at once.
        """
        await finalize_endpoint(self._endpoint)

    async def __aenter__(self) -> LLMDataDist:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.finalize()

    # -- links -------------------------------------------------------------

    def _check_clusters(self, clusters: Any, *, unset_ids: bool = False) -> list[LLMClusterInfo]:
        if not isinstance(clusters, (list, tuple)):
            raise param_type_error("clusters", f"expected a list of LLMClusterInfo, got {type(clusters).__name__}")
        for i, c in enumerate(clusters):
            check_instance(f"clusters[{i}]", c, LLMClusterInfo)
            if c.remote_cluster_id is None and not unset_ids:
                raise param_type_error(f"clusters[{i}]", "remote_cluster_id is not set")
        return list(clusters)

    async def link_clusters(self, clusters: Sequence[LLMClusterInfo],
                            timeout: int = 3000) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Link to the listening peers described by ``clusters`` (at most 16).

        Each cluster needs one remote ip:port. Its ``remote_cluster_id`` is
        checked against the peer's; left unset, the link goes to whichever
        cluster listens there, under the id the peer proves in the handshake.
        ``remote_cluster_id`` may equal this endpoint's own id (a peer
        elsewhere that uses the same id; a link to this endpoint itself fails).
        A link, once made, is usable from both ends.

        :returns: ``(overall, [status per cluster])``; failures are reported
            there (``LLM_LINK_FAILED``, ``LLM_ALREADY_LINK``, ``LLM_TIMEOUT``;
            ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` for more than 16 clusters, for
            every cluster and with nothing dialled, or when the link's fds do
            not fit under ``RLIMIT_NOFILE`` on this end or the peer's, see
            ``docs/transports.md``), not raised. At most one link per remote
            cluster id exists: a concurrent call for the same id waits for the
            first and then reports ``LLM_ALREADY_LINK`` if it linked.
        :raises LLMException: ``LLM_PARAM_INVALID`` for malformed arguments
            (the same ``remote_cluster_id`` twice in one call included,
            before anything is dialled; ``TypeError`` too for a wrong type) or,
            on an endpoint with TLS, for a missing ``aio.TlsClientContext``.
        """
        links = self._home_links("link_clusters")
        links.check_can_dial()
        clusters = self._check_clusters(clusters, unset_ids=True)
        timeout = _timeout_ms(timeout)
        for i, c in enumerate(clusters):
            if len(c.remote_endpoints) != 1:
                raise param_invalid(f"clusters[{i}]", "exactly one remote ip:port is needed")
        _refuse_twins(clusters, "linked")
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            return _too_many(clusters)
        results = await gather_own_cancel(*(links.connect(c, timeout) for c in clusters))
        return _overall(results), list(results)

    async def unlink_clusters(self, clusters: Sequence[LLMClusterInfo], timeout: int = 3000,
                              force: bool = False) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
        """Tear links down. Non-forced tells the peer, which closes its end too;
        ``force=True`` closes only this end (use it after failures), but while
        pushes of ours are in flight on a link that has not failed it tells the
        peer all the same and waits (1 s at most) until the peer stopped taking
        their bytes, so none lands after the pushes returned; so it does while
        pulls of the peer's that we answered wait for its ``DONE``, so that a
        pull that succeeded has its key consumed.

        :returns: ``(overall, [status per cluster])``; ``LLM_NOT_YET_LINK`` for
            a cluster that is not linked (``LLM_SUCCESS`` with ``force=True``: no end
            here to tear down, as LLM-DataDist's forced unlink), ``LLM_PROCESSING_LINK`` for one whose
            ``link_clusters`` is still in its handshake (retry once that call
            returned); ``LLM_CLUSTER_NUM_EXCEED_LIMIT`` for
            every cluster of a call with more than 16 (nothing is unlinked).
        :raises LLMException: ``LLM_PARAM_INVALID`` for malformed arguments, the same
            ``remote_cluster_id`` twice in one call included (before anything is unlinked).
        """
        links = self._home_links("unlink_clusters")
        clusters = self._check_clusters(clusters)
        timeout = _timeout_ms(timeout)
        check_bool("force", force)
        _refuse_twins(clusters, "unlinked")
        if len(clusters) > MAX_CLUSTERS_PER_CALL:
            return _too_many(clusters)
        results = await gather_own_cancel(*(links.disconnect(_cluster_id(c), timeout, force)
                                         for c in clusters))
        return _overall(results), list(results)

    async def check_link_status(self, remote_cluster_id: int) -> None:
        """Round-trip a probe over the link to ``remote_cluster_id``.

        :raises LLMException: ``LLM_NOT_YET_LINK`` if not linked,
            ``LLM_LINK_FAILED`` if broken, ``LLM_TIMEOUT`` after
            ``sync_kv_timeout`` without an answer; ``LLM_PARAM_INVALID`` in
            CacheManager mode (KvCacheManager mode only, as in LLM-DataDist).
        """
        links = self._home_links("check_link_status")
        self._endpoint.require_mode("check_link_status", cache_manager=False)
        cluster = check_uint("remote_cluster_id", remote_cluster_id)
        await links.probe(cluster, self._require_runtime().default_timeout_ms())

    # -- bilateral links (CacheManager mode) -------------------------------

    def _require_comms(self, call: str) -> CommTable:
        links = self._require_links()
        self._endpoint.require_mode(call, cache_manager=True)
        if self._comms is None or self._comms.links is not links:
            self._comms = CommTable(links)
        return self._comms

    async def link(self, comm_name: str, cluster_rank_info: Mapping[int, int], rank_table: str) -> int:
        """Start a bilateral link with the clusters of ``cluster_rank_info``; returns its comm id at once.

        Every member calls ``link`` with the same arguments (at about the same
        time, within the link time), then polls
        :meth:`query_register_mem_status` until ``OK``. No HCCL is involved:
        each rank of ``rank_table`` (the HCCL-style JSON of LLM-DataDist) maps
        to an endpoint address, ``device_ip:(aio.LinkPort + rank_id)``
        (``aio.LinkPort`` defaults to 26000) unless ``aio.RankAddresses``
        names the rank or its device ip (``docs/api.md``). Of each pair the
        lower rank dials the higher one, which listens on its address (this
        endpoint starts listening there if it does not listen yet) and takes
        the dial only while its own ``link`` waits for it. Dials are retried
        until ``llm.LinkTotalTime`` (``LLMConfig.link_total_time`` s; 0 means
        ``HCCL_CONNECT_TIMEOUT`` s if set, else 120 s) is spent; the comm is then FAILED. Transfers with a peer fail
        with ``LLM_NOT_YET_LINK`` until its link is up. Several ``link`` calls
        may run at once (one per peer cluster).

        :param comm_name: a non-empty name shorter than 128 characters.
        :param cluster_rank_info: cluster id -> rank id, 2 to 4 clusters, rank
            ids in ascending order, this endpoint's cluster id among them.
        :param rank_table: the rank table, a JSON str (``server_list`` of
            servers whose ``device`` entries have ``rank_id`` and ``device_ip``).
        :returns: the comm id, never equal to an ``LLMStatusCode`` value. A
            cluster that is linked already (by another comm or by
            ``link_clusters``) makes the comm FAILED at once, as in LLM-DataDist.
        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``comm_name``,
            ``cluster_rank_info`` or ``rank_table`` for a bad argument (bad
            JSON, a rank missing from the table, two ranks at one address, this
            endpoint listening elsewhere than its rank's address) or in
            KvCacheManager mode; ``LLM_LINK_FAILED`` when this endpoint cannot
            listen on its rank's address.
        """
        comms = self._require_comms("link")
        self._endpoint.home_loop("link")
        return await comms.link(comm_name, cluster_rank_info, rank_table)

    def query_register_mem_status(self, comm_id: int) -> RegisterMemStatus:
        """``PREPARING`` while the links of ``comm_id`` are being made, ``OK`` once all are up,
        ``FAILED`` when one could not be made within the link time or went down since (a peer
        unlinked, finalized or died).

        :raises LLMException: ``LLM_NOT_YET_LINK`` for a comm id that
            :meth:`link` did not return or that was unlinked;
            ``LLM_PARAM_INVALID`` for a comm id that is not a uint64, or in
            KvCacheManager mode.
        """
        return self._require_comms("query_register_mem_status").status(comm_id)

    async def unlink(self, comm_id: int) -> None:
        """Close the links of ``comm_id`` (telling the peers, whose comms turn ``FAILED``) and forget it.

        May be called from any member, in any status, and by both at once.

        :raises LLMException: ``LLM_NOT_YET_LINK`` for a comm id that
            :meth:`link` did not return or that was unlinked already;
            ``LLM_PARAM_INVALID`` as for :meth:`query_register_mem_status`.
        """
        comms = self._require_comms("unlink")
        self._endpoint.home_loop("unlink")
        await comms.unlink(comm_id)

    async def switch_role(self, role: LLMRole, switch_options: Mapping[str, str] | None = None) -> None:
        """Change role; with ``llm.listenIpInfo`` in ``switch_options`` listen
        there (moving the listener), without it stop listening.

        In CacheManager mode (v2) the role is only a label: no
        ``enable_switch_role`` is needed, the role may stay the same, and
        option keys other than ``llm.listenIpInfo`` (``generate_options``
        emits ``llm.MemoryUtilization`` and others) are ignored.

        :raises LLMException: ``LLM_PARAM_INVALID`` for a bad role (also a
            ``TypeError``), the current role (v1), bad options, or a switch to
            PROMPT without ``llm.listenIpInfo`` (v1), checked first, then
            ``LLM_FEATURE_NOT_ENABLED`` unless ``enable_switch_role`` was set
            (v1); ``LLM_EXIST_LINK`` while links exist or are being made (a
            ``link_clusters`` or ``link`` dial, or a peer's link being
            accepted) or a ``link`` comm is still ``PREPARING``;
            ``LLM_ENGINE_FINALIZED`` when ``finalize`` ran meanwhile (the
            endpoint then listens nowhere).
        """
        links = self._home_links("switch_role")
        assert self._endpoint.settings is not None
        v2 = bool(self._endpoint.cache_manager_mode)
        if not isinstance(role, LLMRole):
            raise param_type_error("role", f"expected LLMRole, got {type(role).__name__}")
        if not v2 and role == self._endpoint.role:
            raise param_invalid("role", f"already {role.name}")
        listen = None
        if switch_options is not None:
            if not isinstance(switch_options, Mapping):
                raise param_type_error("switch_options", f"expected a dict, got {type(switch_options).__name__}")
            for key in switch_options:
                if key != "llm.listenIpInfo" and not v2:
                    raise param_invalid("switch_options", f"unsupported option {key!r} (only llm.listenIpInfo)")
            if "llm.listenIpInfo" in switch_options:
                listen = parse_listen(switch_options["llm.listenIpInfo"])
        if not v2 and role == LLMRole.PROMPT and listen is None:  # as LLM-DataDist's v1 switch_role
            raise param_invalid("switch_options", 'switching to PROMPT needs "llm.listenIpInfo"')
        # The arguments first, then the feature, as LLM-DataDist (its native switch says FEATURE_NOT_ENABLED).
        if not v2 and not self._endpoint.settings.enable_switch_role:
            raise LLMException("switch_role needs LLMConfig.enable_switch_role = True",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)
        # Held from the checks through the new listen: a link() meanwhile would start a listener of its own
        # (the old one stopped) and make a comm under the old role.
        async with links.listening:
            if not v2 and role == self._endpoint.role:  # another switch to it ran while this one waited for the lock
                raise param_invalid("role", f"already {role.name}")
            if links.count():
                # Named: a peer that linked and crashed leaves a failed link no stats() lists (rows 203, 287).
                held = sorted(cid for cid, link in links.links.items() if not link.closed)
                shown = ", ".join(map(str, held[:16])) + (f" and {len(held) - 16} more" if len(held) > 16 else "")
                raise LLMException(f"switch_role: {len(held)} link(s) still exist (cluster ids {shown}); "
                                   "unlink them first (unlink_clusters, force=True for a failed one)",
                                   status_code=LLMStatusCode.LLM_EXIST_LINK)
            preparing = [] if self._comms is None or self._comms.links is not links else self._comms.preparing()
            if preparing:  # its links are being made, maybe on our listener: they count as links
                raise LLMException(f"switch_role: link() comm(s) {preparing} still being linked; unlink them first",
                                   status_code=LLMStatusCode.LLM_EXIST_LINK)
            if links.linking():  # a link made now would come up under the new role, or on a listener gone
                raise LLMException("switch_role: a link is being made; wait for it and unlink it first",
                                   status_code=LLMStatusCode.LLM_EXIST_LINK)
            previous = links.listen_address
            try:
                await links.stop_listening()
                if links.closing:  # finalized while the listener stopped: nothing listens again
                    raise LLMException("LLMDataDist was finalized during switch_role",
                                       status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
                if listen is not None:
                    await links.listen(*listen)
            except BaseException as exc:
                if previous is not None and links.listen_address is None and not links.closing:
                    try:  # a failed or cancelled switch changes nothing...
                        await _complete(links.listen(*previous))
                    except Exception as again:  # ... unless the old address is gone too: say so, with the first error
                        log.warning("switch_role: listening again on %s:%s failed (%s); the endpoint does not listen",
                                    previous[0], previous[1], again)
                        exc.add_note(f"listening again on {previous[0]}:{previous[1]} failed too ({again}): the "
                                     "endpoint does not listen now")
                raise
            self._endpoint.role = role


async def finalize_endpoint(endpoint: Endpoint) -> None:
    """What :meth:`LLMDataDist.finalize` does, for ``endpoint`` (also when its owners were collected without it:
    ``owners.Owners``)."""
    runtime, links = endpoint.runtime, endpoint.links
    if runtime is not None and endpoint.forks != forks():
        # A parent's endpoint in a forked child: its links and engines are the parent's, which a close here
        # would end (the UNLINKs, the sockets' shutdown); the child only lets go of it.
        endpoint.runtime = endpoint.links = None
        endpoint.finalized = True
        return
    home = None if runtime is None else runtime.loop
    if home is not None and home is not asyncio.get_running_loop() and not home.is_closed():
        # Its listener, links and their tasks live on that loop, and only its thread may cancel and wait for
        # them: from here the close waited for ever (a task cancelled from the wrong thread, its loop not woken).
        if home.is_running():  # in a thread of its own: finalized there, this call waits for it
            await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(finalize_endpoint(endpoint), home))
            return
        raise LLMException("finalize: the event loop this LLMDataDist was initialised on is stopped but not "
                           "closed, and its tasks cannot end from another loop; finalize it on that loop (or "
                           "close that loop first)", status_code=LLMStatusCode.LLM_FAILED)
    if runtime is None:
        loop = asyncio.get_running_loop()
        while True:
            cut = endpoint.cut_release
            cut_loop = None if cut is None else cut[1].loop
            if cut is not None and (cut_loop is loop or cut_loop is None or cut_loop.is_closed()):
                # A finalize a cancel of every task cut short: finished here (by the shutdown guard of its loop,
                # a finalize after the cut on that loop, or one on a loop after it, closed without its
                # generators' shutdown, which never ran the guard).
                endpoint.cut_release = None
                released = endpoint.released
                if released is None or released.done() or released.get_loop() is not loop:
                    endpoint.released = loop.create_future()
                await _release(endpoint, *cut)
                return
            released = endpoint.released
            if released is None or released.done() or released.get_loop() is not loop:
                return
            await asyncio.wait([released])  # another finalize is releasing: once it has (or was cut), again
    endpoint.runtime = None
    endpoint.links = None
    endpoint.finalized = True
    end_leases(endpoint)
    endpoint.released = asyncio.get_running_loop().create_future()
    await _release(endpoint, links, runtime)


async def _release(endpoint: Endpoint, links: LinkTable | None, runtime: Runtime) -> None:
    """Close ``links`` and ``runtime``, the endpoint's once, and say so (``endpoint.released``).

    The loop's shutdown (``asyncio.run``, a ``Runner`` closing) cancels every task, the close's with the
    finalize that awaits it: a close so cut is left to the endpoint's shutdown guard, which the loop runs
    after (``owners.finalize_at_loop_shutdown``), to finish (``endpoint.cut_release``). Before, the listening
    socket stayed open after the run, or a link was left half closed."""
    cut = True  # until the close ended or failed: only a cancel of every task, also before its first step, cuts it

    async def close() -> None:
        nonlocal cut
        try:
            if links is not None:
                await links.close()
            await runtime.quiesce()  # device copies end before the blocking close, off the loop
        except asyncio.CancelledError:
            raise
        except BaseException:
            cut = False
            raise
        cut = False

    try:
        await _complete(close())
    finally:
        if cut and endpoint.shutdown_guard is not None:
            endpoint.cut_release = (links, runtime)
            # A finalize waiting for this one (``released``) takes the rest up now; later ones wait for it.
            waited, endpoint.released = endpoint.released, asyncio.get_running_loop().create_future()
            if waited is not None and not waited.done():
                waited.set_result(None)
        else:
            runtime.close()
            # The guard first: once ``released`` is done an ``init`` (on another loop's thread) may start the next
            # life and its guard, which ending the guard after it would end instead of this life's.
            end_shutdown_guard(endpoint)
            assert endpoint.released is not None
            if not endpoint.released.done():
                endpoint.released.set_result(None)


async def _complete(awaitable: Any) -> None:
    """Run cleanup to its end even if the caller is cancelled meanwhile (anyio
    cancels again at every await), then let the cancellation through, also
    when the cleanup failed (its error is logged then). The cleanups passed
    here are bounded in time."""
    work = asyncio.ensure_future(awaitable)
    cancelled: asyncio.CancelledError | None = None
    while not work.done():
        try:
            await asyncio.wait([work])  # neither raises its error nor cancels it when we are cancelled
        except asyncio.CancelledError as exc:
            cancelled = cancelled or exc
    if cancelled is not None:
        if not work.cancelled() and work.exception() is not None:
            log.warning("cleanup failed while its caller was cancelled: %s", work.exception())
        raise cancelled  # the one that came, message included: anyio knows its own cancellations by it
    work.result()


def _refuse_twins(clusters: Sequence[LLMClusterInfo], verb: str) -> None:
    """``LLM_PARAM_INVALID`` for a remote cluster id named twice in one call, before anything is done."""
    first: dict[int, int] = {}
    for i, c in enumerate(clusters):
        if c.remote_cluster_id is None:
            continue
        j = first.setdefault(c.remote_cluster_id, i)
        if j != i:
            raise param_invalid(f"clusters[{i}]", f"remote_cluster_id {c.remote_cluster_id} is also "
                                f"clusters[{j}]; a cluster is {verb} once")


def _too_many(clusters: list[LLMClusterInfo]) -> tuple[LLMStatusCode, list[LLMStatusCode]]:
    """The answer to a call with more than 16 clusters: LLM-DataDist's status, for every cluster."""
    code = LLMStatusCode.LLM_CLUSTER_NUM_EXCEED_LIMIT
    return code, [code] * len(clusters)


def _cluster_id(cluster: LLMClusterInfo) -> int:
    """The remote cluster id of a cluster ``_check_clusters`` let through (so it is set)."""
    cluster_id = cluster.remote_cluster_id
    assert cluster_id is not None
    return cluster_id


def _overall(results: list[LLMStatusCode]) -> LLMStatusCode:
    for code in results:
        if code != LLMStatusCode.LLM_SUCCESS:
            return code
    return LLMStatusCode.LLM_SUCCESS


def endpoint_stats(endpoint: Endpoint) -> EndpointStats:
    """What :meth:`LLMDataDist.stats` gives, of the endpoint under it (the Prometheus exporter reads it of an
    endpoint whose ``LLMDataDist`` object is gone but whose managers keep it serving)."""
    rt = endpoint.require_runtime()
    table = endpoint.require_links()
    registry = rt.registry
    links = {cid: link.stats() for cid, link in table.links.items() if link.up}
    return EndpointStats(endpoint.cluster_id, endpoint.role, registry.used_bytes, registry.cap_bytes,
                         len(registry), registry.key_count, active_leases(endpoint), MappingProxyType(links),
                         rt.links_up, rt.links_down)


def endpoint_of(dd: Any) -> LLMDataDist:
    """The async endpoint ``dd`` is, or that the blocking facade ``dd`` (``aio_datadist.compat``) wraps: the one
    key under which an endpoint is watched, whichever of the two the caller holds.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``dd`` when it is neither.
    """
    inner = getattr(dd, "_dd", None)
    if isinstance(inner, LLMDataDist):
        dd = inner
    if not isinstance(dd, LLMDataDist):
        raise LLMException(f"invalid argument 'dd': expected an LLMDataDist, got {type(dd).__name__}",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    return dd


def in_kv_cache_manager_mode(dd: LLMDataDist) -> bool:
    """Whether ``init`` put ``dd`` in KvCacheManager (v1) mode (False before ``init``): the blocking facade
    gives v1 LLM-DataDist's status codes there (``compat._v1_codes``)."""
    return dd._endpoint.cache_manager_mode is False
