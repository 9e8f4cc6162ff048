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
import concurrent.futures
import threading
import weakref
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from aio_datadist.stats import KINDS, EndpointStats, Outcome, size_class
from aio_datadist.status import LLMException, LLMStatusCode

if TYPE_CHECKING:
    from aio_datadist.datadist import LLMDataDist

__all__ = ["DURATION_BUCKETS", "PrometheusMetrics", "instrument"]

#: Latency buckets of ``aio_datadist_transfer_duration_seconds``: 50 us to 60 s.
DURATION_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
                    1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: How long a scrape from another thread waits for the endpoint's event loop to take the snapshot.
SCRAPE_WAIT_S = 2.0

_EXPORTERS: weakref.WeakKeyDictionary[Any, PrometheusMetrics] = weakref.WeakKeyDictionary()
_EXPORTERS_LOCK = threading.Lock()


def _prometheus() -> Any:
    try:
        import prometheus_client
    except ImportError as exc:
        raise LLMException("aio_datadist.metrics needs prometheus_client: pip install 'aio_datadist[metrics]'",
                           status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED) from exc
    return prometheus_client


def instrument(dd: LLMDataDist, registry: Any = None) -> PrometheusMetrics:
    """Export ``dd``'s metrics on ``registry`` (default: ``prometheus_client.REGISTRY``); the exporter.

    ``dd`` is an :class:`aio_datadist.LLMDataDist` or the blocking ``aio_datadist.compat.LLMDataDist``.

    One exporter serves each registry; instrumenting a second endpoint on the
    same registry adds its series (labelled with its ``cluster_id``).

    :raises LLMException: ``LLM_FEATURE_NOT_ENABLED`` without ``prometheus_client``;
        ``LLM_PARAM_INVALID`` naming ``dd`` when it is not an LLMDataDist.
    """
    from aio_datadist.datadist import LLMDataDist

    inner = getattr(dd, "_dd", None)  # the blocking facade (aio_datadist.compat) wraps the async endpoint
    if isinstance(inner, LLMDataDist):
        dd = inner
    if not isinstance(dd, LLMDataDist):
        raise LLMException(f"invalid argument 'dd': expected an LLMDataDist, got {type(dd).__name__}",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    prom = _prometheus()
    registry = prom.REGISTRY if registry is None else registry
    with _EXPORTERS_LOCK:
        exporter = _EXPORTERS.get(registry)
        if exporter is None:
            exporter = _EXPORTERS[registry] = PrometheusMetrics(registry)
    exporter.watch(dd)
    return exporter


class PrometheusMetrics:
    """The metrics of the endpoints watched, registered on one ``prometheus_client`` registry."""

    def __init__(self, registry: Any) -> None:
        prom = _prometheus()
        self.registry = registry
        self._watched: dict[int, tuple[weakref.ref[LLMDataDist], _Observer]] = {}
        self.transfers = prom.Counter(
            "aio_datadist_transfers", "Transfers that ended, by kind, transport and outcome.",
            ("cluster_id", "kind", "transport", "outcome"), registry=registry)
        self.transfer_bytes = prom.Counter(
            "aio_datadist_transfer_bytes", "Bytes moved by transfers that completed.",
            ("cluster_id", "kind", "transport"), registry=registry)
        self.errors = prom.Counter(
            "aio_datadist_transfer_errors", "Transfers that failed or timed out, by status code.",
            ("cluster_id", "kind", "status"), registry=registry)
        self.duration = prom.Histogram(
            "aio_datadist_transfer_duration_seconds", "Time from the call to its return, of transfers that completed.",
            ("cluster_id", "kind", "transport", "size_class"), buckets=DURATION_BUCKETS, registry=registry)
        self.link_events = prom.Counter(
            "aio_datadist_link_events", "Links that came up or went down.", ("cluster_id", "event"),
            registry=registry)
        registry.register(_Gauges(self))

    def watch(self, dd: LLMDataDist) -> None:
        """Add ``dd``'s series (again a no-op)."""
        key = id(dd)
        if key in self._watched and self._watched[key][0]() is dd:
            return
        observer = _Observer(self, str(dd.cluster_id))
        dd._endpoint.observers.append(observer)
        self._watched[key] = (weakref.ref(dd), observer)

    def unwatch(self, dd: LLMDataDist) -> None:
        """Stop counting ``dd``'s transfers and drop its gauges (counters keep what they counted)."""
        entry = self._watched.pop(id(dd), None)
        if entry is not None and entry[1] in dd._endpoint.observers:
            dd._endpoint.observers.remove(entry[1])

    def endpoints(self) -> list[LLMDataDist]:
        return [dd for ref, _ in list(self._watched.values()) if (dd := ref()) is not None]


class _Observer:
    """Feeds the counters from one endpoint's transfers and links (on its event loop)."""

    __slots__ = ("_metrics", "_cluster", "_children")

    def __init__(self, metrics: PrometheusMetrics, cluster: str) -> None:
        self._metrics = metrics
        self._cluster = cluster
        self._children: dict[tuple, tuple[Any, Any, Any]] = {}

    def transfer(self, cluster_id: int, kind: str, transport: str, nbytes: int, seconds: float,
                 outcome: Outcome, status: LLMStatusCode) -> None:
        m = self._metrics
        if outcome is not Outcome.OK:
            m.transfers.labels(self._cluster, kind, transport, outcome.value).inc()
            if outcome is not Outcome.CANCELLED:
                m.errors.labels(self._cluster, kind, status.name).inc()
            return
        key = (kind, transport, size_class(nbytes))
        children = self._children.get(key)
        if children is None:  # label lookups cost more than the updates: once per label set
            children = self._children[key] = (m.transfers.labels(self._cluster, kind, transport, "ok"),
                                              m.transfer_bytes.labels(self._cluster, kind, transport),
                                              m.duration.labels(self._cluster, *key))
        count, moved, duration = children
        count.inc()
        moved.inc(nbytes)
        duration.observe(seconds)

    def link(self, cluster_id: int, remote_cluster_id: int, up: bool) -> None:
        self._metrics.link_events.labels(self._cluster, "up" if up else "down").inc()


class _Gauges:
    """The gauges, read from each watched endpoint's ``stats()`` at scrape time."""

    def __init__(self, metrics: PrometheusMetrics) -> None:
        self._metrics = metrics

    def describe(self) -> list:
        return []  # the series depend on the endpoints watched: no up-front description

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import GaugeMetricFamily

        families = {
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
        for dd in self._metrics.endpoints():
            snap = _snapshot(dd)
            if snap is None:
                continue
            cid = str(snap.cluster_id)
            by_transport: dict[str, int] = {}
            for link in snap.links.values():
                by_transport[link.transport] = by_transport.get(link.transport, 0) + 1
            for transport in ("tcp", "tls", "local", "nixl"):
                families["links"].add_metric((cid, transport), by_transport.get(transport, 0))
            families["registered"].add_metric((cid,), snap.registered_bytes)
            families["cap"].add_metric((cid,), snap.registered_cap_bytes)
            families["caches"].add_metric((cid,), snap.caches)
            families["keys"].add_metric((cid,), snap.keys)
            families["leases"].add_metric((cid,), snap.leases)
            for kind in KINDS:
                families["in_flight"].add_metric((cid, kind), sum(link.kinds[kind].in_flight
                                                                  for link in snap.links.values()))
            for remote, link in snap.links.items():
                if link.heartbeat_rtt_ms is not None:
                    families["rtt"].add_metric((cid, str(remote)), link.heartbeat_rtt_ms / 1000)
        yield from families.values()


def _snapshot(dd: LLMDataDist) -> EndpointStats | None:
    """``dd.stats()`` taken on its event loop's thread (a scrape usually comes from a server thread); None
    when the endpoint is not initialised or its loop does not answer within :data:`SCRAPE_WAIT_S`."""
    runtime = dd._endpoint.runtime
    if runtime is None:
        return None
    loop = runtime.loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is None or running is loop or loop.is_closed() or not loop.is_running():
        return _stats(dd)
    answer: concurrent.futures.Future[EndpointStats | None] = concurrent.futures.Future()

    def take() -> None:
        if answer.set_running_or_notify_cancel():
            answer.set_result(_stats(dd))

    try:
        loop.call_soon_threadsafe(take)
    except RuntimeError:  # closed meanwhile
        return None
    try:
        return answer.result(SCRAPE_WAIT_S)
    except concurrent.futures.TimeoutError:
        answer.cancel()
        return None


def _stats(dd: LLMDataDist) -> EndpointStats | None:
    try:
        return dd.stats()
    except LLMException:  # finalized meanwhile
        return None
