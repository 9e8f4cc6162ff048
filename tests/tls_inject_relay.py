"""A hostile relay for ``test_tls.py``: a process at the address a TLS client dials, holding no certificate,
no key and no secret.

``python tls_inject_relay.py TARGET_PORT MODE`` listens on a loopback port (printed on stdout), and for each
connection reads the client's 5-byte TLS preamble, answers it itself with the one plaintext byte ``G``
followed, in the same segment, by records of its own, then relays everything else (the real TLS handshake
included, so every certificate check passes) to the real endpoint at ``TARGET_PORT``, whose own ``G`` it
swallows. MODE ``control``: on the control connection, a ``HELLO_ACK`` and a ``LINK_OK`` that refuses with
``LLM_ALREADY_LINK`` (a status nothing else here gives); MODE ``data``: on data connections, a successful
``ATTACH_OK``. A client that read those bytes as if they came out of TLS would report the relay's status, or
link with channels the relay answered for.
"""

from __future__ import annotations

import os
import socket
import sys
import threading

from aio_datadist import wire
from aio_datadist.status import LLMStatusCode
from aio_datadist.wire import Msg

TEXT = "injected in plaintext by a relay without a certificate"


def injection(kind: bytes, mode: str) -> bytes:
    if mode == "control" and kind == b"C":
        ack = wire.encode(Msg.HELLO_ACK, 0, nonce=os.urandom(32), proof=bytes(32))
        ok = wire.LinkOk(status=int(LLMStatusCode.LLM_ALREADY_LINK), cluster_id=0, role=0, link_token=bytes(32),
                         channels=0, boot_id=bytes(16), local_name=bytes(48), instance=bytes(32), proof=bytes(32),
                         text=TEXT)
        return ack + wire.encode_record(Msg.LINK_OK, 0, ok)
    if mode == "data" and kind == b"D":
        return wire.ATTACH_OK.pack(wire.ATTACH_MAGIC, 0)
    return b""


def pump(src: socket.socket, dst: socket.socket) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass


def handle(client: socket.socket, target: int, mode: str) -> None:
    client.settimeout(10)
    preamble = b""
    while len(preamble) < 5 and (chunk := client.recv(5 - len(preamble))):
        preamble += chunk
    if len(preamble) < 5:
        client.close()
        return
    client.sendall(b"G" + injection(preamble[4:5], mode))
    server = socket.create_connection(("127.0.0.1", target), timeout=10)
    server.sendall(preamble)
    if server.recv(1) != b"G":
        client.close()
        server.close()
        return
    client.settimeout(None)
    server.settimeout(None)
    threading.Thread(target=pump, args=(client, server), daemon=True).start()
    threading.Thread(target=pump, args=(server, client), daemon=True).start()


def main() -> None:
    target, mode = int(sys.argv[1]), sys.argv[2]
    listener = socket.create_server(("127.0.0.1", 0))
    print(listener.getsockname()[1], flush=True)
    while True:  # ends with the process (the test kills it)
        conn, _ = listener.accept()
        threading.Thread(target=handle, args=(conn, target, mode), daemon=True).start()


if __name__ == "__main__":
    main()
