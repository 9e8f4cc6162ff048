"""The device backend base: one device, the library's copy stream, and its StreamNotifier.

``aio.DeviceType=cuda`` / ``npu`` opens a :class:`DeviceBackend` for the
configured device when ``LLMDataDist.init`` runs (through
:func:`aio_datadist.devices.open_backend`). Everything that differs between
CUDA and Ascend lives in the two small subclasses (``devices/cuda.py``,
``devices/npu.py``): how a stream is made and named, which notifier backend
the core uses, and what can page-lock host memory. Everything else
(allocation, copies, staging) is shared.

Device work never blocks a thread: copies are enqueued on the copy stream,
then the core's :class:`~aio_datadist._core.StreamNotifier` posts the
operation's completion record once the stream gets there (``devices/streams.py``).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from aio_datadist import _core
from aio_datadist._checks import param_invalid
from aio_datadist.devices.host import round_up
from aio_datadist.devices.ipc import IDENTITY_BYTES, IpcUnavailable, PeerMapping, SharedAllocation
from aio_datadist.devices.streams import open_notifier
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import CacheDesc

__all__ = ["DEVICE_ALIGN", "DeviceBackend", "carve", "feature_not_enabled", "shared_bytes"]

log = logging.getLogger(__name__)

# Device tensors of a cache start on this boundary (the copy kernel's widest access is 16 bytes;
# 256 keeps every tensor on its own cache lines and matches the CUDA allocator's granularity).
DEVICE_ALIGN = 256


def shared_bytes(desc: CacheDesc) -> int:
    """The bytes a cache of ``desc`` takes in one allocation (tensors ``DEVICE_ALIGN`` apart)."""
    return round_up(desc.size, DEVICE_ALIGN) * desc.num_tensors


def carve(desc: CacheDesc, buffer: torch.Tensor, start: int = 0) -> list[torch.Tensor]:
    """The tensors of ``desc`` in the uint8 ``buffer``, from byte ``start``, ``DEVICE_ALIGN`` apart."""
    stride = round_up(desc.size, DEVICE_ALIGN)
    dtype = desc.data_type.torch_dtype
    return [buffer[start + i * stride:start + i * stride + desc.size].view(dtype).view(desc.shape)
            for i in range(desc.num_tensors)]


def feature_not_enabled(text: str) -> LLMException:
    return LLMException(text, status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED)


class DeviceBackend:
    """The device side of one initialised LLMDataDist (see the module docstring).

    Subclasses set :attr:`kind` and implement the stream hooks; they are
    built only through :func:`aio_datadist.devices.open_backend`.
    """

    kind = ""
    # Whether small host tables can go through page-locked memory (an asynchronous upload).
    pins_tables = False

    def __init__(self, device: torch.device, queue: _core.CompletionQueue) -> None:
        self.device = device
        self.notifier = open_notifier(queue, self.kind, device.index or 0)
        try:
            self.stream = self._new_stream()
            self.stream_handle = self._handle(self.stream)
        except BaseException:
            self.notifier.close()
            raise
        self._tables: dict[tuple[int, ...], torch.Tensor] = {}
        self._alignments: dict[tuple[int, ...], int] = {}
        # What failed submissions left on the copy stream may still touch (see enqueue_and_notify).
        self._held: list[Any] = []
        self.closed = False

    # -- what differs between CUDA and Ascend -------------------------------------------

    @classmethod
    def open(cls, device_id: int | None, queue: _core.CompletionQueue) -> DeviceBackend:
        """Check that this kind's driver, torch support and device ``device_id`` exist, then open it."""
        raise NotImplementedError

    def _new_stream(self) -> Any:
        raise NotImplementedError

    def _handle(self, stream: Any) -> int:
        raise NotImplementedError

    def current_stream(self) -> Any:
        """The caller's current stream on this device (torch's notion)."""
        raise NotImplementedError

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        raise NotImplementedError

    def pin_host(self, region: Any) -> Any:
        """Page-lock a host region for device copies; returns a holder (None if unsupported)."""
        return None

    @property
    def batch_copies(self) -> bool:
        """Whether one driver call can run a whole list of host<->device copies."""
        return False

    def memcpy_batch(self, dsts: Any, srcs: Any, sizes: Any) -> int:
        raise NotImplementedError

    # -- shared --------------------------------------------------------------------------

    def allocation_bytes(self, desc: CacheDesc) -> int:
        """The bytes :meth:`allocate_shared` maps for a cache of ``desc`` (what the registered-memory cap counts)."""
        return shared_bytes(desc) + DEVICE_ALIGN

    def allocate(self, desc: CacheDesc) -> list[torch.Tensor]:
        """``desc.num_tensors`` tensors of ``desc.shape`` in one device allocation.

        One allocation keeps the tensors' base table regular.
        """
        buffer = torch.empty(shared_bytes(desc) + DEVICE_ALIGN, dtype=torch.uint8, device=self.device)
        return carve(desc, buffer, (-buffer.data_ptr()) % DEVICE_ALIGN)

    # -- same-host exports (devices/ipc.py); backends that can share memory override these --

    def allocate_shared(self, desc: CacheDesc) -> tuple[list[torch.Tensor], SharedAllocation | None]:
        """Like :meth:`allocate`, in one allocation a same-host peer can map (None: not exportable here)."""
        return self.allocate(desc), None

    def ipc_identity(self) -> bytes:
        """:data:`~aio_datadist.devices.ipc.IDENTITY_BYTES` naming this device to same-host peers."""
        return bytes(IDENTITY_BYTES)

    def ipc_unavailable(self) -> str | None:
        """Why this backend neither exports nor imports device caches, or None when it does."""
        return f"{self.kind} device caches have no same-host export"

    #: ``aio.DeviceIpc`` (set by the runtime): ``auto`` exports our device caches only where the peer cannot
    #: map them writable, ``on`` also elsewhere, ``off`` never.
    ipc_policy = "auto"
    #: Whether a peer importing our export can only ever map it read-only (the kernel or driver enforces it).
    ipc_read_only_enforced = False

    def ipc_export_refused(self) -> str | None:
        """Why ``aio.DeviceIpc`` keeps our device caches from being exported (None: it does not)."""
        if self.ipc_policy == "off":
            return "option 'aio.DeviceIpc' is 'off'"
        if self.ipc_policy == "auto" and not self.ipc_read_only_enforced:
            return (f"option 'aio.DeviceIpc' is 'auto', and a peer could map {self.kind} exports writable (the "
                    "read-only import is the importer's choice, not enforced); 'on' exports them anyway")
        return None

    def ipc_import(self, kind: str, identity: bytes, fd: int, nbytes: int, *, whole: bool = False) -> PeerMapping:
        """Map a same-host peer's export (``kind`` backend, on device ``identity``) read-only.

        ``whole``: the caller still holds an earlier import of this same file by this backend, so a backend that
        walks the pages it maps (the host backend's hole check, ``check_sealed``) may skip that walk; others
        ignore it.

        :raises IpcUnavailable: this process cannot map it (the reason says why).
        :raises ExportInvalid: ``fd`` does not hold what the peer declared.
        """
        raise IpcUnavailable(self.ipc_unavailable() or "no import")

    def fence(self, token: int) -> None:
        """Post ``token``'s record once the copy stream is past everything on the caller's current stream
        (what a peer reading our memory waits for)."""
        self.enqueue_and_notify(token, lambda: None, 0, None, "stream fence")

    def check_tensor(self, arg: str, index: int, tensor: torch.Tensor) -> None:
        if tensor.device != self.device:
            raise param_invalid(arg, f"tensor {index} is on {tensor.device}, device caches live on {self.device}")

    def table(self, values: Sequence[int], *, cache: bool = False) -> torch.Tensor:
        """An int64 device tensor of ``values``, uploaded on the copy stream.

        ``cache=True`` keeps it for reuse (the base tables of a cache's tensors). An int64 ``array.array``
        is copied in as it is (a thousand rows: 3 us, where ``torch.tensor`` of a tuple takes 60).
        """
        key = tuple(values) if cache else ()
        if cache:
            found = self._tables.get(key)
            if found is not None:
                return found
        host = torch.empty(len(values), dtype=torch.int64, pin_memory=self.pins_tables)
        host.numpy()[:] = values  # an int64 array.array goes in through the buffer protocol, as one copy
        with self.stream_context(self.stream):
            out = host.to(self.device, non_blocking=True)
        if cache:
            if len(self._tables) > 4096:
                self._tables.clear()
            self._tables[key] = out
        return out

    def alignment(self, bases: tuple[int, ...]) -> int:
        """The bits every address in ``bases`` shares (their OR), cached like the base tables."""
        found = self._alignments.get(bases)
        if found is None:
            found = 0
            for b in bases:
                found |= b
            if len(self._alignments) > 4096:
                self._alignments.clear()
            self._alignments[bases] = found
        return found

    @contextlib.contextmanager
    def on_copy_stream(self) -> Iterator[None]:
        """Enqueue on the copy stream, after everything already on the caller's current stream."""
        self.stream.wait_stream(self.current_stream())
        with self.stream_context(self.stream):
            yield

    def notify(self, token: int, aux: int) -> None:
        """Post ``token``'s record once the copy stream has done all that is enqueued so far."""
        try:
            self.notifier.notify(token, self.stream_handle, aux)
        except OSError as exc:
            if exc.errno == errno.EBUSY:
                raise param_invalid("stream", str(exc.strerror)) from exc
            raise LLMException(f"device completion could not be enqueued: {exc.strerror}",
                               status_code=LLMStatusCode.LLM_FAILED) from exc

    def enqueue_and_notify(self, token: int, enqueue: Callable[[], Any], aux: int, keep: Any, what: str) -> None:
        """Run ``enqueue()`` on the copy stream, then :meth:`notify` ``token``.

        If either fails, some copies may already be on the stream with no
        record to say when they are done: ``keep`` (every buffer and
        keepalive they touch) is held until the stream has drained (at
        :meth:`close` at the latest), never released with the exception.
        """
        if self._held:
            self._past_failures()
        try:
            with self.on_copy_stream():
                enqueue()
        except BaseException as exc:
            if not isinstance(exc, Exception):  # an interrupt goes on at once (what it touches is held)
                self._failed_submission(keep, exc)
                raise
            failure = exc if isinstance(exc, LLMException) else LLMException(
                f"{what} could not be enqueued: {exc}", status_code=LLMStatusCode.LLM_FAILED)
            self._failed_submission(keep, failure)
            if failure is exc:
                raise
            raise failure from exc
        try:
            self.notify(token, aux)
        except BaseException as exc:
            self._failed_submission(keep, exc)
            raise

    def _failed_submission(self, keep: Any, failure: BaseException) -> None:
        """A submission failed after some of its copies may be on the stream (``keep``: what they touch, None
        for a submission that queued none, a fence): hold that until the stream drained, and mark ``failure``
        with ``drained``, so that the completions let it reach the caller only once they are done
        (``Completions.start``, without blocking the loop): the caller's call returns with it, and no byte
        of it may land later."""
        if keep is None:
            return
        if self._held:
            self._past_failures()
        self._held.append(keep)
        if isinstance(failure, Exception):  # an interrupt (KeyboardInterrupt, SystemExit) goes on at once
            with contextlib.suppress(AttributeError, TypeError):  # an exception type that takes no attribute
                failure.drained = self._past_failures  # type: ignore[attr-defined]

    def _past_failures(self) -> bool:
        """Whether the copy stream has drained; if so, it is past every failed submission's copies (it runs
        in order), and their memory goes now: a staged chunk's buffer among it, which its pool counts until
        it is gone (held to :meth:`close`, a few refused copies took an endpoint's staging for good)."""
        if not self._stream_drained():
            return False
        self._held.clear()
        return True

    @property
    def held(self) -> int:
        """Failed submissions whose memory is kept until the copy stream drains."""
        return len(self._held)

    def notify_on(self, token: int, stream: Any = None, aux: int = 0) -> None:
        """Post ``token``'s record once ``stream`` (default: the caller's current one) is past its work.

        What a device-event layer synchronizer needs: ``record(i, stream)``
        becomes ``notify_on(token_of_layer_i, stream)``.
        """
        try:
            handle = self._handle(self.current_stream() if stream is None else stream)
        except (AttributeError, TypeError) as exc:
            raise param_invalid("stream", f"expected a {self.kind} stream, got {type(stream).__name__}") from exc
        try:
            self.notifier.notify(token, handle, aux)
        except OSError as exc:
            if exc.errno == errno.EBUSY:  # the stream is being captured into a CUDA graph
                raise param_invalid("stream", str(exc.strerror)) from exc
            raise LLMException(f"device completion could not be enqueued: {exc.strerror}",
                               status_code=LLMStatusCode.LLM_FAILED) from exc

    def cancel(self, token: int) -> bool:
        return self.notifier.cancel(token)

    def busy(self) -> bool:
        """Whether work enqueued on the device may still run: notifications not reached yet, or failed
        submissions whose memory waits for the copy stream to drain."""
        return not self.closed and (self.notifier.pending() > 0 or (bool(self._held) and not self._past_failures()))

    def _stream_drained(self) -> bool:
        """Whether the copy stream has done all its work (a device stream's ``query``; the host backend's
        stream counts what it has queued)."""
        stream = self.stream
        query = getattr(stream, "query", None)
        if callable(query):
            return bool(query())
        pending = getattr(stream, "pending", None)
        return not callable(pending) or pending() == 0

    def close(self, timeout_s: float = 30.0) -> bool:
        """Wait (up to ``timeout_s``, blocking) for the device to reach every pending notification, then
        release. Returns whether the device got there; if not, whatever its work touches is kept (the
        failed submissions' memory here; the caller keeps the caches), never freed under it. Idempotent."""
        if self.closed:
            return True
        self.closed = True
        self._tables.clear()
        deadline = time.monotonic() + timeout_s
        if not self.notifier.close(timeout_s):
            return False  # the device did not get there: _held stays (a leak, not memory freed under work)
        if self._held:
            # A stuck stream behind a failed submission is stuck too: its memory stays (with this backend,
            # which the runtime keeps), and close does not block past its bound.
            if not self.wait_copies(max(0.0, deadline - time.monotonic())):
                return False
            self._held.clear()
        return True

    def wait_copies(self, timeout_s: float) -> bool:
        """Block (at most ``timeout_s``) until the copy stream has done everything enqueued so far; whether it
        has. For a call that must return only once no copy touches memory its caller takes back (cutting what
        serves a peer against a cache being unregistered): the stream's whole queue, a few chunks at most."""
        stream = self.stream
        if not callable(getattr(stream, "query", None)):
            return bool(stream.synchronize(timeout_s))  # the host stream waits natively, with a deadline
        deadline = time.monotonic() + timeout_s
        pause = 20e-6
        while not stream.query():  # a device stream's synchronize has no deadline: ask until it says done
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, 1e-3)
        return True

