"""A relay on the path of a link, with no secret, that reflects the dialler's data-channel attach records.

``python _attach_reflector.py TARGET_PORT DIALLER_PORT`` prints the port it listens on, then relays every
connection to the target's ``TARGET_PORT``. A data connection whose attach record names a generation past 0
(a redial) is first sent, as captured, to the dialler's own listener at ``DIALLER_PORT``; the status of that
listener's ``ATTACH_OK`` is printed as one JSON line ``{"reflected": status}``; then the record is relayed to
the target as usual. Runs until killed (10 s at most).
"""

from __future__ import annotations

import json
import socket
import sys
import threading
from pathlib import Path

from aio_datadist import wire

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the relays' pump
from tls_inject_relay import pump  # noqa: E402


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = b""
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            return data
        data += chunk
    return data


def handle(client: socket.socket, target: int, dialler: int) -> None:
    client.settimeout(10)
    head = recv_exactly(client, 4)
    if head == wire.ATTACH_MAGIC:
        record = head + recv_exactly(client, wire.ATTACH.size - 4)
        generation = wire.ATTACH.unpack(record)[4]
        if generation > 0:
            with socket.create_connection(("127.0.0.1", dialler), timeout=5) as back:
                back.sendall(record)
                reply = recv_exactly(back, wire.ATTACH_OK.size)
                status = wire.ATTACH_OK.unpack(reply)[1] if len(reply) == wire.ATTACH_OK.size else None
            print(json.dumps({"reflected": status}), flush=True)
        head = record
    up = socket.create_connection(("127.0.0.1", target), timeout=10)
    up.sendall(head)
    threading.Thread(target=pump, args=(up, client), daemon=True).start()
    pump(client, up)


def main() -> None:
    target, dialler = int(sys.argv[1]), int(sys.argv[2])
    server = socket.create_server(("127.0.0.1", 0))
    print(server.getsockname()[1], flush=True)
    server.settimeout(10)
    try:
        while True:
            conn, _ = server.accept()
            threading.Thread(target=handle, args=(conn, target, dialler), daemon=True).start()
    except OSError:
        pass


if __name__ == "__main__":
    main()
