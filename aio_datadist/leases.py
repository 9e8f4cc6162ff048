"""Leases on hand-off caches: what a vanished decoder never pulled is released in time.

A prefill endpoint hands a request's KV cache over by allocating it with the
request's keys and dropping its own reference at once (``deallocate_cache``):
the memory then lives until decoders have pulled every key. A decoder that
dies before pulling leaves keys that nothing will ever consume, and the memory
is held for good. A lease bounds that time::

    cache = kv.allocate_cache(desc, keys, lease_ms=30_000)
    ...fill the cache, tell the decoder its keys...
    kv.deallocate_cache(cache)   # optional: the lease releases the id reference too
    lease_of(cache).renew(60_000)   # more time, if the decoder is slow to come

(``allocate_leased_cache(kv, desc, keys, lease_ms=...)`` returns the cache and
its lease at once.)

When the lease runs out, every key of the lease still bound to that cache is
removed (as ``remove_cache_key`` does; a key removed and bound to another cache
since is left alone; a key of the cache that ``lease_cache`` was not given
stays bound and keeps the cache) and the cache's id reference is dropped (as
``deallocate_cache`` does), so the memory goes at once when the lease held
every key. A pull of an
allocated cache already in flight is not cut: it finishes with valid bytes
(the memory stays mapped until the native transfer ends) and simply consumes
nothing; one of a registered cache (the caller's memory) is cut, as
``deallocate_cache`` of it cuts it. A pull that starts after expiry gets
``LLM_KV_CACHE_NOT_EXIST``. A ``KvCache.create_cpu_cache`` cache cannot be
leased (``LLM_PARAM_INVALID``): nothing here allocated or registered it.

``lease.renew(ms)`` moves the deadline, ``lease.cancel()`` keeps the cache
(no expiry), ``lease.release()`` expires it now. Leases need a PROMPT or MIX
endpoint (they remove keys), and are taken and renewed on the event loop the
endpoint was initialised on (the timer lives there; a lease taken on a helper
loop that then closed would never run out). The blocking facade's
``allocate_cache(..., lease_ms=)`` runs the lease on its own loop, and
``aio_datadist.compat.lease_of`` hands it to the caller's thread. ``finalize``
ends every lease of its endpoint.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from aio_datadist._checks import check_instance, check_int, param_invalid, param_type_error
from aio_datadist.cache import KvCache
from aio_datadist.endpoint import home_loop
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import CacheDesc, CacheKey, LLMRole

if TYPE_CHECKING:
    from aio_datadist.endpoint import Endpoint

__all__ = ["CacheLease", "allocate_leased_cache", "lease_cache", "lease_of"]

MAX_LEASE_MS = 2**31 - 1

log = logging.getLogger("aio_datadist.leases")

_LEASES: weakref.WeakKeyDictionary[KvCache, CacheLease] = weakref.WeakKeyDictionary()
#: Every lease, whether its cache object lives or not (a running lease's timer holds it): what finalize ends.
_ALL: weakref.WeakSet[CacheLease] = weakref.WeakSet()


class _Manager(Protocol):
    """What leases use of a ``KvCacheManager`` (which sits above them and builds on them)."""

    @property
    def endpoint(self) -> Endpoint: ...

    def allocate_cache(self, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey] = (), *,
                       lease_ms: int | None = None) -> KvCache: ...


class CacheLease:
    """The lease on one hand-off cache; see the module docstring."""

    def __init__(self, endpoint: Endpoint, cache: KvCache, keys: Sequence[CacheKey], lease_ms: int) -> None:
        self._endpoint: Endpoint | None = endpoint
        self._cache = weakref.ref(cache)
        self._keys = tuple(keys)
        self._loop = endpoint.home_loop("a lease's timer")
        self._timer: asyncio.TimerHandle | None = None
        self._expired = False
        self._cancelled = False
        self._finalized = False
        self._holding = True  # whether it holds its endpoint (taken below; let go by a timer's refused release)
        self.renew(lease_ms)
        _LEASES[cache] = self
        _ALL.add(self)
        self._unwatch = endpoint.require_runtime().registry.when_freed(cache, self._cache_freed)
        # A running lease holds its endpoint for the caller, who may have dropped everything else (owners.Owners).
        self._let_go = _nothing if endpoint.owners is None else endpoint.owners.hold()

    @property
    def expired(self) -> bool:
        """Whether the lease ran out (or was released, or its endpoint finalized) and its keys were removed, or
        its cache was freed without it (its id reference dropped and every key pulled or removed)."""
        return self._expired

    @property
    def active(self) -> bool:
        """Whether the lease still runs: neither expired (or released) nor cancelled, and its cache still
        held (a cache its keys' pulls, ``remove_cache_key`` or finalize freed leaves nothing to release)."""
        cache = self._cache()
        return not (self._expired or self._cancelled) and cache is not None and cache.alive

    @property
    def deadline(self) -> float | None:
        """When the lease runs out, in event-loop time; None once expired or cancelled."""
        return None if self._timer is None else self._timer.when()

    def renew(self, lease_ms: int) -> None:
        """Run out ``lease_ms`` milliseconds from now instead.

        :raises LLMException: ``LLM_PARAM_INVALID`` for a bad ``lease_ms`` or a
            lease that already expired or was cancelled; ``LLM_ENGINE_FINALIZED``
            once its endpoint was finalized (which ended the lease); ``LLM_FAILED``
            off the event loop the lease's timer lives on.
        """
        lease_ms = check_int("lease_ms", lease_ms, lo=1, hi=MAX_LEASE_MS)
        if self._finalized:
            raise LLMException("renew: the lease's LLMDataDist was finalized, which freed its cache and ended the "
                               "lease", status_code=LLMStatusCode.LLM_ENGINE_FINALIZED)
        if self._expired or self._cancelled:
            raise param_invalid("lease_ms", "the lease already expired or was cancelled")
        home_loop("a lease's timer", self._loop)
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self._loop.call_later(lease_ms / 1000, self._expire)
        if not self._holding:  # a timer's refused release let go of the endpoint: running again, it holds it again
            self._holding = True
            owners = None if self._endpoint is None else self._endpoint.owners
            self._let_go = _nothing if owners is None else owners.hold()

    def cancel(self) -> None:
        """Keep the cache: the lease never expires. Idempotent. ``LLM_FAILED`` off the lease's event loop."""
        if not (self._cancelled or self._expired):
            home_loop("a lease's timer", self._loop)  # the timer and the registry live there
        self._cancelled = True
        self._unwatch()
        self._stop_timer()
        self._let_go()

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _cache_freed(self) -> None:
        # Nothing is left to release: the timer goes now, not after the rest of lease_ms (up to 2**31 - 1 ms), for
        # it held this lease, its keys and the endpoint on the loop as long (a hand-off per request piled them up).
        if self._expired or self._cancelled:
            return
        self._stop_timer()
        self._expired = True
        self._let_go()

    def _expire(self) -> None:
        self._timer = None  # fired: a refused release leaves the lease running without a deadline
        try:
            self.release()
        except LLMException as exc:  # e.g. the endpoint switched to DECODER and may not remove keys
            # the message only: a record holding the exception would hold release()'s frame, and the cache in it
            log.warning("lease on cache %s could not release it: %s", getattr(self._cache(), "cache_id", "?"), str(exc))
            self._let_go()  # it runs out no more on its own: it keeps a dropped endpoint no longer (finalize frees all)
            self._holding = False  # until a renew sets a deadline again

    def release(self) -> None:
        """Expire now: unbind the keys still bound and drop the cache's id reference. Idempotent.

        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``role`` when a key is
            still bound and the endpoint is a DECODER (KvCacheManager mode), as
            ``remove_cache_key``; the lease is then left as it was (still
            running), to be released once the role allows it. ``LLM_FAILED`` in a
            child forked after ``init`` (the caches and links are the parent's).
        """
        if self._expired or self._cancelled:
            return
        home_loop("a lease's timer", self._loop)  # off it: LLM_FAILED, nothing changed (as renew)
        endpoint = self._endpoint
        cache = self._cache()
        runtime = None if endpoint is None else endpoint.runtime
        if runtime is not None and endpoint is not None:
            endpoint.require_runtime()  # in a forked child the runtime is the parent's: LLM_FAILED, nothing changed
        bound = [] if runtime is None or cache is None else \
            [key for key in self._keys if runtime.registry.bound_to(key, cache)]  # not a binding made after ours
        if bound and endpoint is not None:  # checked before anything changes: a refused release leaves it running
            endpoint.require_role("remove_cache_key", LLMRole.PROMPT, LLMRole.MIX)  # as remove_cache_key
        self._stop_timer()
        self._expired = True
        self._endpoint = None
        self._unwatch()
        self._let_go()
        if runtime is None:
            return  # finalize freed everything already
        registry = runtime.registry
        for key in bound:
            registry.remove_key(key)  # as remove_cache_key
        if cache is not None:
            try:
                registry.deallocate(cache)  # as deallocate_cache
            except LLMException as exc:
                if exc.status_code != LLMStatusCode.LLM_KV_CACHE_NOT_EXIST:  # already dropped by its owner
                    raise
            runtime.arrivals.released(cache)


def lease_cache(manager: _Manager, cache: KvCache, cache_keys: Sequence[CacheKey], *,
                lease_ms: int) -> CacheLease:
    """Put a lease on an allocated hand-off cache bound to ``cache_keys``.

    :param manager: the ``KvCacheManager`` of a PROMPT or MIX endpoint.
    :param cache: a cache of that manager (allocated or registered).
    :param cache_keys: the keys to unbind on expiry.
    :param lease_ms: milliseconds until expiry.
    :raises LLMException: ``LLM_PARAM_INVALID`` for bad arguments or role (naming
        ``manager``, also a ``TypeError``, for anything but a ``KvCacheManager``), or
        naming ``cache`` when a lease on it still runs (renew or cancel that
        one, ``lease_of(cache)``); ``LLM_KV_CACHE_NOT_EXIST`` for a cache that is gone.
    """
    endpoint = _endpoint_of(manager)
    endpoint.require_role("lease_cache", LLMRole.PROMPT, LLMRole.MIX)
    check_instance("cache", cache, KvCache)
    if cache.cache_id == -1:  # a lease ends in deallocate_cache, which a CPU cache (the caller's memory) has not
        raise param_invalid("cache", "a KvCache.create_cpu_cache cache is the caller's memory, not allocated or "
                                     "registered here: it cannot be leased")
    cache = endpoint.live(cache, "cache")
    running = _LEASES.get(cache)
    if running is not None and running.active:  # a second one would expire it beside the one lease_of finds
        raise param_invalid("cache", "a lease on it still runs; renew or cancel that one (lease_of(cache))")
    if not isinstance(cache_keys, (list, tuple)):
        raise param_invalid("cache_keys", f"expected a list of CacheKey, got {type(cache_keys).__name__}")
    for i, key in enumerate(cache_keys):
        check_instance(f"cache_keys[{i}]", key, CacheKey)
    return CacheLease(endpoint, cache, cache_keys, lease_ms)


def allocate_leased_cache(manager: _Manager, cache_desc: CacheDesc, cache_keys: Sequence[CacheKey], *,
                          lease_ms: int) -> tuple[KvCache, CacheLease]:
    """``manager.allocate_cache(cache_desc, cache_keys)`` with a lease of ``lease_ms``; what
    ``allocate_cache(..., lease_ms=...)`` runs.

    :returns: ``(cache, lease)``.
    :raises LLMException: as ``allocate_cache``; ``LLM_PARAM_INVALID`` naming
        ``manager`` for anything but a ``KvCacheManager``, naming ``lease_ms``
        when it is not an int in ``[1, 2**31 - 1]`` or the endpoint is a
        DECODER (a lease removes keys); ``LLM_FAILED`` without a running event
        loop or on another loop than the endpoint's. On any of them nothing is
        allocated.
    """
    lease_ms = check_int("lease_ms", lease_ms, lo=1, hi=MAX_LEASE_MS)
    endpoint = _endpoint_of(manager)
    role = endpoint.role
    if role not in (LLMRole.PROMPT, LLMRole.MIX):
        raise param_invalid("lease_ms", f"a lease removes keys, which needs role PROMPT or MIX; this "
                            f"LLMDataDist is {role.name}")
    endpoint.home_loop("a lease's timer")
    cache = manager.allocate_cache(cache_desc, cache_keys)
    return cache, CacheLease(endpoint, cache, [k for k in cache_keys if not k.is_placeholder], lease_ms)


def _endpoint_of(manager: _Manager) -> Endpoint:
    """The endpoint of a ``KvCacheManager``; anything else (the v2 ``CacheManager``, None) is refused
    naming ``manager`` rather than failing on a missing attribute."""
    from aio_datadist.endpoint import Endpoint  # a lower layer; imported here as the type-only import above

    endpoint = getattr(manager, "endpoint", None)
    if not isinstance(endpoint, Endpoint):
        raise param_type_error("manager", "expected the async aio_datadist.KvCacheManager (dd.kv_cache_manager of an "
                               "aio_datadist.LLMDataDist; leases are KvCacheManager mode's, and the blocking facade's "
                               "KvCacheManager.allocate_cache takes lease_ms itself), got "
                               f"{type(manager).__module__}.{type(manager).__qualname__}")
    return endpoint


def _nothing() -> None:
    pass


def end_leases(endpoint: Endpoint) -> None:
    """``endpoint`` is being finalized (which frees every cache): its leases end now, their timers with them, and
    a later ``renew`` is refused."""
    for lease in list(_ALL):  # (not by cache: a lease whose cache the caller dropped still runs)
        if lease._endpoint is endpoint:
            lease._stop_timer()
            lease._expired = lease._finalized = True
            lease._endpoint = None
            lease._unwatch()
            lease._let_go()


def active_leases(endpoint: Endpoint) -> int:
    """Leases of ``endpoint`` that neither expired nor were cancelled."""
    return sum(1 for lease in list(_LEASES.values()) if lease._endpoint is endpoint and lease.active)


def lease_of(cache: KvCache) -> CacheLease | None:
    """The lease put on ``cache`` (by ``allocate_cache(..., lease_ms=...)`` or this module), or None."""
    return _LEASES.get(cache)


