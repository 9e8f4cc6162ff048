"""A hand-written client of the link protocol, for feeding a live endpoint hostile input.

Blocking sockets with timeouts; use it from a worker thread while the
endpoint runs in the test's event loop. It speaks only what ``wire.py`` and
``docs/transports.md`` describe: HELLO (a nonce) -> HELLO_ACK (a nonce and
the server's proof) -> AUTH (the client's proof and identity) -> LINK_OK
(proven), then ``2N`` data connections that present the link token, then
framed requests on the control connection and raw bytes on data channel
``[0, N)``.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import select
import socket
import time
from typing import Any

from aio_datadist import LLMRole, wire
from aio_datadist.wire import Msg

TIMEOUT_S = 10.0


class Refused(Exception):
    def __init__(self, code: int, text: str) -> None:
        super().__init__(f"{code:#x}: {text}")
        self.code = code
        self.text = text


def proof(secret: bytes | None, label: bytes, *parts: bytes) -> bytes:
    """The handshake's HMAC proof, computed from the documented recipe (not the library's code)."""
    if secret is None:
        return bytes(32)
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def dial(address: tuple[str, int]) -> socket.socket:
    """A connected TCP socket with Nagle off (small frames back to back would wait for delayed ACKs)."""
    sock = socket.create_connection(address, timeout=TIMEOUT_S)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def recv_exactly(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(min(n - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


def recv_frame(sock: socket.socket) -> tuple[Msg, int, dict[str, Any]]:
    msg, req_id, length = wire.parse_header(recv_exactly(sock, wire.HEADER.size))
    return msg, req_id, wire.fields_of(msg, recv_exactly(sock, length) if length else b"")


def rest_of_stream(sock: socket.socket, limit: int = 1 << 20) -> bytes:
    """Whatever the peer still sends before it closes (or the socket times out)."""
    data = b""
    try:
        while len(data) < limit:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    except (ConnectionResetError, socket.timeout):
        pass
    return data


class RawLink:
    """One authenticated link, made by hand. ``request`` sends a PULL_REQ/PUSH_REQ and moves its bytes."""

    def __init__(self, address: tuple[str, int], cluster_id: int, remote_id: int, secret: bytes | None,
                 role: LLMRole = LLMRole.DECODER) -> None:
        self.address = address
        self.cluster_id = cluster_id
        self.remote_id = remote_id
        self.secret = secret
        self.role = role
        self.ctl: socket.socket | None = None
        self.data: list[socket.socket] = []
        self.channels = 0
        self.token = b""
        self.generations: list[int] = []
        self._next_req = 1
        self._last_sent = 0.0
        self.captured: list[bytes] = []  # every frame and record this client sent, for replay tests

    # -- handshake ---------------------------------------------------------

    def connect(self, behind_auth: bytes = b"") -> RawLink:
        """Link (and attach every data channel); ``behind_auth`` goes in the same send as ``AUTH``, as a
        client that pipelines its first messages would send them."""
        ctl = dial(self.address)
        self.ctl = ctl
        nonce = os.urandom(wire.NONCE_BYTES)
        self.send_raw(wire.encode(Msg.HELLO, 0, nonce=nonce))
        msg, _, ack = recv_frame(ctl)
        assert msg is Msg.HELLO_ACK, msg
        if ack["proof"] != proof(self.secret, b"server", nonce, ack["nonce"]):
            raise Refused(-1, "the server's proof is wrong")
        identity = (self.cluster_id.to_bytes(8, "big") + int(self.role).to_bytes(1, "big")
                    + self.remote_id.to_bytes(8, "big") + bytes(32))
        self.send_raw(wire.encode(Msg.AUTH, 0, proof=proof(self.secret, b"client", ack["nonce"], nonce, identity),
                                  cluster_id=self.cluster_id, role=int(self.role), peer_id=self.remote_id,
                                  instance=bytes(32)) + behind_auth)
        msg, _, ok = recv_frame(ctl)
        assert msg is Msg.LINK_OK, msg
        if ok["status"] != 0:
            raise Refused(ok["status"], ok["text"])
        proven = (ok["status"].to_bytes(8, "big", signed=True) + ok["cluster_id"].to_bytes(8, "big")
                  + ok["role"].to_bytes(1, "big") + ok["link_token"] + ok["channels"].to_bytes(1, "big")
                  + ok["boot_id"] + ok["local_name"] + ok["instance"])
        if ok["proof"] != proof(self.secret, b"link", nonce, ack["nonce"], proven):
            raise Refused(-1, "the server's LINK_OK is not proven")
        assert ok["cluster_id"] == self.remote_id, ok["cluster_id"]
        self.token, self.channels = ok["link_token"], ok["channels"]
        for index in range(2 * self.channels):
            self.data.append(self.attach(index, 0))
        self.generations = [0] * (2 * self.channels)
        return self

    def attach(self, index: int, generation: int) -> socket.socket:
        sock = dial(self.address)
        presented = self.token if self.secret is None else proof(
            self.secret, b"attach", self.token, index.to_bytes(2, "big"), generation.to_bytes(4, "big"))
        record = wire.ATTACH.pack(wire.ATTACH_MAGIC, wire.VERSION, presented, index, generation)
        self.captured.append(record)
        sock.sendall(record)
        magic, status = wire.ATTACH_OK.unpack(recv_exactly(sock, wire.ATTACH_OK.size))
        if status != 0:
            sock.close()
            raise Refused(status, f"data channel {index} refused")
        return sock

    def close(self) -> None:
        for sock in self.data:
            sock.close()
        self.data = []
        if self.ctl is not None:
            self.ctl.close()
            self.ctl = None

    def __enter__(self) -> RawLink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- control messages -----------------------------------------------------

    def send_raw(self, frame: bytes) -> None:
        assert self.ctl is not None
        self.captured.append(frame)
        self.ctl.sendall(frame)
        self._last_sent = time.monotonic()

    def keepalive(self) -> None:
        """A PING now and then, so the peer's heartbeat keeps counting this link alive."""
        if time.monotonic() - self._last_sent > 0.3:
            self.send_raw(wire.encode(Msg.PING, 0))

    def answer(self, req_id: int) -> tuple[Msg, dict[str, Any]]:
        """The next RESP or DONE for ``req_id``; PINGs are skipped, PROBEs answered, an ABORT is an error
        (``TimeoutError`` past ``TIMEOUT_S``, however much heartbeat traffic comes meanwhile)."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            got = self._control_frame(req_id)
            if got is not None:
                return got
            if time.monotonic() > deadline:
                raise TimeoutError(f"no answer to request {req_id} within {TIMEOUT_S} s")

    def _control_frame(self, req_id: int) -> tuple[Msg, dict[str, Any]] | None:
        """Read one control frame: the RESP or DONE for ``req_id``, or None for heartbeat traffic."""
        assert self.ctl is not None
        msg, rid, fields = recv_frame(self.ctl)
        if msg in (Msg.PING, Msg.PROBE_ACK):
            return None
        if msg is Msg.PROBE:
            self.send_raw(wire.encode(Msg.PROBE_ACK, rid))
            return None
        if msg is Msg.ABORT:
            raise ConnectionError(f"the peer aborted data channel {fields['channel']}")
        if rid == req_id and msg in (Msg.RESP, Msg.DONE):
            return msg, fields
        raise AssertionError(f"unexpected {msg.name} for request {rid} while waiting for {req_id}")

    def new_req_id(self) -> int:
        rid = self._next_req
        self._next_req += 2
        return rid

    def pull(self, fields: dict[str, Any]) -> bytes:
        """Send a PULL_REQ; the bytes the owner sent, or :class:`Refused`."""
        rid = self.new_req_id()
        self.send_raw(wire.encode(Msg.PULL_REQ, rid, **fields))
        if fields.get("flags", 0) & wire.ReqFlag.POSTED and fields["channel"] < len(self.data):
            return self._posted_answer(rid, self.data[fields["channel"]])
        _, resp = self.answer(rid)
        if resp["status"] != 0:
            raise Refused(resp["status"], resp["text"])
        data = recv_exactly(self.data[fields["channel"]], resp["total"])
        self.send_raw(wire.encode(Msg.DONE, rid, status=0, text=""))
        return data

    def _posted_answer(self, rid: int, data: socket.socket) -> bytes:
        """A posted pull's answer: the ANSWER header on its channel (then the bytes, or the refusal's
        text), or a RESP refusal when the owner does not answer on the channel."""
        assert self.ctl is not None
        deadline = time.monotonic() + TIMEOUT_S
        while True:  # heartbeat traffic on the control connection may come first: the answer is on either
            readable, _, _ = select.select([data, self.ctl], [], [], max(deadline - time.monotonic(), 0))
            if data in readable:
                break
            if not readable:
                raise TimeoutError(f"no answer to posted pull {rid} within {TIMEOUT_S} s")
            got = self._control_frame(rid)
            if got is not None:
                resp = got[1]
                assert resp["status"] != 0, "a posted pull is accepted on its channel only"
                raise Refused(resp["status"], resp["text"])
        magic, status, answered, total = wire.ANSWER.unpack(recv_exactly(data, wire.ANSWER.size))
        assert magic == wire.ANSWER_MAGIC and answered == rid, (magic, answered, rid)
        if status:
            assert total <= wire.MAX_TEXT
            raise Refused(status, recv_exactly(data, total).decode())
        payload = recv_exactly(data, total)
        self.send_raw(wire.encode(Msg.DONE, rid, status=0, text=""))
        return payload

    def offer(self, msg: Msg, fields: dict[str, Any]) -> tuple[int, int]:
        """Send a request; ``(req_id, total)`` once the owner accepted it, or :class:`Refused`."""
        rid = self.new_req_id()
        self.send_raw(wire.encode(msg, rid, **fields))
        _, resp = self.answer(rid)
        if resp["status"] != 0:
            raise Refused(resp["status"], resp["text"])
        return rid, resp["total"]

    def push(self, fields: dict[str, Any], payload: Any) -> int:
        """Send a PUSH_REQ and, once accepted, ``payload(total) -> bytes``; the byte count pushed."""
        rid, total = self.offer(Msg.PUSH_REQ, fields)
        data = payload(total)
        assert len(data) == total
        self.data[fields["channel"]].sendall(data)
        msg, done = self.answer(rid)
        assert msg is Msg.DONE and done["status"] == 0, done
        return total
