"""A linked peer that misuses its control connection (run as a separate program).

It links by hand (``_rawpeer``, written from the protocol's description) and
prints one JSON object with what happened. Modes:

- ``unread HOST PORT CLUSTER_ID REMOTE_ID MIB SECONDS``: links, then sends
  requests the owner refuses (each refusal is a ``RESP`` with a text, larger
  than the request) and never reads a byte of the control connection again;
  stops after MIB MiB of requests, SECONDS seconds, or once the endpoint
  drops the connection. Its receive buffer is kept small, so what the
  endpoint cannot send waits in the endpoint.
- ``pings HOST PORT CLUSTER_ID REMOTE_ID SECONDS``: links, then sends ``PING``
  frames (which need no answer) as fast as the connection takes them for
  SECONDS seconds, reading and answering what the endpoint sends meanwhile
  (its PROBEs), so the link stays up.
- ``rows HOST PORT CLUSTER_ID REMOTE_ID TENSORS ROW_BYTES DATA_TYPE COUNT SECONDS``: links, then sends COUNT
  posted pulls of the blocks cache bound to model 0 (TENSORS tensors, rows of ROW_BYTES bytes) on data
  channel 0, each naming block 0 as many times as the protocol carries (``wire.MAX_ROWS``) and asking for
  600 s, and never reads a data channel; prints a line once they are sent, then answers PROBEs and counts
  the ``RESP`` statuses it gets for SECONDS seconds.
"""

from __future__ import annotations

import json
import select
import socket
import sys
import time

import _rawpeer
from _rawpeer import RawLink

from aio_datadist import wire
from aio_datadist.types import UINT64_MAX
from aio_datadist.wire import Msg, Target


def refused_request(req_id: int) -> bytes:
    """A PULL_REQ for a key nobody bound: refused with a RESP that names the key (about 200 bytes)."""
    return wire.encode(Msg.PULL_REQ, req_id, channel=0, target_kind=Target.CACHE_KEY, cluster_id=0, cache_id=-1,
                       key_req_id=UINT64_MAX - 1, prefix_id=UINT64_MAX, model_id=UINT64_MAX - 1, batch_index=0,
                       layer_first=0, layer_last=-1, tensor_num_per_layer=1, tensor_count=1, data_type=1,
                       offset=0, nbytes=1, flags=0, timeout_ms=1000, rows=())


def small_receive_buffer_dial(address: tuple[str, int]) -> socket.socket:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8192)  # before connect: the window stays small
    sock.settimeout(_rawpeer.TIMEOUT_S)
    sock.connect(address)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def unread(host: str, port: int, cluster_id: int, remote_id: int, mib: float, seconds: float) -> dict:
    _rawpeer.dial = small_receive_buffer_dial
    link = RawLink((host, port), cluster_id, remote_id, None).connect()
    assert link.ctl is not None
    chunk = b"".join(refused_request(2 * i + 1) for i in range(512))  # odd ids: the client's
    link.ctl.settimeout(0.5)
    sent, ended = 0, "budget"
    view, pos = memoryview(chunk), 0
    deadline = time.monotonic() + seconds
    try:
        while sent < mib * (1 << 20):
            if time.monotonic() > deadline:
                ended = "time"
                break
            try:
                n = link.ctl.send(view[pos:])  # frames stay whole across sends: the stream goes on at pos
            except TimeoutError:
                continue  # the endpoint stopped reading us: wait (bounded by the deadline)
            sent += n
            pos = (pos + n) % len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        ended = "closed by the endpoint"
    finally:
        link.close()
    return {"sent": sent, "ended": ended, "request_bytes": len(refused_request(1))}


def pings(host: str, port: int, cluster_id: int, remote_id: int, seconds: float) -> dict:
    link = RawLink((host, port), cluster_id, remote_id, None).connect()
    ctl = link.ctl
    assert ctl is not None
    ctl.setblocking(False)
    chunk = wire.encode(Msg.PING, 0) * 16384  # 320 KiB of PINGs
    view, pos, sent, inbox = memoryview(chunk), 0, 0, bytearray()
    deadline = time.monotonic() + seconds
    try:
        while time.monotonic() < deadline:
            readable, writable, _ = select.select([ctl], [ctl], [], 0.1)
            if readable:
                data = ctl.recv(65536)
                if not data:
                    return {"sent": sent, "ended": "closed by the endpoint"}
                inbox += data
                while len(inbox) >= wire.HEADER.size:  # answer PROBEs between our PINGs, frames kept whole
                    msg, rid, length = wire.parse_header(bytes(inbox[:wire.HEADER.size]))
                    if len(inbox) < wire.HEADER.size + length:
                        break
                    del inbox[:wire.HEADER.size + length]
                    if msg is Msg.PROBE:
                        ctl.setblocking(True)
                        rest = -pos % wire.HEADER.size  # finish the PING cut in the middle first
                        ctl.sendall(view[pos:pos + rest])
                        pos = (pos + rest) % len(chunk)
                        ctl.sendall(wire.encode(Msg.PROBE_ACK, rid))
                        ctl.setblocking(False)
            if writable:
                try:
                    n = ctl.send(view[pos:])
                except BlockingIOError:
                    continue
                sent += n
                pos = (pos + n) % len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        return {"sent": sent, "ended": "closed by the endpoint"}
    finally:
        link.close()
    return {"sent": sent, "ended": "time"}


def repeated_rows(req_id: int, tensors: int, row_bytes: int, data_type: int) -> bytes:
    """A posted PULL_REQ of block 0 of every tensor, repeated ``wire.MAX_ROWS`` times (512 KiB of rows)."""
    return wire.encode(Msg.PULL_REQ, req_id, channel=0, target_kind=Target.BLOCKS_KEY, cluster_id=0, cache_id=0,
                       key_req_id=UINT64_MAX, prefix_id=UINT64_MAX, model_id=0, batch_index=0, layer_first=-1,
                       layer_last=-1, tensor_num_per_layer=1, tensor_count=tensors, data_type=data_type, offset=0,
                       nbytes=row_bytes, flags=wire.ReqFlag.BLOCKS | wire.ReqFlag.POSTED, timeout_ms=600_000,
                       rows=(0,) * wire.MAX_ROWS)


def rows(host: str, port: int, cluster_id: int, remote_id: int, tensors: int, row_bytes: int, data_type: int,
         count: int, seconds: float) -> dict:
    link = RawLink((host, port), cluster_id, remote_id, None).connect()
    ctl = link.ctl
    assert ctl is not None
    statuses: dict[str, int] = {}
    try:
        for i in range(count):
            link.send_raw(repeated_rows(2 * i + 1, tensors, row_bytes, data_type))  # odd ids: the client's
        print("sent", flush=True)
        ctl.settimeout(0.1)
        inbox = bytearray()
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                data = ctl.recv(65536)
            except TimeoutError:
                continue
            if not data:
                return {"statuses": statuses, "ended": "closed by the endpoint"}
            inbox += data
            while len(inbox) >= wire.HEADER.size:
                msg, rid, length = wire.parse_header(bytes(inbox[:wire.HEADER.size]))
                if len(inbox) < wire.HEADER.size + length:
                    break
                body = bytes(inbox[wire.HEADER.size:wire.HEADER.size + length])
                del inbox[:wire.HEADER.size + length]
                if msg is Msg.PROBE:
                    ctl.sendall(wire.encode(Msg.PROBE_ACK, rid))
                elif msg is Msg.RESP:
                    status = str(wire.fields_of(msg, body)["status"])
                    statuses[status] = statuses.get(status, 0) + 1
    except (BrokenPipeError, ConnectionResetError):
        return {"statuses": statuses, "ended": "closed by the endpoint"}
    finally:
        link.close()
    return {"statuses": statuses, "ended": "time"}


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "unread":
        host, port, cluster_id, remote_id, mib, seconds = args
        print(json.dumps(unread(host, int(port), int(cluster_id), int(remote_id), float(mib), float(seconds))))
    elif mode == "pings":
        host, port, cluster_id, remote_id, seconds = args
        print(json.dumps(pings(host, int(port), int(cluster_id), int(remote_id), float(seconds))))
    elif mode == "rows":
        host, port, *numbers = args
        cluster_id, remote_id, tensors, row_bytes, data_type, count = (int(a) for a in numbers[:6])
        print(json.dumps(rows(host, int(port), cluster_id, remote_id, tensors, row_bytes, data_type, count,
                              float(numbers[6]))))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
