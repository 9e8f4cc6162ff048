"""What an endpoint did and how its links are: live counters and the snapshot ``LLMDataDist.stats()`` returns.

Every link keeps one :class:`LinkCounters`: per kind of transfer (the pulls
and pushes this end asked for, and those it served for the peer) how many
ran, how many bytes moved, how they failed, how long they took and which
transport carried the last one. Updating them costs a few attribute writes
per transfer; :meth:`LinkCounters.snapshot` copies them into frozen
dataclasses, so a snapshot is cheap to take every second and never changes
under its reader.

An :class:`Observer` (the Prometheus exporter in ``aio_datadist.metrics``)
hears of every finished transfer and of every link going up or down.
"""

from __future__ import annotations

import dataclasses
import enum
import logging
import time
import traceback
from collections.abc import Mapping
from types import MappingProxyType
from typing import Protocol

from aio_datadist.status import LLMStatusCode
from aio_datadist.types import LLMRole

__all__ = ["KINDS", "SIZE_CLASSES", "EndpointStats", "LinkCounters", "LinkStats", "Observer", "Outcome",
           "TransferStats", "size_class"]

log = logging.getLogger("aio_datadist.stats")

#: The kinds of transfer a link counts: what this end asked for, and what it served for the peer.
KINDS = ("pull", "push", "served_pull", "served_push")
#: Kinds whose bytes land here (the rest leave).
_INBOUND = frozenset({"pull", "served_push"})

#: Size classes of a transfer, by upper bound in bytes (the last is unbounded).
SIZE_CLASSES = (("64KiB", 64 << 10), ("1MiB", 1 << 20), ("16MiB", 16 << 20), ("256MiB", 256 << 20),
                ("large", 1 << 64))


def size_class(nbytes: int) -> str:
    """The size class of a transfer of ``nbytes``: the smallest bound it fits under (``"large"`` past 256 MiB)."""
    for name, bound in SIZE_CLASSES:
        if nbytes <= bound:
            return name
    return "large"


class Outcome(enum.Enum):
    """How a transfer ended."""

    OK = "ok"
    FAILED = "failed"  # an LLMException or a refusal: counted by status code
    TIMEOUT = "timeout"  # LLM_TIMEOUT
    CANCELLED = "cancelled"  # the caller cancelled it


class Observer(Protocol):
    """Hears of finished transfers and of links going up and down (on the event loop; must not block)."""

    def transfer(self, cluster_id: int, kind: str, transport: str, nbytes: int, seconds: float,
                 outcome: Outcome, status: LLMStatusCode) -> None: ...

    def transfers(self, cluster_id: int, kind: str, transport: str, count: int, nbytes: int,
                  seconds: float) -> None:
        """``count`` transfers ended well, ``nbytes`` and ``seconds`` in all, shared evenly (a peer's ``READ``
        report): the same as ``count`` calls of :meth:`transfer` with ``Outcome.OK``."""

    def link(self, cluster_id: int, remote_cluster_id: int, up: bool) -> None: ...


@dataclasses.dataclass(frozen=True)
class TransferStats:
    """One kind of transfer on one link, since the link came up.

    :ivar transfers: transfers that completed.
    :ivar bytes: bytes those moved.
    :ivar failures: transfers that failed, by status code name (timeouts included, as ``LLM_TIMEOUT``).
    :ivar timeouts: of those, the ones that timed out (``failures["LLM_TIMEOUT"]``; served: given up at the deadline).
    :ivar cancellations: transfers the caller cancelled (not in ``failures``).
    :ivar in_flight: transfers running now.
    :ivar seconds: total time the completed transfers took.
    :ivar transport: the transport that carried the last transfer of this kind (None before the first):
        ``"tcp"``, ``"tls"``, ``"local"`` or ``"nixl"``.
    """

    transfers: int = 0
    bytes: int = 0
    failures: Mapping[str, int] = dataclasses.field(default_factory=lambda: MappingProxyType({}))
    timeouts: int = 0
    cancellations: int = 0
    in_flight: int = 0
    seconds: float = 0.0
    transport: str | None = None


@dataclasses.dataclass(frozen=True)
class LinkStats:
    """One link, as :meth:`~aio_datadist.LLMDataDist.stats` saw it.

    :ivar remote_cluster_id: the peer's cluster id.
    :ivar remote_role: the peer's role when the link was made.
    :ivar link_id: this process's number for the link (the logs name it too).
    :ivar transport: what the link negotiated: ``"nixl"``, ``"local"``, ``"tls"`` or ``"tcp"`` (what
        blocks-cache transfers take; a single transfer may still take TCP, see ``kinds``).
    :ivar up_seconds: how long the link has been up.
    :ivar heartbeat_rtt_ms: the round trip of the last answered heartbeat, None before the first.
    :ivar bytes_in: bytes that landed here (our pulls, pushes we served).
    :ivar bytes_out: bytes that left (our pushes, pulls we served).
    :ivar kinds: per kind of transfer (``pull``, ``push``, ``served_pull``, ``served_push``) its counts.
    :ivar device_ipc_off: with a device backend, why device caches on this link take the staging plane
        (the transport of their transfers is then ``tcp`` or ``tls``) rather than device IPC (``local``):
        no same-host share, a backend that does not export, a peer that could not map our caches or whose
        caches we could not map, registered caches. None where device IPC is available (or without a
        device backend).
    :ivar nixl_vram_off: on a NIXL link, why device caches took the staging plane there rather than NIXL
        (set once a transfer of a device cache on the link did): the device caches are not CUDA memory
        (the host backend, NPU), the agent's NIXL backend lists no VRAM memory type, or registering the
        cache as VRAM failed. None while no device cache was staged on the link.
    :ivar unmapped_ours: on a same-host link, our caches the peer could not map (it answered ``UNMAPPED``: its
        process's budget of peers' mappings was spent, or, for device caches, one of ``device_ipc_off``'s
        reasons), still allocated: they move over TCP (or the staging plane).
    :ivar unmapped_theirs: on a same-host link, the peer's host caches this process could not map (its budget of
        peers' mappings spent), not withdrawn: they move over TCP.
    """

    remote_cluster_id: int
    remote_role: LLMRole
    link_id: int
    transport: str
    up_seconds: float
    heartbeat_rtt_ms: float | None
    bytes_in: int
    bytes_out: int
    kinds: Mapping[str, TransferStats]
    device_ipc_off: str | None = None
    nixl_vram_off: str | None = None
    unmapped_ours: int = 0
    unmapped_theirs: int = 0

    @property
    def transports(self) -> dict[str, str]:
        """The transport each kind of transfer last took, for the kinds that ran."""
        return {kind: s.transport for kind, s in self.kinds.items() if s.transport is not None}


@dataclasses.dataclass(frozen=True)
class EndpointStats:
    """One endpoint (an initialised LLMDataDist), as :meth:`~aio_datadist.LLMDataDist.stats` saw it.

    :ivar cluster_id: this endpoint's cluster id.
    :ivar role: its role now.
    :ivar registered_bytes: cache memory registered (allocated or registered caches), in bytes.
    :ivar registered_cap_bytes: the cap on it (``aio.RegisteredMemoryCap``).
    :ivar caches: registered caches.
    :ivar keys: cache keys bound (blocks keys included).
    :ivar leases: leases still running: not expired nor cancelled, on caches still held.
    :ivar links: the links that are up, by the peer's cluster id.
    :ivar links_up: links that came up since ``init``.
    :ivar links_down: links that went down since ``init`` (failed, unlinked, or replaced by a relink).
    """

    cluster_id: int
    role: LLMRole
    registered_bytes: int
    registered_cap_bytes: int
    caches: int
    keys: int
    leases: int
    links: Mapping[int, LinkStats]
    links_up: int
    links_down: int


class _Traffic:
    """The live counters of one kind on one link."""

    __slots__ = ("transfers", "bytes", "failures", "timeouts", "cancellations", "in_flight", "seconds", "transport")

    def __init__(self) -> None:
        self.transfers = 0
        self.bytes = 0
        self.failures: dict[str, int] = {}
        self.timeouts = 0
        self.cancellations = 0
        self.in_flight = 0
        self.seconds = 0.0
        self.transport: str | None = None

    def frozen(self) -> TransferStats:
        return TransferStats(self.transfers, self.bytes, MappingProxyType(dict(self.failures)), self.timeouts,
                             self.cancellations, self.in_flight, self.seconds, self.transport)


class LinkCounters:
    """The counters of one link; the link's transfers report to it (see the module docstring)."""

    __slots__ = ("cluster_id", "remote_cluster_id", "observers", "_kinds", "rtt_s", "started", "nixl_vram_off")

    def __init__(self, cluster_id: int, remote_cluster_id: int, observers: list[Observer]) -> None:
        self.cluster_id = cluster_id
        self.remote_cluster_id = remote_cluster_id
        # Shared with the endpoint: observers added later are heard too. Iterated as a copy: an exporter adds
        # and removes its own from other threads (or from the garbage collector, mid-transfer on this one).
        self.observers = observers
        self._kinds = {kind: _Traffic() for kind in KINDS}
        self.rtt_s: float | None = None
        self.started = time.monotonic()
        #: Why a device cache on this link took the staging plane rather than NIXL (the last reason), or None.
        self.nixl_vram_off: str | None = None

    def begin(self, kind: str) -> float:
        """A transfer of ``kind`` starts: it is in flight; the time it started, for :meth:`end`."""
        self._kinds[kind].in_flight += 1
        return time.perf_counter()

    def in_flight(self, kind: str) -> int:
        """How many transfers of ``kind`` are running now."""
        return self._kinds[kind].in_flight

    def end(self, kind: str, transport: str, nbytes: int, started: float, outcome: Outcome,
            status: LLMStatusCode = LLMStatusCode.LLM_SUCCESS, *, began: bool = True) -> None:
        """The transfer begun at ``started`` ended with ``outcome`` (``status`` says how it failed: a failure
        with ``LLM_TIMEOUT``, such as a served transfer given up at its deadline, counts as a timeout)."""
        if outcome is Outcome.FAILED and status is LLMStatusCode.LLM_TIMEOUT:
            outcome = Outcome.TIMEOUT
        seconds = time.perf_counter() - started
        t = self._kinds[kind]
        if began:
            t.in_flight -= 1
        if outcome is Outcome.OK:
            t.transfers += 1
            t.bytes += nbytes
            t.seconds += seconds
            t.transport = transport
        elif outcome is Outcome.CANCELLED:
            t.cancellations += 1
        else:
            t.failures[status.name] = t.failures.get(status.name, 0) + 1
            if outcome is Outcome.TIMEOUT:
                t.timeouts += 1
        for observer in tuple(self.observers):
            try:
                observer.transfer(self.cluster_id, kind, transport, nbytes, seconds, outcome, status)
            except Exception:  # an observer's failure is its own: never the transfer's
                _observer_failed("an aio_datadist observer failed on a finished transfer")

    def ended_many(self, kind: str, transport: str, count: int, nbytes: int, seconds: float) -> None:
        """``count`` transfers of ``kind`` we did not begin ended well, ``nbytes`` and ``seconds`` in all (a peer's
        ``READ`` report): the counters and each observer move once, whatever ``count``."""
        t = self._kinds[kind]
        t.transfers += count
        t.bytes += nbytes
        t.seconds += seconds
        t.transport = transport
        for observer in tuple(self.observers):
            try:
                observer.transfers(self.cluster_id, kind, transport, count, nbytes, seconds)
            except Exception:  # an observer's failure is its own: never the transfer's
                _observer_failed("an aio_datadist observer failed on finished transfers")

    def link_event(self, *, up: bool) -> None:
        """The link came up (``up``) or went down: tell the observers."""
        for observer in tuple(self.observers):
            try:
                observer.link(self.cluster_id, self.remote_cluster_id, up)
            except Exception:
                _observer_failed("an aio_datadist observer failed on a link event")

    def refused(self, kind: str, transport: str, status: LLMStatusCode) -> None:
        """A request of ``kind`` was refused before it began (counted as a failure with ``status``)."""
        self.end(kind, transport, 0, time.perf_counter(), Outcome.FAILED, status, began=False)

    def snapshot(self, remote_role: LLMRole, link_id: int, transport: str,
                 device_ipc_off: str | None = None, unmapped: tuple[int, int] = (0, 0)) -> LinkStats:
        kinds = {kind: t.frozen() for kind, t in self._kinds.items()}
        bytes_in = sum(s.bytes for kind, s in kinds.items() if kind in _INBOUND)
        bytes_out = sum(s.bytes for kind, s in kinds.items() if kind not in _INBOUND)
        rtt = None if self.rtt_s is None else self.rtt_s * 1000
        return LinkStats(self.remote_cluster_id, remote_role, link_id, transport, time.monotonic() - self.started,
                         rtt, bytes_in, bytes_out, MappingProxyType(kinds), device_ipc_off, self.nixl_vram_off,
                         *unmapped)


def _observer_failed(what: str) -> None:
    """Log an observer's exception as text. Not ``log.exception``: a record holding the traceback keeps the
    transfer's frames, and with them the caller's caches, alive for as long as a handler keeps the record
    (from Python 3.12 the chain reaches the caller's coroutine and the event loop)."""
    log.error("%s:\n%s", what, traceback.format_exc().rstrip())
