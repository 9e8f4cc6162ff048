# Type stubs for the native core (aio_datadist/_core.pyx). Hand-written.
#
# Records are ``(token, status, aux)``: status 0 (OK) or a negative errno
# (CANCELLED = -ECANCELED, CONNECTION_LOST = -ECONNRESET, ...); aux is the
# number of bytes moved. Nothing here knows about asyncio.

from array import array
from typing_extensions import Buffer

OK: int
CANCELLED: int
CONNECTION_LOST: int

# How many native objects of each kind are open (for leak checks).
def live_objects() -> dict[str, int]: ...

class CompletionQueue:
    # An eventfd plus a thread-safe list of records; drain() never blocks.
    def __init__(self) -> None: ...
    # The eventfd that becomes readable when records are waiting.
    # Raises ValueError once closed.
    def fileno(self) -> int: ...
    @property
    def closed(self) -> bool: ...
    # Push a record from Python. Raises ValueError once closed.
    def post(self, token: int, status: int = 0, aux: int = 0) -> None: ...
    # Every waiting record, oldest first. Raises ValueError once closed.
    def drain(self) -> list[tuple[int, int, int]]: ...
    # Close the eventfd; later records are dropped. Idempotent.
    def close(self) -> None: ...

class HostCopyEngine:
    # Worker threads running batched memcpy lists without the GIL; one
    # record per job. threads in [1, 64] (ValueError otherwise).
    def __init__(self, queue: CompletionQueue, threads: int = 2, split_bytes: int = ...) -> None: ...
    @property
    def threads(self) -> int: ...
    # Queue ``[dst0, src0, n0, dst1, src1, n1, ...]`` (uint64 buffer); returns
    # the bytes it will move. The caller keeps every range valid until the
    # job's record arrives. ValueError for a bad length, a token in use, or a
    # closed engine.
    def submit(self, token: int, triples: Buffer) -> int: ...
    # Skip chunks not started, stop a running one at its next segment; the
    # record then carries CANCELLED. Idempotent; True if the job was pending.
    def cancel(self, token: int) -> bool: ...
    # Jobs whose record has not been posted yet.
    def pending(self) -> int: ...
    # Cancel every job (each still posts its record) and join the threads.
    def close(self) -> None: ...

class SocketEngine:
    # One epoll thread moving scatter/gather lists over non-blocking sockets.
    # Jobs on one fd and direction run in order; detach an fd before closing it.
    def __init__(self, queue: CompletionQueue) -> None: ...
    # Queue a writev of ``[addr0, n0, addr1, n1, ...]``; returns its byte count.
    def submit_send(self, token: int, fd: int, pairs: Buffer) -> int: ...
    # Queue a readv into ``[addr0, n0, ...]``; returns its byte count.
    def submit_recv(self, token: int, fd: int, pairs: Buffer) -> int: ...
    # Cancel a job (record: CANCELLED). Idempotent; True if it was pending.
    # A job stopped part-way leaves its socket's byte stream out of step.
    def cancel(self, token: int) -> bool: ...
    # Cancel every job on ``fd`` and forget the fd; returns once applied.
    def detach(self, fd: int) -> None: ...
    # Jobs whose record has not been posted yet.
    def pending(self) -> int: ...
    # Cancel every job (each still posts its record) and stop the thread.
    def close(self) -> None: ...

# Coalesced ``[addr, nbytes, ...]`` (array of "Q") for every (tensor, index):
# ``bases[t] + indices[i] * stride + offset``, tensor-major. Callers validate.
def segments(bases: Buffer, indices: Buffer, stride: int, offset: int, nbytes: int) -> array[int]: ...

# Coalesced ``[dst, src, nbytes, ...]`` pairing tensor t / index i of both
# layouts. ValueError when the tensor or index counts differ.
def copy_segments(dst_bases: Buffer, dst_indices: Buffer, dst_stride: int, dst_offset: int,
                  src_bases: Buffer, src_indices: Buffer, src_stride: int, src_offset: int,
                  nbytes: int) -> array[int]: ...


def zip_segments(dst: Buffer, src: Buffer) -> array[int]:
    """Pair two ``[addr, nbytes, ...]`` streams of equal total into copy triples."""
    ...
