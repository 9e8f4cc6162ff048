"""Baselines the library's benchmarks are compared against, measured in the same run.

Each baseline is what moving the same bytes costs without aio_datadist:

- :func:`raw_memcpy`: one thread copying between two page-aligned arrays.
- :func:`raw_tcp_throughput` / :func:`raw_tcp_rtt` (or one :class:`TcpReplyPeer`
  for many sizes): a peer process on 127.0.0.1 ``sendall``s one contiguous
  buffer, this process ``recv_into``s it into a preallocated buffer.
- :func:`gloo_send_recv` / :func:`gloo_send_recv_sizes`: what a user would write
  with torch.distributed: gather the blocks with ``index_select``, ``dist.send``,
  ``dist.recv``, scatter with ``index_copy_``.

Everything runs on 127.0.0.1 with bounded loops; every process and socket is
closed before a function returns.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import struct
from typing import Any, Mapping

import numpy as np

from benchmarks.harness import (
    KvGeometry,
    Measurement,
    Peer,
    PeerError,
    aligned_empty,
    cache_blocks_for,
    free_port,
    random_blocks,
    stamp_blocks,
    time_sync,
    verify_blocks,
)

LOCALHOST = "127.0.0.1"

#: SO_SNDBUF = SO_RCVBUF request (the kernel doubles it) that made one loopback
#: connection faster than the autotuned defaults on the 2-core machines: 1.6-1.9x
#: for 128 MiB-1 GiB with the machine otherwise idle, 1.1-1.3x while other
#: processes kept a core busy. Likely cause: the in-flight data then fits in the
#: 1 MiB L2. Only when set on both ends; 128 KiB and 512 KiB were not faster.
TCP_TUNED_SOCK_BUF = 256 * 1024

# A request: the number of bytes to reply with (0 = stop), padded to 32 bytes.
_REQUEST = struct.Struct("<Q24x")
_PATTERN_PERIOD = 251  # prime, so the pattern does not line up with block sizes


# --------------------------------------------------------------------------- memcpy


def raw_memcpy_sizes(repeats_by_nbytes: Mapping[int, int], *, warmup: int = 1) -> dict[int, Measurement]:
    """One thread copying between two page-aligned uint8 arrays (``np.copyto``), per size.

    One pair of arrays of the largest size serves every size (the first
    ``nbytes`` of each); both are touched before timing, so no sample pays for
    page faults. Sizes that fit in the CPU caches are copied from cache.

    Args:
        repeats_by_nbytes: timed repeats per copy size in bytes, in run order.
    """
    if not repeats_by_nbytes:
        raise ValueError("repeats_by_nbytes must not be empty")
    largest = max(repeats_by_nbytes)
    src = aligned_empty(largest)
    dst = aligned_empty(largest)
    src.fill(1)
    dst.fill(0)
    out = {}
    for nbytes, repeats in repeats_by_nbytes.items():
        s, d = src[:nbytes], dst[:nbytes]
        samples = time_sync(lambda: np.copyto(d, s), repeats=repeats, warmup=warmup)
        out[nbytes] = Measurement("memcpy", nbytes, tuple(samples))
    return out


def raw_memcpy(nbytes: int, repeats: int, *, warmup: int = 1) -> Measurement:
    """One thread copying ``nbytes`` between two page-aligned arrays; see :func:`raw_memcpy_sizes`."""
    return raw_memcpy_sizes({nbytes: repeats}, warmup=warmup)[nbytes]


# --------------------------------------------------------------------------- tcp


def _fill_pattern(buf: np.ndarray) -> None:
    period = np.arange(_PATTERN_PERIOD, dtype=np.uint8)
    chunk = np.tile(period, 4096)  # about 1 MiB, a whole number of periods
    for start in range(0, len(buf), len(chunk)):
        part = buf[start : start + len(chunk)]
        part[:] = chunk[: len(part)]


def _pattern_ok(buf: np.ndarray, nbytes: int) -> bool:
    """Spot-check the head and tail of a received pattern."""
    for start in (0, max(0, nbytes - 65536)):
        stop = min(nbytes, start + 65536)
        want = (np.arange(start, stop, dtype=np.int64) % _PATTERN_PERIOD).astype(np.uint8)
        if not np.array_equal(buf[start:stop], want):
            return False
    return True


def _configure(sock: socket.socket, sock_buf: int | None, io_timeout: float) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if sock_buf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sock_buf)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sock_buf)
    # Kernel-side timeouts keep the socket blocking: Python's settimeout would
    # add a poll() before every recv and distort the baseline.
    sec = int(io_timeout)
    tv = struct.pack("ll", sec, int((io_timeout - sec) * 1e6))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise ConnectionError(f"peer closed after {got} of {n} bytes")
        got += k


def _tcp_reply_server(conn: Any, max_bytes: int, sock_buf: int | None, io_timeout: float) -> dict[str, int]:
    payload = aligned_empty(max_bytes)
    _fill_pattern(payload)
    view = memoryview(payload)
    request = bytearray(_REQUEST.size)
    served = 0
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        if sock_buf is not None:  # before listen, so the window scale is negotiated for it
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, sock_buf)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, sock_buf)
        listener.bind((LOCALHOST, 0))
        listener.listen(1)
        listener.settimeout(io_timeout)
        conn.send(listener.getsockname()[1])
        sock, _ = listener.accept()
    with sock:
        sock.settimeout(None)
        _configure(sock, sock_buf, io_timeout)
        while True:
            try:
                _recv_exactly(sock, memoryview(request))
            except ConnectionError:
                break
            (nbytes,) = _REQUEST.unpack(request)
            if nbytes == 0:
                break
            if nbytes > max_bytes:
                raise ValueError(f"request of {nbytes} bytes exceeds max_bytes={max_bytes}")
            sock.sendall(view[:nbytes])
            served += 1
        return {
            "served": served,
            "sndbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            "rcvbuf": sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        }


class TcpReplyPeer:
    """A peer process on 127.0.0.1 answering each 32-byte request with ``n`` bytes.

    The peer ``sendall``s the first ``n`` bytes of one contiguous, pattern-filled
    buffer; this side ``recv_into``s them into a preallocated page-aligned
    buffer. One connection serves every request; the next request is sent only
    after the whole reply arrived, so measurements never overlap.

    Args:
        max_bytes: largest reply that will be requested.
        sock_buf: SO_SNDBUF and SO_RCVBUF for both ends, set before connecting;
            ``None`` keeps the OS defaults (autotuning).
        timeout: lifetime of the peer process.
        io_timeout: bound on every single socket wait, on both ends.
    """

    def __init__(
        self, max_bytes: int, *, sock_buf: int | None = None, timeout: float = 600.0, io_timeout: float = 60.0
    ) -> None:
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes!r}")
        self.max_bytes = max_bytes
        self.sock_buf = sock_buf
        self.timeout = timeout
        self.io_timeout = min(io_timeout, timeout)
        self._peer: Peer | None = None
        self._sock: socket.socket | None = None
        self._buf: np.ndarray | None = None
        self.server_info: dict[str, int] = {}

    def __enter__(self) -> "TcpReplyPeer":
        self._peer = Peer(
            _tcp_reply_server, self.max_bytes, self.sock_buf, self.io_timeout, timeout=self.timeout, name="tcp-reply"
        )
        try:
            self._peer.start()
            port = self._peer.recv(timeout=60.0)
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            self._sock = sock
            _configure(sock, self.sock_buf, self.io_timeout)
            sock.connect((LOCALHOST, port))
            self._buf = aligned_empty(self.max_bytes)
            self._buf.fill(0)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def socket_buffers(self) -> tuple[int, int]:
        """(SO_SNDBUF, SO_RCVBUF) of this side's socket as the kernel reports them now."""
        sock = self._require_sock()
        return (
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF),
            sock.getsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF),
        )

    @property
    def pid(self) -> int:
        """The peer process's id (0 before it started)."""
        return 0 if self._peer is None else self._peer.pid or 0

    def _require_sock(self) -> socket.socket:
        if self._sock is None:
            raise RuntimeError("TcpReplyPeer is not open; use it as a context manager")
        return self._sock

    def request(self, nbytes: int) -> None:
        """Ask for ``nbytes`` and receive all of them."""
        if not 1 <= nbytes <= self.max_bytes:
            raise ValueError(f"nbytes must be within [1, max_bytes={self.max_bytes}], got {nbytes!r}")
        sock = self._require_sock()
        assert self._buf is not None
        sock.sendall(_REQUEST.pack(nbytes))
        _recv_exactly(sock, memoryview(self._buf)[:nbytes])

    def _measure(self, name: str, nbytes: int, repeats: int, warmup: int) -> Measurement:
        samples = time_sync(lambda: self.request(nbytes), repeats=repeats, warmup=warmup)
        assert self._buf is not None
        if not _pattern_ok(self._buf, nbytes):
            raise RuntimeError(f"{name}: received bytes do not match what the peer sent")
        return Measurement(name, nbytes, tuple(samples))

    def throughput(self, nbytes: int, repeats: int, *, warmup: int = 1) -> Measurement:
        """Requests of ``nbytes``, each timed from sending the request to receiving the last byte."""
        return self._measure("raw_tcp", nbytes, repeats, warmup)

    def rtt(self, nbytes: int, repeats: int, *, warmup: int = 20) -> Measurement:
        """Round trips: a 32-byte request answered with ``nbytes``."""
        return self._measure("raw_tcp_rtt", nbytes, repeats, warmup)

    def close(self) -> None:
        """Stop the peer, close the socket, reap the process. Idempotent."""
        sock, self._sock = self._sock, None
        peer, self._peer = self._peer, None
        if sock is not None:
            try:
                sock.sendall(_REQUEST.pack(0))
            except OSError:
                pass
            sock.close()
        if peer is not None:
            try:
                if sock is not None:
                    self.server_info = peer.result(timeout=10.0)
            except PeerError:
                pass
            finally:
                peer.close()
        self._buf = None


def raw_tcp_throughput(nbytes: int, repeats: int, *, warmup: int = 1, sock_buf: int | None = None) -> Measurement:
    """GB/s of one loopback TCP connection moving ``nbytes`` contiguous bytes.

    A peer process ``sendall``s, this process ``recv_into``s a preallocated
    buffer; ``Measurement.gbps`` is at the median of ``repeats`` samples.
    ``sock_buf`` sets SO_SNDBUF/SO_RCVBUF on both ends (``None``: OS default).
    """
    with TcpReplyPeer(nbytes, sock_buf=sock_buf) as peer:
        return peer.throughput(nbytes, repeats, warmup=warmup)


def raw_tcp_rtt(nbytes: int, repeats: int, *, warmup: int = 20, sock_buf: int | None = None) -> Measurement:
    """Loopback round trips: a 32-byte request, a reply of ``nbytes``.

    ``Measurement.p50_us`` / ``p99_us`` give the latency.
    """
    with TcpReplyPeer(nbytes, sock_buf=sock_buf) as peer:
        return peer.rtt(nbytes, repeats, warmup=warmup)


def tcp_default_buffers() -> dict[str, str]:
    """The kernel's TCP buffer settings (autotuning ranges and caps)."""
    out = {}
    for name in ("ipv4/tcp_rmem", "ipv4/tcp_wmem", "core/rmem_max", "core/wmem_max"):
        try:
            with open(f"/proc/sys/net/{name}") as f:
                out[name.split("/")[1]] = " ".join(f.read().split())
        except OSError:
            out[name.split("/")[1]] = "?"
    return out


# --------------------------------------------------------------------------- gloo

_SENDER, _RECEIVER = 0, 1


def _gloo_rank(
    conn: Any,
    rank: int,
    port: int,
    geometry: KvGeometry,
    repeats_by_count: dict[int, int],
    warmup: int,
    cache_blocks: int,
    seed: int,
    timeout: float,
    torch_threads: int | None,
) -> dict[str, Any]:
    if os.path.exists("/sys/class/net/lo"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    import torch
    import torch.distributed as dist

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)

    dist.init_process_group(
        "gloo",
        init_method=f"tcp://{LOCALHOST}:{port}",
        rank=rank,
        world_size=2,
        timeout=datetime.timedelta(seconds=timeout),
    )
    try:
        # Untouched until used: the warmup transfer faults in the blocks the timed ones use.
        tensors = geometry.make_tensors(cache_blocks, zeroed=False)
        if rank == _SENDER:
            stamp_blocks(tensors)
        go = torch.zeros(1, dtype=torch.int64)
        block_elems = math.prod(geometry.block_shape)
        staging_all = torch.empty(
            geometry.num_tensors * max(repeats_by_count) * block_elems, dtype=geometry.torch_dtype
        )
        samples: dict[int, list[float]] = {}
        verified: dict[int, bool] = {}
        for count, repeats in repeats_by_count.items():
            src_blocks = random_blocks(cache_blocks, count, seed)
            dst_blocks = random_blocks(cache_blocks, count, seed + 1)
            staging = staging_all[: geometry.num_tensors * count * block_elems].view(
                geometry.num_tensors, count, *geometry.block_shape
            )
            if rank == _SENDER:
                idx = torch.tensor(src_blocks, dtype=torch.int64)
                for _ in range(warmup + repeats):
                    dist.recv(go, src=_RECEIVER)
                    for i, t in enumerate(tensors):
                        torch.index_select(t, 0, idx, out=staging[i])
                    dist.send(staging, dst=_RECEIVER)
            else:
                idx = torch.tensor(dst_blocks, dtype=torch.int64)

                def one_transfer() -> None:
                    dist.send(go, dst=_SENDER)
                    dist.recv(staging, src=_SENDER)
                    for i, t in enumerate(tensors):
                        t.index_copy_(0, idx, staging[i])

                samples[count] = time_sync(one_transfer, repeats=repeats, warmup=warmup)
                verified[count] = verify_blocks(tensors, dst_blocks, src_blocks)
        dist.barrier()
        return {"samples": samples, "verified": verified, "torch_threads": torch.get_num_threads()}
    finally:
        dist.destroy_process_group()


def gloo_footprint(max_count: int, geometry: KvGeometry | None = None, cache_blocks: int | None = None) -> int:
    """Bytes both gloo ranks together hold: two caches and two staging buffers."""
    geometry = geometry or KvGeometry()
    cache_blocks = cache_blocks or cache_blocks_for(max_count)
    return 2 * geometry.request_bytes(cache_blocks + max_count)


def gloo_send_recv_sizes(
    repeats_by_count: Mapping[int, int],
    *,
    warmup: int = 1,
    geometry: KvGeometry | None = None,
    cache_blocks: int | None = None,
    seed: int = 0,
    timeout: float = 600.0,
    torch_threads: int | None = 1,
) -> tuple[dict[int, Measurement], dict[str, Any]]:
    """The gloo baseline for several request sizes in one two-process group.

    Rank 0 (sender) and rank 1 (receiver) run in spawned processes on
    127.0.0.1. Per transfer the receiver sends a one-element "go", the sender
    gathers the random source blocks of all tensors into one contiguous buffer
    (``index_select`` per tensor), ``dist.send``s it, the receiver ``dist.recv``s
    and scatters it (``index_copy_`` per tensor). A sample runs from the "go"
    to the end of the scatter, as the receiver sees it. After timing, the
    receiver checks that every destination block holds its source block.

    Args:
        repeats_by_count: timed repeats per request size (blocks), in run order.
        warmup: untimed transfers per size first (>= 1: the caches and the
            staging buffer are left untouched until then).
        cache_blocks: blocks per tensor in each cache; default
            ``cache_blocks_for(max(repeats_by_count))``.
        torch_threads: ``torch.set_num_threads`` in each rank. One thread per
            rank by default: with torch's default (one per core) two ranks on
            a 2-core machine oversubscribe it, and transfers of a few MiB then
            take up to 100x longer now and then. ``None`` keeps torch's default.

    Returns:
        ({count: Measurement of the request bytes}, {"torch_threads": ...}).
    Raises:
        PeerError: a rank failed or timed out; RuntimeError: blocks arrived wrong.
    """
    geometry = geometry or KvGeometry()
    counts = dict(repeats_by_count)
    if not counts:
        raise ValueError("repeats_by_count must not be empty")
    if warmup < 1:
        raise ValueError(f"warmup must be >= 1 (it pages the blocks in), got {warmup!r}")
    cache_blocks = cache_blocks or cache_blocks_for(max(counts))
    port = free_port()
    args = (port, geometry, counts, warmup, cache_blocks, seed, timeout, torch_threads)
    with Peer(_gloo_rank, _SENDER, *args, timeout=timeout, name="gloo-sender") as sender, Peer(
        _gloo_rank, _RECEIVER, *args, timeout=timeout, name="gloo-receiver"
    ) as receiver:
        out = receiver.result()
        sender.result()
    bad = [c for c, ok in out["verified"].items() if not ok]
    if bad:
        raise RuntimeError(f"gloo baseline moved wrong blocks for request sizes {bad}")
    results = {
        c: Measurement("gloo send/recv", geometry.request_bytes(c), tuple(s)) for c, s in out["samples"].items()
    }
    return results, {"torch_threads": out["torch_threads"], "cache_blocks": cache_blocks}


def gloo_send_recv(
    num_blocks_request: int,
    repeats: int,
    *,
    warmup: int = 1,
    geometry: KvGeometry | None = None,
    seed: int = 0,
    torch_threads: int | None = 1,
) -> Measurement:
    """The gloo baseline (see :func:`gloo_send_recv_sizes`) for one request size."""
    results, _ = gloo_send_recv_sizes(
        {num_blocks_request: repeats}, warmup=warmup, geometry=geometry, seed=seed, torch_threads=torch_threads
    )
    return results[num_blocks_request]

