"""A linked peer that misuses its control connection (run as a separate program).

It links by hand (``_rawpeer``, written from the protocol's description) and
prints one JSON object with what happened. Modes:

- ``pings HOST PORT CLUSTER_ID REMOTE_ID SECONDS``: links, then sends ``PING``
  frames (which need no answer) as fast as the connection takes them for
  SECONDS seconds, reading and answering what the endpoint sends meanwhile
  (its PROBEs), so the link stays up.
"""

from __future__ import annotations

import json
import select
import sys
import time

from _rawpeer import RawLink

from aio_datadist import wire
from aio_datadist.wire import Msg


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


def main() -> None:
    mode, *args = sys.argv[1:]
    if mode == "pings":
        host, port, cluster_id, remote_id, seconds = args
        print(json.dumps(pings(host, int(port), int(cluster_id), int(remote_id), float(seconds))))
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
