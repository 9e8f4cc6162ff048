"""The vLLM connector's side-channel handshake: both ends prove the shared secret before any frame.

::

    decode                                                  prefill
    MAGIC | nonce_d                                    ->
                    <-  nonce_p | HMAC(k, LABEL | "prefill" | nonce_d | nonce_p)
    the decode checks the prefill's proof (a prefill without the secret
    learns nothing but a nonce)
    HMAC(k, LABEL | "decode" | nonce_p | nonce_d)     ->
    the prefill checks the decode's proof; until it holds, nothing the
    decode sent is read as a frame and nothing is answered

Every message has a fixed size, so nothing is parsed before the proofs
hold. Both proofs bind both ends' fresh nonces, so a recorded exchange fails
on a new connection (the other end's nonce differs); the role labels differ,
so one end's proof cannot be reflected as the other's; a worker that is both
prefill and decode (``kv_both``) answers nothing to a hello that carries the
nonce of one of its own decode dials (``own``, :mod:`aio_datadist.own_dials`),
so whoever it dialled cannot make it prove the secret to itself; ``LABEL`` keeps these
proofs apart from the link handshake's under the same secret
(:mod:`aio_datadist.handshake`). Comparisons are constant-time.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from collections.abc import Callable

from aio_datadist.own_dials import OwnDials

__all__ = ["MAGIC", "NONCE_BYTES", "PROOF_BYTES", "HELLO_BYTES", "AuthError", "HandshakeClosed", "proof", "dial",
           "accept"]

MAGIC = b"AIODDVS1"  # aio_datadist vLLM side channel, version 1
LABEL = b"aio_datadist/vllm-side-channel/v1|"
NONCE_BYTES = 32
PROOF_BYTES = 32
HELLO_BYTES = len(MAGIC) + NONCE_BYTES


class AuthError(ConnectionError):
    """The other end did not prove the shared secret (or did not speak the handshake)."""


class HandshakeClosed(AuthError):
    """The prefill closed the connection before its proof: no secret there, or it evicted us (a flood)."""


def proof(secret: bytes, role: bytes, first: bytes, second: bytes) -> bytes:
    """HMAC-SHA256 under ``secret`` of the protocol label, the prover's role and both nonces."""
    return hmac.new(secret, LABEL + role + b"|" + first + second, hashlib.sha256).digest()


async def dial(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
               own: OwnDials | None = None) -> None:
    """The decode's half: raises :class:`AuthError` unless the prefill proves ``secret``. ``own`` (a worker that
    also serves) holds our hello's nonce while the dial runs, so that our own side channel answers nothing to
    it (:func:`accept`): that failure is an :class:`AuthError`, not a :class:`HandshakeClosed` to retry."""
    nonce = os.urandom(NONCE_BYTES)
    with OwnDials.noted(own, nonce, writer.transport.abort) as came_back:
        writer.write(MAGIC + nonce)
        try:
            answer = await reader.readexactly(NONCE_BYTES + PROOF_BYTES)
        except (asyncio.IncompleteReadError, ConnectionResetError, BrokenPipeError):  # closed, or aborted (a reset)
            if came_back():
                raise AuthError("the peer handed our hello to this worker's own side channel (a relay of our own "
                                "handshake)") from None
            raise HandshakeClosed("the prefill closed the side channel during the handshake "
                                  "(no shared_secret there, or another one)") from None
    theirs, their_proof = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
    if not hmac.compare_digest(their_proof, proof(secret, b"prefill", nonce, theirs)):
        raise AuthError("the prefill did not prove the shared secret")
    writer.write(proof(secret, b"decode", theirs, nonce))


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, secret: bytes,
                 spoke: Callable[[], None] | None = None, own: Callable[[bytes], bool] | None = None) -> None:
    """The prefill's half: raises :class:`AuthError` unless the decode proves ``secret``.

    The caller bounds it in time; it reads exactly :data:`HELLO_BYTES` and
    then :data:`PROOF_BYTES`, whatever the peer sends. ``spoke`` is called once
    the decode's first message arrived (the server prefers to drop connections
    that said nothing yet).
    """
    try:
        hello = await reader.readexactly(HELLO_BYTES)
        if not hmac.compare_digest(hello[:len(MAGIC)], MAGIC):
            raise AuthError("not the side-channel handshake (no shared_secret at the decode?)")
        theirs = hello[len(MAGIC):]
        if own is not None and own(theirs):  # our own hello, handed back: a proof would let the relay in
            raise AuthError("a hello of this worker's own decode dial (handed back by whoever it dialled)")
        if spoke is not None:
            spoke()
        nonce = os.urandom(NONCE_BYTES)
        writer.write(nonce + proof(secret, b"prefill", theirs, nonce))
        their_proof = await reader.readexactly(PROOF_BYTES)
    except asyncio.IncompleteReadError:
        raise AuthError("the decode closed the side channel during the handshake") from None
    if not hmac.compare_digest(their_proof, proof(secret, b"decode", nonce, theirs)):
        raise AuthError("the decode did not prove the shared secret")
