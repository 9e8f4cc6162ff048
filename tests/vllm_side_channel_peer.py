"""A hostile or sniffing peer of the vLLM connector's side channel, run as its own process.

Standard library only (it starts in milliseconds). Each mode prints one JSON
line on stdout with what it saw::

    python vllm_side_channel_peer.py plain HOST PORT REQ            # claim and done with no handshake
    python vllm_side_channel_peer.py secret HOST PORT REQ SECRET    # the handshake with SECRET, then claim/done
    python vllm_side_channel_peer.py relay HOST PORT TRANSCRIPT     # forward one connection, record its bytes
    python vllm_side_channel_peer.py replay HOST PORT TRANSCRIPT    # send a recorded connection's bytes again
    python vllm_side_channel_peer.py flood HOST PORT N              # N silent connections, more until stdin ends
    python vllm_side_channel_peer.py flood HOST PORT N GAP SRC      # the same from SRC, each sending a hello
                                                                    # (no secret needed), one every GAP s
    python vllm_side_channel_peer.py lie HOST PORT SECRET|-         # frame headers that lie about their size
    python vllm_side_channel_peer.py claims HOST PORT SECRET REQ...  # claim each on one connection
    python vllm_side_channel_peer.py reflect[-reset|-hold] HOST PORT REQ  # print the port it listens on; hand the
                                                                    # hello of the decode that dials it to
                                                                    # HOST:PORT, the answer back, the decode's
                                                                    # proof on; then claim and done REQ there
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import select
import socket
import struct
import sys
import threading
import time

MAGIC = b"AIODDVS1"
LABEL = b"aio_datadist/vllm-side-channel/v1|"


def frame(message: dict) -> bytes:
    body = json.dumps(message).encode()
    return struct.pack(">I", len(body)) + body


def drain(sock: socket.socket, timeout_s: float = 5.0) -> tuple[bytes, bool]:
    """Everything the server sends until it closes (True) or ``timeout_s`` passes (False)."""
    data = b""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        sock.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except ConnectionResetError:
            return data, True
        if not chunk:
            return data, True
        data += chunk
    return data, False


def handshake(sock: socket.socket, secret: bytes) -> bool:
    nonce = os.urandom(32)
    sock.sendall(MAGIC + nonce)
    answer = b""
    while len(answer) < 64:
        chunk = sock.recv(64 - len(answer))
        if not chunk:
            return False
        answer += chunk
    theirs = answer[:32]
    expected = hmac.new(secret, LABEL + b"prefill|" + nonce + theirs, hashlib.sha256).digest()
    sock.sendall(hmac.new(secret, LABEL + b"decode|" + theirs + nonce, hashlib.sha256).digest())
    return hmac.compare_digest(expected, answer[32:])


def claim_and_release(host: str, port: int, req: str, secret: bytes | None) -> dict:
    with socket.create_connection((host, port), timeout=5) as sock:
        proved = handshake(sock, secret) if secret is not None else None
        try:
            sock.sendall(frame({"id": 1, "op": "claim", "req": req}) + frame({"id": 2, "op": "done", "req": req}))
        except OSError:
            pass
        data, closed = drain(sock, 3.0)
    return {"prefill_proved": proved, "got": data.hex(), "closed": closed}


def relay(host: str, port: int, transcript: str) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    print(json.dumps({"port": server.getsockname()[1]}), flush=True)
    down, _ = server.accept()
    up = socket.create_connection((host, port))
    with open(transcript, "wb") as out:
        while True:
            ready, _, _ = select.select([down, up], [], [], 30)
            if not ready:
                return
            for sock in ready:
                chunk = sock.recv(65536)
                if not chunk:
                    return
                if sock is down:
                    out.write(chunk)
                    out.flush()
                    up.sendall(chunk)
                else:
                    down.sendall(chunk)


def replay(host: str, port: int, transcript: str) -> dict:
    with open(transcript, "rb") as f:
        recorded = f.read()
    with socket.create_connection((host, port), timeout=5) as sock:
        sock.sendall(recorded[:40])  # the recorded nonce, then the recorded proof and frames
        time.sleep(0.1)
        try:
            sock.sendall(recorded[40:])
        except OSError:
            pass
        data, closed = drain(sock, 5.0)
    return {"sent": len(recorded), "got": data.hex(), "closed": closed}


def flood(host: str, port: int, count: int, gap_s: float = 0.005, source: str = "") -> None:
    socks: list[socket.socket] = []
    opened = 0

    def open_one() -> None:
        nonlocal opened
        try:
            sock = socket.create_connection((host, port), timeout=5,
                                            source_address=(source, 0) if source else None)
            socks.append(sock)
            opened += 1
            if source:
                sock.sendall(MAGIC + os.urandom(32))  # a hello anyone can send: it then stalls
        except OSError:
            pass

    for _ in range(count):
        open_one()
    print(json.dumps({"opened": opened}), flush=True)
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    while not stop.wait(gap_s):  # keep coming: by default about 200 new silent connections a second
        open_one()
        if len(socks) > 2000:
            socks.pop(0).close()
    print(json.dumps({"opened": opened}), flush=True)


def lie(host: str, port: int, secret: bytes | None) -> dict:
    seen = {}
    lies = {"too_long": struct.pack(">I", 0xFFFFFFFF) + b"{}", "zero": struct.pack(">I", 0),
            "short_body": struct.pack(">I", 1000) + b'{"id": 1, "op": "done", "req": "r1"}'}
    for name, data in lies.items():
        with socket.create_connection((host, port), timeout=5) as sock:
            if secret is not None and not handshake(sock, secret):
                seen[name] = "handshake failed"
                continue
            sock.sendall(data)
            if name == "short_body":
                sock.shutdown(socket.SHUT_WR)  # the promised bytes never come
            got, closed = drain(sock, 5.0)
            seen[name] = {"got": got.hex(), "closed": closed}
    return seen


def claims(host: str, port: int, secret: bytes, reqs: list[str]) -> dict:
    with socket.create_connection((host, port), timeout=5) as sock:
        assert handshake(sock, secret)
        replies = []
        for rid, req in enumerate(reqs, 1):
            sock.sendall(frame({"id": rid, "op": "claim", "req": req}))
            header = sock.recv(4, socket.MSG_WAITALL)
            replies.append(json.loads(sock.recv(struct.unpack(">I", header)[0], socket.MSG_WAITALL)))
    return {"replies": replies}


def reflect(host: str, port: int, req: str, reset: bool = False, hold: bool = False) -> dict:
    """No secret: relay one dialling decode's handshake to the side channel at ``host:port`` (the dialling
    worker's own), then use that connection as if it had proved the secret."""
    seen: dict = {"answered": False, "proved": False, "claim": None, "done": None}
    with socket.create_server(("127.0.0.1", 0)) as server:
        print(server.getsockname()[1], flush=True)
        server.settimeout(30)
        dial, _ = server.accept()
    with dial, socket.create_connection((host, port), timeout=10) as back:
        dial.settimeout(10)
        back.sendall(recv_exactly(dial, len(MAGIC) + 32))  # the decode's hello
        answer = recv_exactly(back, 64)  # the side channel's nonce and proof over the decode's nonce
        if answer is None:
            if reset:  # hang up on the decode with a reset (RST), not a close
                dial.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            if hold:  # keep the decode's connection open until it closes it (5 s at most)
                dial.settimeout(5)
                with contextlib.suppress(OSError):
                    recv_exactly(dial, 1)
            return seen
        seen["answered"] = True
        dial.sendall(answer)
        proof = recv_exactly(dial, 32)  # the decode proves the secret in turn
        if proof is None:
            return seen
        seen["proved"] = True
        back.sendall(proof)
        for rid, op in ((1, "claim"), (2, "done")):
            back.sendall(frame({"id": rid, "op": op, "req": req}))
            head = recv_exactly(back, 4)
            body = None if head is None else recv_exactly(back, struct.unpack(">I", head)[0])
            seen[op] = None if body is None else json.loads(body)
    return seen


def recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None once the other end closed (or reset) first."""
    data = b""
    while len(data) < n:
        try:
            chunk = sock.recv(n - len(data))
        except ConnectionResetError:
            return None
        if not chunk:
            return None
        data += chunk
    return data


def main(argv: list[str]) -> None:
    mode, host, port = argv[0], argv[1], int(argv[2])
    if mode == "plain":
        print(json.dumps(claim_and_release(host, port, argv[3], None)))
    elif mode == "secret":
        print(json.dumps(claim_and_release(host, port, argv[3], argv[4].encode())))
    elif mode == "relay":
        relay(host, port, argv[3])
    elif mode == "replay":
        print(json.dumps(replay(host, port, argv[3])))
    elif mode == "flood":
        flood(host, port, int(argv[3]), *((float(argv[4]), argv[5]) if len(argv) > 5 else ()))
    elif mode == "lie":
        print(json.dumps(lie(host, port, None if argv[3] == "-" else argv[3].encode())))
    elif mode == "claims":
        print(json.dumps(claims(host, port, argv[3].encode(), argv[4:])))
    elif mode in ("reflect", "reflect-reset", "reflect-hold"):
        print(json.dumps(reflect(host, port, argv[3], reset=mode == "reflect-reset", hold=mode == "reflect-hold")))


if __name__ == "__main__":
    main(sys.argv[1:])
