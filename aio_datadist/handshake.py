"""The link handshake: both ends prove the shared secret before anything identifying is sent.

::

    client                                               server
    HELLO      nonce_c                               ->
               <-  HELLO_ACK  nonce_s, proof_s = HMAC(k, "server" | nonce_c | nonce_s)
    the client checks proof_s; an endpoint that cannot prove the secret gets
    nothing but a nonce from it
    AUTH       proof_c = HMAC(k, "client" | nonce_s | nonce_c | identity),
               identity = cluster id, role, the cluster id it wants, its endpoint's
               instance, whether it is a bilateral ``link()`` dial  ->
               the server checks proof_c; a client that cannot prove the secret gets
               a refusal that carries nothing
               <-  LINK_OK  status, cluster id, role, link token, channel count, boot id,
                            share socket name, its instance, proof_l = HMAC(k, "link" | nonce_c | nonce_s | fields)
               or a refusal: status and text, proven to a client that proved itself
                            (HMAC(k, "refused" | nonce_c | nonce_s | status | text)); with a
                            secret, a client fails an unproven refusal as LLM_LINK_FAILED
                            whatever status it names

Before the client's proof is checked the server sends only its nonce and
its proof, both functions of random nonces: no cluster id, role, instance,
channel count, boot id or socket name. Each proof binds both nonces, so a
captured HELLO, HELLO_ACK, AUTH or LINK_OK is useless on another connection,
and the labels differ, so no proof can be reflected as another. The server
answers nothing to a HELLO that carries the nonce of one of its own
endpoint's dials still in its handshake (``own``, :mod:`aio_datadist.own_dials`):
whoever that endpoint dialled cannot hand its HELLO back to its listener and
so make it prove the secret to itself on its behalf. Without a
shared secret the proofs are all zero and the same messages link any two
endpoints (use TLS, or a network you trust).

Data connections attach with :func:`attach_token`: the link token or, with a
secret, an HMAC of it bound to the channel and its generation.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import os
from collections.abc import Callable
from typing import Any, Protocol

from aio_datadist import wire
from aio_datadist.own_dials import OwnDials
from aio_datadist.status import LLMException, LLMStatusCode, code_to_status
from aio_datadist.types import UINT64_MAX, LLMRole
from aio_datadist.wire import Msg, ProtocolError

__all__ = ["Accepted", "Reader", "accept", "attach_token", "dial", "link_ok", "proof"]

ZERO32 = bytes(32)
ZERO16 = bytes(16)
#: The ``peer_id`` of a dial to whichever cluster listens at the address (``LLMClusterInfo`` without
#: ``remote_cluster_id``): the client learns the id from ``LINK_OK``.
ANY_PEER = UINT64_MAX
SUCCESS = LLMStatusCode.LLM_SUCCESS


class Reader(Protocol):
    """What the server's half reads from: a stream reader, or a wrapper that notes each read."""

    async def readexactly(self, n: int) -> bytes: ...


def proof(secret: bytes | None, label: bytes, *parts: bytes) -> bytes:
    """HMAC-SHA256 of ``label`` and ``parts`` under ``secret``; 32 zero bytes without a secret."""
    if secret is None:
        return ZERO32
    return hmac.new(secret, label + b"".join(parts), hashlib.sha256).digest()


def attach_token(secret: bytes | None, token: bytes, index: int, generation: int) -> bytes:
    """What a data connection presents: the link token or, with a shared secret, an HMAC that binds
    it to the channel and generation, so a captured record cannot be replayed or re-aimed."""
    if secret is None:
        return token
    return proof(secret, b"attach", token, index.to_bytes(2, "big"), generation.to_bytes(4, "big"))


def _identity(cluster_id: int, role: int, peer_id: int, instance: bytes, bilateral: int = 0) -> bytes:
    return (cluster_id.to_bytes(8, "big") + role.to_bytes(1, "big") + peer_id.to_bytes(8, "big") + instance
            + (b"\x01" if bilateral else b""))


def _refusal_fields(status: int, text: str) -> bytes:
    return status.to_bytes(8, "big", signed=True) + text.encode("utf-8")


def _link_fields(ok: wire.LinkOk) -> bytes:
    return (ok.status.to_bytes(8, "big", signed=True) + ok.cluster_id.to_bytes(8, "big")
            + ok.role.to_bytes(1, "big") + ok.link_token + ok.channels.to_bytes(1, "big")
            + ok.boot_id + ok.local_name.ljust(48, b"\0") + ok.instance)


async def read_expected(reader: Reader, expected: Msg) -> Any:
    """The next message's record, which must be ``expected`` (else :class:`ProtocolError`)."""
    msg, _req_id, length = wire.parse_header(await reader.readexactly(wire.HEADER.size))
    if msg is not expected:
        raise ProtocolError(f"expected {expected.name}, got {msg.name}")
    return wire.decode(msg, await reader.readexactly(length))


async def dial(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *, secret: bytes | None,
               cluster_id: int, role: LLMRole, peer_id: int, instance: bytes, bilateral: bool = False,
               own: OwnDials | None = None) -> Linked:
    """The client's half; what the server's successful ``LINK_OK`` says.

    ``bilateral`` marks a dial of ``LLMDataDist.link``, which the server
    takes only while its own ``link`` for this pair waits for it. A
    ``peer_id`` of :data:`ANY_PEER` takes whichever cluster answers (the
    result names it). ``own`` holds our HELLO nonce while the dial runs, so
    that our own listener answers nothing to it (:func:`accept`).

    :raises LLMException: ``LLM_LINK_FAILED`` when the server cannot prove
        the secret (nothing but a nonce was sent to it), is another cluster,
        or is our own listener (``own``: a link to ourselves, or our HELLO
        handed back to us); the server's status code when it refused.
    :raises ProtocolError: for malformed answers (as do stream errors).
    """
    nonce = os.urandom(wire.NONCE_BYTES)
    with OwnDials.noted(own, nonce, writer.transport.abort) as came_back:
        writer.write(wire.encode(Msg.HELLO, 0, nonce=nonce))
        try:
            ack: wire.HelloAck = await read_expected(reader, Msg.HELLO_ACK)
        except (asyncio.IncompleteReadError, ConnectionError):
            if came_back():  # our listener answered nothing to our own HELLO
                raise LLMException("our HELLO reached this endpoint's own listener: a link to this endpoint "
                                   "itself, or the peer handed our handshake back to us",
                                   status_code=LLMStatusCode.LLM_LINK_FAILED) from None
            raise
    if not hmac.compare_digest(ack.proof, proof(secret, b"server", nonce, ack.nonce)):
        raise LLMException("peer failed authentication (shared secret differs)",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    identity = _identity(cluster_id, int(role), peer_id, instance, int(bilateral))
    writer.write(wire.encode(Msg.AUTH, 0, proof=proof(secret, b"client", ack.nonce, nonce, identity),
                             cluster_id=cluster_id, role=int(role), peer_id=peer_id, instance=instance,
                             bilateral=int(bilateral)))
    ok: wire.LinkOk = await read_expected(reader, Msg.LINK_OK)
    if ok.status != SUCCESS:
        if secret is not None and not hmac.compare_digest(
                ok.proof, proof(secret, b"refused", nonce, ack.nonce, _refusal_fields(ok.status, ok.text))):
            # Not the server's word (it proves every refusal of a client that proved itself): a relay's, or a
            # server that did not take our proof. Its code is not ours to report.
            raise LLMException(f"peer refused, unproven (status {ok.status}, {ok.text!r}): a refusal that does not "
                               "prove the shared secret", status_code=LLMStatusCode.LLM_LINK_FAILED)
        raise LLMException(f"peer refused: {ok.text}", status_code=code_to_status(ok.status))
    if not hmac.compare_digest(ok.proof, proof(secret, b"link", nonce, ack.nonce, _link_fields(ok))):
        raise LLMException("peer failed authentication (LINK_OK is not proven)",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    if peer_id != ANY_PEER and ok.cluster_id != peer_id:
        raise LLMException(f"peer is cluster {ok.cluster_id}, not {peer_id}",
                           status_code=LLMStatusCode.LLM_LINK_FAILED)
    try:
        remote_role = LLMRole(ok.role)
    except ValueError:
        raise ProtocolError(f"bad role {ok.role}") from None
    if not 1 <= ok.channels <= 16:
        raise ProtocolError(f"bad channel count {ok.channels}")
    return Linked(remote_role, ok.link_token, ok.channels, ok.boot_id, ok.local_name, ok.cluster_id, ok.instance)


@dataclasses.dataclass(frozen=True)
class Linked:
    """What a client learns from the server's ``LINK_OK``."""

    role: LLMRole
    link_token: bytes
    channels: int
    boot_id: bytes
    local_name: bytes
    cluster_id: int
    instance: bytes  # the server endpoint's (``LinkTable.instance``)


@dataclasses.dataclass
class Accepted:
    """A client's ``AUTH`` as the server read it; ``authenticated`` tells whether its proof held."""

    client_nonce: bytes
    server_nonce: bytes
    req_id: int
    auth: wire.Auth
    authenticated: bool


async def accept(head: bytes, reader: Reader, writer: asyncio.StreamWriter, *,
                 secret: bytes | None, own: Callable[[bytes], bool] | None = None) -> Accepted:
    """The server's half up to the client's proof; ``head`` is what was read of the first header.

    Sends the client only a nonce and the server's proof. The caller
    answers with :func:`link_ok` (a refusal unless ``authenticated``).
    ``own(nonce)`` says whether a HELLO nonce is one of this endpoint's
    running dials': such a HELLO gets no answer (:class:`ProtocolError`).
    """
    msg, req_id, length = wire.parse_header(head + await reader.readexactly(wire.HEADER.size - len(head)))
    if msg is not Msg.HELLO:
        raise ProtocolError(f"expected HELLO, got {msg.name}")
    hello: wire.Hello = wire.decode(msg, await reader.readexactly(length))
    if own is not None and own(hello.nonce):  # our own HELLO, handed back: a proof would let the relay in
        raise ProtocolError("a HELLO of a dial of this endpoint's own (a link to itself, or a relay)")
    nonce = os.urandom(wire.NONCE_BYTES)
    writer.write(wire.encode(Msg.HELLO_ACK, req_id, nonce=nonce, proof=proof(secret, b"server", hello.nonce, nonce)))
    auth: wire.Auth = await read_expected(reader, Msg.AUTH)
    expected = proof(secret, b"client", nonce, hello.nonce,
                     _identity(auth.cluster_id, auth.role, auth.peer_id, auth.instance, auth.bilateral))
    return Accepted(hello.nonce, nonce, req_id, auth, hmac.compare_digest(auth.proof, expected))


def link_ok(secret: bytes | None, accepted: Accepted, status: LLMStatusCode, *, cluster_id: int = 0,
            role: int = 0, token: bytes = ZERO32, channels: int = 0, boot: bytes = ZERO16, local_name: bytes = b"",
            instance: bytes = ZERO32, text: str = "") -> bytes:
    """The server's final answer; a refusal (``status`` not success) carries nothing but its text, proven
    (status and text, as the client will read the text) to a client that proved itself."""
    ok = wire.LinkOk(status=int(status), cluster_id=cluster_id, role=int(role), link_token=token,
                     channels=channels, boot_id=boot, local_name=local_name[:48].ljust(48, b"\0"),
                     instance=instance, proof=ZERO32, text=text)
    if status != SUCCESS and accepted.authenticated:
        shown = wire.peer_text(text.encode("utf-8", "replace")[:wire.MAX_TEXT])
        ok = dataclasses.replace(ok, proof=proof(secret, b"refused", accepted.client_nonce, accepted.server_nonce,
                                                 _refusal_fields(int(status), shown)))
    if status == SUCCESS:
        ok = dataclasses.replace(ok, proof=proof(secret, b"link", accepted.client_nonce, accepted.server_nonce,
                                                 _link_fields(ok)))
    return wire.encode_record(Msg.LINK_OK, accepted.req_id, ok)
