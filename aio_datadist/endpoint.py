"""Endpoint: what the parts of one LLMDataDist share, and the checks they make on it.

The :class:`~aio_datadist.LLMDataDist` builds one and hands it down: its
:class:`~aio_datadist.KvCacheManager` and the leases on its caches read the
role, the runtime and the link table here, never the ``LLMDataDist`` itself
(which sits above them). The role is the current one: ``switch_role`` changes
it here.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aio_datadist._checks import check_instance, param_invalid
from aio_datadist._forks import forks
from aio_datadist.cache import KvCache
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import LLMRole

if TYPE_CHECKING:
    from aio_datadist.link_table import LinkTable
    from aio_datadist.options import Settings
    from aio_datadist.runtime import Runtime
    from aio_datadist.stats import Observer

__all__ = ["Endpoint", "forks"]


class Endpoint:
    """Role, cluster id, settings, runtime and links of one LLMDataDist.

    ``settings``, ``runtime`` and ``links`` are set between ``init`` and
    ``finalize`` and None otherwise; ``finalized`` tells the two apart.
    """

    def __init__(self, role: LLMRole, cluster_id: int) -> None:
        self.role = role
        self.cluster_id = cluster_id
        self.settings: Settings | None = None
        self.runtime: Runtime | None = None
        self.links: LinkTable | None = None
        self.finalized = False
        #: Done once ``finalize`` released everything (a second, concurrent ``finalize`` waits for it).
        self.released: asyncio.Future[None] | None = None
        #: Who hears of this endpoint's transfers and links (``stats.Observer``), kept across ``init``.
        self.observers: list[Observer] = []
        #: CacheManager mode (v2), decided by ``init`` and kept after ``finalize``; None before ``init``.
        self.cache_manager_mode: bool | None = None
        #: ``forks()`` when ``init`` ran: an endpoint of a parent process seen in a forked child differs.
        self.forks = 0
        #: What finalizes the endpoint when its loop shuts down (``owners.finalize_at_loop_shutdown``).
        self.shutdown_guard: Any = None
        #: ``(links, runtime)`` of a finalize the loop's shutdown cut short, which that guard finishes
        #: (``datadist.finalize_endpoint``).
        self.cut_release: tuple[LinkTable | None, Runtime] | None = None
        #: What holds the endpoint for the caller (an ``owners.Owners``, which names this type: set by the
        #: ``LLMDataDist``), or None.
        self.owners: Any = None
        #: The ``init`` calls that returned on the current life besides the one that started it (no-ops).
        self.joins = 0

    @property
    def initialized(self) -> bool:
        """Whether the endpoint is between ``init`` and ``finalize``."""
        return self.runtime is not None

    def require_runtime(self) -> Runtime:
        """The runtime, or the documented error before ``init`` and after ``finalize``; ``LLM_FAILED`` in a child
        forked after ``init``, where the runtime's threads, loop and links are the parent's."""
        if self.runtime is not None and self.forks != forks():
            raise LLMException("this LLMDataDist was initialized in the parent of this forked process: its "
                               "engines, loop and links are the parent's; make one of this process's own",
                               status_code=LLMStatusCode.LLM_FAILED)
        if self.runtime is None:
            if self.finalized:
                raise LLMException("LLMDataDist was finalized", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
            raise LLMException("LLMDataDist is not initialized; await init(options) first",
                               status_code=LLMStatusCode.LLM_FAILED)
        return self.runtime

    def home_loop(self, what: str) -> asyncio.AbstractEventLoop:
        """The running loop, refused (``LLM_FAILED``) unless it is the one this endpoint was initialised on
        (see :func:`home_loop`)."""
        return home_loop(what, None if self.runtime is None else self.runtime.loop)

    def require_links(self) -> LinkTable:
        """The link table, with the errors of :meth:`require_runtime`."""
        self.require_runtime()
        assert self.links is not None
        return self.links

    def require_role(self, call: str, *roles: LLMRole) -> None:
        """Refuse ``call`` (``LLM_PARAM_INVALID`` naming ``role``) unless the current role is one of ``roles``.

        In CacheManager mode the role is only a label, as in LLM-DataDist: nothing is refused.
        """
        if self.cache_manager_mode:
            return
        role = self.role
        if role not in roles:
            allowed = " or ".join(r.name for r in roles)
            raise param_invalid("role", f"{call} needs role {allowed}, this LLMDataDist is {role.name}")

    def require_mode(self, call: str, *, cache_manager: bool) -> None:
        """Refuse ``call`` in the other mode (``LLM_PARAM_INVALID``, LLM-DataDist's message); before
        ``init`` no mode is chosen and nothing is refused."""
        mode = self.cache_manager_mode
        if mode is not None and mode != cache_manager:
            raise LLMException(f"{call} is not supported when llm.EnableCacheManager is "
                               f"{'' if mode else 'not '}configured.", status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def live(self, cache: Any, arg: str) -> KvCache:
        """``cache`` if it is a KvCache registered here (or a CPU cache that overlaps none), else the error
        naming ``arg``."""
        check_instance(arg, cache, KvCache)
        if cache.cache_id == -1:
            # the caller's memory: never a cache registered (or allocated) here, which it would alias
            self.require_runtime().registry.check_unregistered(arg, cache.tensors, cache.cache_desc.size)
            return cache
        return self.require_runtime().registry.get(cache, arg)


def home_loop(what: str, home: asyncio.AbstractEventLoop | None) -> asyncio.AbstractEventLoop:
    """The running loop, refused (``LLM_FAILED``) without one or when it is not ``home`` (None: any): ``what``
    (futures, a timer) lives on ``home``, whose thread settles it; on another loop (a helper loop in a worker
    thread) it would be heard late or never, or closed under it."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise LLMException(f"{what} needs a running event loop (it lives there)",
                           status_code=LLMStatusCode.LLM_FAILED) from None
    if home is not None and loop is not home:
        raise LLMException(f"{what} lives on the event loop the LLMDataDist was initialised on; use it from "
                           "that loop", status_code=LLMStatusCode.LLM_FAILED)
    return loop
