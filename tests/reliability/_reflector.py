"""A process at an address an endpoint dials, with no secret, that hands the dial's handshake back.

``python _reflector.py TARGET_HOST TARGET_PORT [reset|hold]`` prints the port it listens on, takes one dial, and
relays (``reset``: it hangs up on a dial it got no HELLO_ACK for with a reset, not a close; ``hold``: it keeps
that dial open until the dialler closes it, 5 s at most): the dial's
HELLO to the target listener (the dialler's own), the
target's HELLO_ACK back to the dial, the dial's AUTH (if it sends one) to the target once the dial
is closed. It prints one JSON object with what it got at each step: ``ack`` (the target proved the
secret over the dial's nonce), ``auth`` (the dial proved it in turn), ``link_ok`` (the target's
status, and whether it sent a link token).
"""

from __future__ import annotations

import contextlib
import json
import socket
import struct
import sys
import time

from aio_datadist import wire
from aio_datadist.wire import Msg


def frame(sock: socket.socket) -> tuple[Msg, bytes] | None:
    """The next whole frame, or None once the other end closed."""
    data = b""
    need = wire.HEADER.size
    while len(data) < need:
        chunk = sock.recv(need - len(data))
        if not chunk:
            return None
        data += chunk
        if len(data) == wire.HEADER.size and need == wire.HEADER.size:
            need += wire.parse_header(data)[2]
    return wire.parse_header(data[:wire.HEADER.size])[0], data


def main() -> None:
    target = (sys.argv[1], int(sys.argv[2]))
    got: dict = {"ack": False, "auth": False, "link_ok": None}
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(30)
        dial, _ = server.accept()
    dial.settimeout(10)
    back = socket.create_connection(target, timeout=10)
    try:
        hello = frame(dial)
        assert hello is not None and hello[0] is Msg.HELLO, hello
        back.sendall(hello[1])
        try:
            ack = frame(back)
        except OSError:
            ack = None
        if ack is None and sys.argv[3:] == ["reset"]:
            dial.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        if ack is None and sys.argv[3:] == ["hold"]:
            dial.settimeout(5)
            with contextlib.suppress(OSError):
                dial.recv(1)  # until the dialler closes it
        if ack is not None and ack[0] is Msg.HELLO_ACK:
            got["ack"] = True
            dial.sendall(ack[1])
            auth = frame(dial)
            if auth is not None and auth[0] is Msg.AUTH:
                got["auth"] = True
                dial.close()  # the dial fails; its nonce is forgotten
                time.sleep(0.3)
                back.sendall(auth[1])
                ok = frame(back)
                if ok is not None and ok[0] is Msg.LINK_OK:
                    fields = wire.fields_of(Msg.LINK_OK, ok[1][wire.HEADER.size:])
                    got["link_ok"] = {"status": fields["status"], "token": fields["link_token"] != bytes(32)}
    finally:
        dial.close()
        back.close()
    print(json.dumps(got), flush=True)


if __name__ == "__main__":
    main()
