"""Prometheus metrics of LLMDataDist endpoints (the optional extra ``metrics``: ``prometheus_client``).

>>> from prometheus_client import CollectorRegistry
>>> registry = CollectorRegistry()
>>> metrics = instrument(dd, registry)   # dd: an LLMDataDist; before or after init

Counters and the latency histogram are fed by every finished transfer and
every link going up or down; gauges (links up by transport, registered
memory, caches, keys, leases, transfers in flight, heartbeat round trips)
are read from :meth:`LLMDataDist.stats` when the registry is scraped.
Nothing is served by default: expose the registry the way the application
already does (``prometheus_client.start_http_server(port, registry=...)``,
or its ASGI/WSGI app). Names and labels: ``docs/observability.md``.

Several endpoints may share one registry: every series carries the
endpoint's ``cluster_id``.
"""

from __future__ import annotations

import asyncio
import bisect
import concurrent.futures
import os
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from aio_datadist._forks import forks
from aio_datadist.stats import KINDS, EndpointStats, Outcome, size_class
from aio_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from aio_datadist.datadist import LLMDataDist
    from aio_datadist.endpoint import Endpoint

__all__ = ["DURATION_BUCKETS", "PrometheusMetrics", "instrument"]

#: Latency buckets of ``aio_datadist_transfer_duration_seconds``: 50 us to 60 s.
DURATION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: How long a scrape from another thread waits for the endpoint's event loop to take the snapshot.
SCRAPE_WAIT_S = 2.0

# registry -> its exporter, both weakly: the registry holds the exporter (through its collector), so an entry
# goes with a registry its owner dropped (a strong value would hold its own key, and so every registry, forever).
_EXPORTERS: weakref.WeakKeyDictionary[Any, weakref.ref[PrometheusMetrics]] = weakref.WeakKeyDictionary()
_EXPORTERS_LOCK = threading.Lock()


def _after_fork_in_child() -> None:
    global _EXPORTERS_LOCK
    _EXPORTERS_LOCK = threading.Lock()  # a parent's thread may have held it at the fork: it is not here to let go


os.register_at_fork(after_in_child=_after_fork_in_child)


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise LLMException("aio_datadist.metrics needs prometheus_client: pip install 'aio_datadist[metrics]'",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED) from exc
    return prometheus_client


def _endpoint_of(dd: Any) -> LLMDataDist:
    from aio_datadist.datadist import endpoint_of  # imported on use, as the endpoint's type above

    return endpoint_of(dd)


def instrument(dd: LLMDataDist, registry: Any = None) -> PrometheusMetrics:
    """Export ``dd``'s metrics on ``registry`` (default: ``prometheus_client.REGISTRY``); the exporter.

    ``dd`` is an :class:`aio_datadist.LLMDataDist` or the blocking ``aio_datadist.compat.LLMDataDist``.

    One exporter serves each registry; instrumenting a second endpoint on the
    same registry adds its series (labelled with its ``cluster_id``).

    :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` without ``prometheus_client``;
        ``LLM_PARAM_INVALID`` naming ``dd`` when it is not an LLMDataDist.
    """
    dd = _endpoint_of(dd)
    prom = _prometheus()
    registry = prom.REGISTRY if registry is None else registry
    with _EXPORTERS_LOCK:
        held = _EXPORTERS.get(registry)
        exporter = None if held is None else held()
        if exporter is None:
            exporter = PrometheusMetrics(registry)
            _EXPORTERS[registry] = weakref.ref(exporter)
    exporter.watch(dd)
    return exporter


class PrometheusMetrics:
    """The metrics of the endpoints watched, registered on one ``prometheus_client`` registry.

    Each endpoint's transfers and link events are counted by an observer of
    its own, in plain integers on the endpoint's loop (no lock, no label
    lookup on the transfer's path); the registry reads them, and the gauges,
    when it is collected.
    """

    def __init__(self, registry: Any) -> None:
        _prometheus()
        self.registry = registry
        self._lock = threading.Lock()
        # id(endpoint) -> (the endpoint, its observer); the endpoint under the LLMDataDist (its managers and links
        # hold it: a caller that drops the LLMDataDist but keeps a manager keeps the endpoint serving, and counted).
        # What an observer counted outlives its watch (counters never go down): an endpoint unwatched, or gone,
        # leaves its counts in _retired, one observer per cluster_id that adds them all up, so that a cluster
        # watched again (or an endpoint of the same cluster_id made anew) goes on from them in one series instead
        # of a second one with the same labels.
        self._watched: dict[int, tuple[weakref.ref[Endpoint], _Observer]] = {}
        self._retired: dict[str, _Observer] = {}
        # An exporter whose registry was dropped takes its observers off the endpoints it watched, which would
        # otherwise call them on every transfer for as long as they live (the finalizer holds only the table).
        weakref.finalize(self, _let_go, self._watched).atexit = False
        registry.register(_Collector(self))

    def watch(self, dd: LLMDataDist) -> None:
        """Count ``dd``'s transfers and export its series (again: a no-op).

        ``dd`` is an :class:`aio_datadist.LLMDataDist` or the blocking ``aio_datadist.compat.LLMDataDist``.
        An endpoint whose ``cluster_id`` was watched before (itself, unwatched; or an endpoint finalized
        since) adds to that cluster's counters.

        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``dd`` when it is not an LLMDataDist.
        """
        endpoint = _endpoint_of(dd)._endpoint
        with self._lock:
            key = id(endpoint)
            entry = self._watched.get(key)
            if entry is not None:
                if entry[0]() is endpoint:
                    return
                self._retire(self._watched.pop(key)[1])  # an endpoint gone whose id was taken again
            observer = _Observer(str(endpoint.cluster_id))
            endpoint.observers.append(observer)
            self._watched[key] = (weakref.ref(endpoint), observer)

    def unwatch(self, dd: LLMDataDist) -> None:
        """Stop counting ``dd``'s transfers and drop its gauges; its counters keep what they counted.

        ``dd`` is an :class:`aio_datadist.LLMDataDist` or the blocking ``aio_datadist.compat.LLMDataDist``
        (an endpoint not watched: a no-op).

        :raises LLMException: ``LLM_PARAM_INVALID`` naming ``dd`` when it is not an LLMDataDist.
        """
        endpoint = _endpoint_of(dd)._endpoint
        with self._lock:
            entry = self._watched.pop(id(endpoint), None)
            if entry is None:
                return
            _stop_observing(endpoint, entry[1])
            self._retire(entry[1])

    def _retire(self, observer: _Observer) -> None:
        """Add what ``observer`` (no longer told of anything) counted to its cluster's retired counts; the lock
        is held."""
        _add_to(self._retired, observer.copy())  # (a copy: the endpoint's loop may be finishing a count)

    def _sources(self) -> tuple[list[tuple[Endpoint, _Observer]], list[_Observer]]:
        """The endpoints watched, each with its observer, and a copy of the retired counts of each cluster;
        endpoints garbage-collected since are retired here (a finalized one stays until then: the transfers its
        finalize failed are counted as their tasks end, after it returned)."""
        with self._lock:
            watched = []
            for key, (ref, observer) in list(self._watched.items()):
                endpoint = ref()
                if endpoint is None:
                    self._retire(self._watched.pop(key)[1])
                else:
                    watched.append((endpoint, observer))
            return watched, [retired.copy() for retired in self._retired.values()]


def _stop_observing(endpoint: Endpoint, observer: _Observer) -> None:
    try:
        endpoint.observers.remove(observer)
    except ValueError:  # already taken off
        pass


def _let_go(watched: dict[int, tuple[weakref.ref[Endpoint], _Observer]]) -> None:
    """Take the observers of an exporter gone off the endpoints still alive (from the garbage collector, on any
    thread: the endpoint's loop iterates a copy of its observers, see ``LinkCounters``)."""
    for ref, observer in list(watched.values()):
        endpoint = ref()
        if endpoint is not None:
            _stop_observing(endpoint, observer)


class _Done:
    """Completed transfers of one kind, transport and size class: count, bytes, time, latency buckets."""

    __slots__ = ("count", "bytes", "seconds", "buckets")

    def __init__(self) -> None:
        self.count = 0
        self.bytes = 0
        self.seconds = 0.0
        self.buckets = [0] * (len(DURATION_BUCKETS) + 1)  # the last is +Inf

    def copy(self) -> _Done:
        other = _Done()
        other.count, other.bytes, other.seconds, other.buckets = self.count, self.bytes, self.seconds, self.buckets[:]
        return other

    def add(self, other: _Done) -> None:
        self.count += other.count
        self.bytes += other.bytes
        self.seconds += other.seconds
        self.buckets = [mine + theirs for mine, theirs in zip(self.buckets, other.buckets, strict=True)]


class _Observer:
    """Counts one endpoint's transfers and link events (on its event loop) for :class:`_Collector`."""

    __slots__ = ("cluster", "done", "ended", "links")

    def __init__(self, cluster: str) -> None:
        self.cluster = cluster
        self.done: dict[tuple[str, str, str], _Done] = {}  # (kind, transport, size class)
        self.ended: dict[tuple[str, str, str, str], int] = {}  # (kind, transport, outcome, status) of the rest
        self.links = {"up": 0, "down": 0}

    def transfer(self, cluster_id: int, kind: str, transport: str, nbytes: int, seconds: float,
                 outcome: Outcome, status: LLMStatusCode) -> None:
        if outcome is not Outcome.OK:
            key = (kind, transport, outcome.value, status.name)
            self.ended[key] = self.ended.get(key, 0) + 1
            return
        self._count(kind, transport, 1, nbytes, seconds)

    def transfers(self, cluster_id: int, kind: str, transport: str, count: int, nbytes: int,
                  seconds: float) -> None:
        # count transfers of nbytes // count bytes (the first nbytes % count one byte more), seconds / count each
        share, more = divmod(nbytes, count)
        if more:
            self._count(kind, transport, more, share + 1, seconds / count)
        if count > more:
            self._count(kind, transport, count - more, share, seconds / count)

    def _count(self, kind: str, transport: str, n: int, nbytes: int, seconds: float) -> None:
        """``n`` finished transfers of ``nbytes`` each that took ``seconds`` each."""
        key3 = (kind, transport, size_class(nbytes))
        done = self.done.get(key3)
        if done is None:
            done = self.done[key3] = _Done()
        done.count += n
        done.bytes += nbytes * n
        done.seconds += seconds * n
        done.buckets[bisect.bisect_left(DURATION_BUCKETS, seconds)] += n

    def link(self, cluster_id: int, remote_cluster_id: int, up: bool) -> None:
        self.links["up" if up else "down"] += 1

    def copy(self) -> _Observer:
        """A copy to read from another thread: also from a thread other than the one counting, as the dicts
        are copied (``list``, ``dict``) in one step each, which no count of the loop's can come between (a
        dict iterated in Python code while a count adds a key raises; the copy that caught that was empty)."""
        other = _Observer(self.cluster)
        other.done = {key: done.copy() for key, done in list(self.done.items())}
        other.ended = dict(self.ended)
        other.links = dict(self.links)
        return other

    def add(self, other: _Observer) -> None:
        """Add what ``other`` (a copy, nobody else counting in it) counted to this observer's counts."""
        for key, done in other.done.items():
            mine = self.done.get(key)
            if mine is None:
                self.done[key] = done.copy()
            else:
                mine.add(done)
        for key4, n in other.ended.items():
            self.ended[key4] = self.ended.get(key4, 0) + n
        for event, n in other.links.items():
            self.links[event] = self.links.get(event, 0) + n


def _add_to(counts: dict[str, _Observer], counted: _Observer) -> None:
    """Add ``counted`` (a copy nobody else counts in) to its cluster's entry of ``counts``, or make it that entry."""
    mine = counts.setdefault(counted.cluster, counted)
    if mine is not counted:
        mine.add(counted)


class _Collector:
    """Every series, read at collection time: counters and the histogram from the observers, gauges from
    each watched endpoint's ``stats()`` (both taken on the endpoint's own loop)."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> Iterator[Any]:
        """The metric families :meth:`collect` yields, without samples: the registry files the collector under
        their names, which a scrape asking for some of them by name (``?name[]=``) looks up."""
        counters, duration, gauges = _families()
        yield from counters.values()
        yield duration
        yield from gauges.values()

    def collect(self) -> Iterator[Any]:
        counters, duration, gauges = _families()
        # One sample set per cluster_id: the counts of every observer of that cluster (its retired counts,
        # the endpoints watched with it) added up, and the gauges of the last of them watched that answers
        # (Prometheus refuses a registry that yields one series twice).
        watched, retired = self._metrics._sources()
        counts = {observer.cluster: observer for observer in retired}
        snaps: dict[str, EndpointStats] = {}
        for snap, counted in _snapshots(watched):
            _add_to(counts, counted)
            if snap is not None:
                snaps[counted.cluster] = snap
        for counted in counts.values():
            _add_counts(counters, duration, counted)
        for snap in snaps.values():
            _add_gauges(gauges, snap)
        yield from counters.values()
        yield duration
        yield from gauges.values()


def _families() -> tuple[dict[str, Any], Any, dict[str, Any]]:
    """Every metric family the exporter has (counters, the duration histogram, gauges), empty."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

    counters = {
        "transfers": CounterMetricFamily("aio_datadist_transfers",
                                         "Transfers that ended, by kind, transport and outcome.",
                                         labels=("cluster_id", "kind", "transport", "outcome")),
        "bytes": CounterMetricFamily("aio_datadist_transfer_bytes", "Bytes moved by transfers that completed.",
                                     labels=("cluster_id", "kind", "transport")),
        "errors": CounterMetricFamily("aio_datadist_transfer_errors",
                                      "Transfers that failed or timed out, by status code.",
                                      labels=("cluster_id", "kind", "status")),
        "links": CounterMetricFamily("aio_datadist_link_events", "Links that came up or went down.",
                                     labels=("cluster_id", "event")),
    }
    duration = HistogramMetricFamily("aio_datadist_transfer_duration_seconds",
                                     "Time from the call to its return, of transfers that completed.",
                                     labels=("cluster_id", "kind", "transport", "size_class"))
    gauges = {
        "links": GaugeMetricFamily("aio_datadist_links", "Links up now, by the transport each negotiated.",
                                   labels=("cluster_id", "transport")),
        "registered": GaugeMetricFamily("aio_datadist_registered_bytes", "Cache memory registered.",
                                        labels=("cluster_id",)),
        "cap": GaugeMetricFamily("aio_datadist_registered_cap_bytes",
                                 "The cap on registered cache memory (aio.RegisteredMemoryCap).",
                                 labels=("cluster_id",)),
        "caches": GaugeMetricFamily("aio_datadist_caches", "Registered caches.", labels=("cluster_id",)),
        "keys": GaugeMetricFamily("aio_datadist_cache_keys", "Cache keys bound (blocks keys included).",
                                  labels=("cluster_id",)),
        "leases": GaugeMetricFamily("aio_datadist_leases", "Cache leases running.", labels=("cluster_id",)),
        "in_flight": GaugeMetricFamily("aio_datadist_transfers_in_flight", "Transfers running now, by kind.",
                                       labels=("cluster_id", "kind")),
        "rtt": GaugeMetricFamily("aio_datadist_heartbeat_rtt_seconds",
                                 "Round trip of the last answered heartbeat, per link.",
                                 labels=("cluster_id", "remote_cluster_id")),
    }
    return counters, duration, gauges


def _add_counts(counters: dict[str, Any], duration: Any, observer: _Observer) -> None:
    cid = observer.cluster
    ok: dict[tuple[str, str], list[int]] = {}
    for (kind, transport, size), done in sorted(observer.done.items()):
        sums = ok.setdefault((kind, transport), [0, 0])
        sums[0] += done.count
        sums[1] += done.bytes
        cumulative, buckets = 0, []
        for bound, n in zip((*DURATION_BUCKETS, float("inf")), done.buckets, strict=True):
            cumulative += n
            buckets.append(("+Inf" if bound == float("inf") else repr(bound), cumulative))
        duration.add_metric((cid, kind, transport, size), buckets, done.seconds)
    for (kind, transport), (count, nbytes) in ok.items():
        counters["transfers"].add_metric((cid, kind, transport, "ok"), count)
        counters["bytes"].add_metric((cid, kind, transport), nbytes)
    ended: dict[tuple[str, str, str], int] = {}
    errors: dict[tuple[str, str], int] = {}
    for (kind, transport, outcome, status), n in sorted(observer.ended.items()):
        ended[(kind, transport, outcome)] = ended.get((kind, transport, outcome), 0) + n
        if outcome != Outcome.CANCELLED.value:
            errors[(kind, status)] = errors.get((kind, status), 0) + n
    for (kind, transport, outcome), n in ended.items():
        counters["transfers"].add_metric((cid, kind, transport, outcome), n)
    for (kind, status), n in errors.items():
        counters["errors"].add_metric((cid, kind, status), n)
    for event, n in observer.links.items():
        if n:
            counters["links"].add_metric((cid, event), n)


def _add_gauges(gauges: dict[str, Any], snap: EndpointStats) -> None:
    cid = str(snap.cluster_id)
    by_transport: dict[str, int] = {}
    for link in snap.links.values():
        by_transport[link.transport] = by_transport.get(link.transport, 0) + 1
    for transport in ("tcp", "tls", "local", "nixl"):
        gauges["links"].add_metric((cid, transport), by_transport.get(transport, 0))
    gauges["registered"].add_metric((cid,), snap.registered_bytes)
    gauges["cap"].add_metric((cid,), snap.registered_cap_bytes)
    gauges["caches"].add_metric((cid,), snap.caches)
    gauges["keys"].add_metric((cid,), snap.keys)
    gauges["leases"].add_metric((cid,), snap.leases)
    for kind in KINDS:
        gauges["in_flight"].add_metric((cid, kind), sum(link.kinds[kind].in_flight for link in snap.links.values()))
    for remote, link in snap.links.items():
        if link.heartbeat_rtt_ms is not None:
            gauges["rtt"].add_metric((cid, str(remote)), link.heartbeat_rtt_ms / 1000)


def _snapshots(watched: list[tuple[Endpoint, _Observer]]) -> list[tuple[EndpointStats | None, _Observer]]:
    """Each endpoint's ``stats()`` (None when not initialised) and a copy of its observer, taken on the endpoint's
    loop thread (a scrape usually comes from a server thread). Every loop is asked first, then all are waited for
    together, :data:`SCRAPE_WAIT_S` in all: an endpoint whose loop does not answer by then gives no gauges and
    its counts as last copied."""
    taken = [_take(endpoint, observer) for endpoint, observer in watched]
    asked = [answer for answer in taken if isinstance(answer, concurrent.futures.Future)]
    if asked:
        concurrent.futures.wait(asked, SCRAPE_WAIT_S)
    snaps = []
    for (_, observer), answer in zip(watched, taken, strict=True):
        if not isinstance(answer, concurrent.futures.Future):
            snaps.append(answer)
        elif answer.cancel() or not answer.done():  # not taken yet (no longer will be), or being taken now
            snaps.append((None, observer.copy()))
        else:
            snaps.append(answer.result())
    return snaps


def _take(endpoint: Endpoint, observer: _Observer) -> (
        tuple[EndpointStats | None, _Observer] | concurrent.futures.Future[tuple[EndpointStats | None, _Observer]]):
    """``endpoint``'s snapshot (:func:`_snapshots`) taken here, where its loop is this thread's or runs nowhere;
    else its future, posted to the loop. A loop that was closed without ``finalize`` gives no gauges: its links
    carry nothing any more."""
    runtime = endpoint.runtime
    if runtime is not None and endpoint.forks != forks():
        # A parent's endpoint in a forked child: its loop's copy says it runs (it keeps the parent's thread id)
        # but no thread here runs it, and a post would write into the wake-up pipe shared with the parent.
        return None, observer.copy()
    loop = None if runtime is None else runtime.loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is not None and loop.is_closed():
        return None, observer.copy()
    if loop is None or running is loop or not loop.is_running():
        return _stats(endpoint), observer.copy()
    answer: concurrent.futures.Future[tuple[EndpointStats | None, _Observer]] = concurrent.futures.Future()

    def take() -> None:
        if answer.set_running_or_notify_cancel():
            answer.set_result((_stats(endpoint), observer.copy()))

    try:
        loop.call_soon_threadsafe(take)
    except RuntimeError:  # closed meanwhile
        return None, observer.copy()
    return answer


def _stats(endpoint: Endpoint) -> EndpointStats | None:
    from aio_datadist.datadist import endpoint_stats  # imported on use, as the endpoint's type above

    try:
        return endpoint_stats(endpoint)
    except LLMException:  # not initialised, or finalized meanwhile
        return None
