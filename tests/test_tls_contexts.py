"""What the TLS options accept and what they set on the contexts they are given (``option_checks._tls_check``), and a
TLS data channel's send that never lets the TLS layer read the caller's memory after it reported success.

A client context that checks no certificate (``ssl.SSLContext()`` / ``PROTOCOL_TLS`` leave ``verify_mode`` at
``CERT_NONE``) would link to anyone; a server context with ``CERT_OPTIONAL`` takes a client without a
certificate although it asks for one. Both are refused. Both contexts get ``OP_NO_RENEGOTIATION`` and
TLS 1.2 at least: a TLS 1.2 peer that starts a renegotiation and leaves it hanging made asyncio's TLS layer
keep a send's plaintext as views of the cache memory after the send reported success, and read the memory
when the peer went on (``tls_reneg_server.py``, a hostile peer in a thread).
"""

from __future__ import annotations

import asyncio
import os
import logging
import ssl
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import pytest
import torch

from aio_datadist import LLMConfig, LLMException, LLMStatusCode
from aio_datadist.options import parse_options
from aio_datadist.transport import tls
from tls_certs import client_context, make_pki, server_context
from tls_reneg_server import RenegServer

PKI = make_pki("contexts")
MARKER = b"REUSED-AFTER-RETURN!"
SIZE = 16384


@contextmanager
def refused(name: str, *words: str) -> Iterator[None]:
    with pytest.raises(LLMException) as info:
        yield
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    text = str(info.value)
    assert f"'{name}'" in text and all(word in text for word in words), text


def generic_context() -> ssl.SSLContext:
    """What older code and many tutorials write: ``PROTOCOL_TLS``, then the CA it means to trust."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        context = ssl.SSLContext(ssl.PROTOCOL_TLS)
    context.load_verify_locations(cadata=PKI.ca.decode())
    return context


def no_check_client() -> ssl.SSLContext:
    context = client_context(PKI)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


def optional_check_client() -> ssl.SSLContext:
    context = client_context(PKI)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_OPTIONAL
    return context


def optional_client_cert_server() -> ssl.SSLContext:
    context = server_context(PKI)
    context.verify_mode = ssl.CERT_OPTIONAL
    return context


def set_property(name: str, context: ssl.SSLContext) -> None:
    setattr(LLMConfig(), name, context)


# -- refused contexts ---------------------------------------------------------------------


@pytest.mark.parametrize("make", [generic_context, no_check_client, optional_check_client],
                         ids=["PROTOCOL_TLS", "CERT_NONE", "CERT_OPTIONAL"])
def test_a_client_context_that_does_not_check_the_server_certificate_is_refused(
        make: Callable[[], ssl.SSLContext]) -> None:
    advice = ("verify_mode", "CERT_REQUIRED", "check_hostname = True",
              "PROTOCOL_TLS_CLIENT", "create_default_context()")
    with refused("tls_client_context", *advice):
        set_property("tls_client_context", make())
    with refused("aio.TlsClientContext", *advice):
        parse_options({"aio.TlsClientContext": make()})


def test_a_client_context_that_checks_no_name_is_taken_with_a_warning_that_says_so(caplog) -> None:
    """The refusal of ``PROTOCOL_TLS`` advised ``verify_mode = CERT_REQUIRED`` alone, which leaves the name check
    off: the endpoint then links to any holder of a certificate of that CA, for any address (found by audit).
    The advice now includes ``check_hostname``, and a client context without it is taken with a warning."""
    generic = generic_context()
    generic.verify_mode = ssl.CERT_REQUIRED
    with caplog.at_level(logging.WARNING, logger="aio_datadist.tls"):
        config = LLMConfig()
        config.tls_client_context = generic  # checked here, warned of once the options are taken (review)
        assert caplog.text == ""
        parse_options(config.generate_options())
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and warned[0].startswith("aio.TlsClientContext:") and "check_hostname is off" in warned[0]
    assert "any peer holding a certificate of that CA, for any address" in warned[0]  # what it lets in
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="aio_datadist.tls"), pytest.raises(LLMException):
        parse_options({"aio.TlsClientContext": generic, "aio.Transport": "nixl"})  # refused: no warning
    assert caplog.text == ""
    with caplog.at_level(logging.WARNING, logger="aio_datadist.tls"):
        parse_options({"aio.TlsClientContext": client_context(PKI)})
    assert caplog.text == ""


def test_a_server_context_that_asks_for_a_client_certificate_but_takes_none_is_refused() -> None:
    with refused("tls_server_context", "CERT_OPTIONAL", "mutual TLS"):
        set_property("tls_server_context", optional_client_cert_server())
    with refused("aio.TlsServerContext", "CERT_OPTIONAL"):
        parse_options({"aio.TlsServerContext": optional_client_cert_server()})


def test_contexts_that_check_what_they_promise_are_accepted() -> None:
    generic = generic_context()
    generic.verify_mode = ssl.CERT_REQUIRED  # a generic context told to check the certificate (no hostname)
    for options in ({"aio.TlsClientContext": client_context(PKI)},
                    {"aio.TlsClientContext": generic},
                    {"aio.TlsServerContext": server_context(PKI)},  # mutual TLS
                    {"aio.TlsServerContext": server_context(PKI, require_client_cert=False)}):  # no client cert
        settings = parse_options(options)
        assert settings.tls


def test_a_context_below_tls_1_2_is_refused() -> None:
    client = client_context(PKI)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client.maximum_version = ssl.TLSVersion.TLSv1_1
    with refused("aio.TlsClientContext", "TLS 1.2"):
        parse_options({"aio.TlsClientContext": client})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        old = ssl.SSLContext(ssl.PROTOCOL_TLSv1)
    with refused("aio.TlsServerContext", "PROTOCOL_TLSv1"):
        parse_options({"aio.TlsServerContext": old})


# -- what the check sets on the contexts ---------------------------------------------------


def test_both_contexts_refuse_renegotiation_and_anything_below_tls_1_2() -> None:
    client, server = client_context(PKI), server_context(PKI)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        client.minimum_version = server.minimum_version = ssl.TLSVersion.TLSv1  # the user's; raised by us
    config = LLMConfig()
    config.tls_client_context = client
    config.tls_server_context = server
    for context in (client, server):
        assert context.options & ssl.OP_NO_RENEGOTIATION
        assert context.minimum_version == ssl.TLSVersion.TLSv1_2
    client2, server2 = client_context(PKI), server_context(PKI)
    client2.minimum_version = ssl.TLSVersion.TLSv1_3
    settings = parse_options({"aio.TlsClientContext": client2, "aio.TlsServerContext": server2})
    assert settings.tls_client_context is client2 and settings.tls_server_context is server2
    for context in (client2, server2):
        assert context.options & ssl.OP_NO_RENEGOTIATION
    assert client2.minimum_version == ssl.TLSVersion.TLSv1_3  # a higher minimum is kept


# -- a hostile peer that starts a renegotiation ---------------------------------------------------


@pytest.fixture
def pki_files() -> Iterator[tuple[str, str]]:
    with tempfile.TemporaryDirectory() as folder:
        paths = os.path.join(folder, "server.pem"), os.path.join(folder, "server.key")
        for path, data in zip(paths, (PKI.server.cert, PKI.server.key), strict=True):
            with open(path, "wb") as f:
                f.write(data)
        yield paths


@pytest.mark.asyncio
@pytest.mark.parametrize("renegotiate", [False, True], ids=["plain", "renegotiation"])
async def test_a_send_that_returned_has_read_all_of_its_memory(pki_files: tuple[str, str],
                                                                renegotiate: bool) -> None:
    """The context goes through the option check, as an endpoint's does, then dials a data channel to a
    linked peer (its certificate is trusted) that asks for a renegotiation and leaves it hanging. The send
    reports success; the caller then reuses its memory; the peer must not receive what it reuses."""
    server = RenegServer(*pki_files, renegotiate=renegotiate, expect=SIZE)
    channel = None
    try:
        context = parse_options({"aio.TlsClientContext": client_context(PKI)}).tls_client_context
        assert context is not None
        channel = await asyncio.wait_for(tls.dial_data(("127.0.0.1", server.port), context, 5, lambda _: None), 10)
        assert await asyncio.to_thread(server.asked.wait, 10)
        await asyncio.sleep(0.1)  # the channel reads the HelloRequest (and answers it, or starts renegotiating)
        src = torch.full((SIZE,), 0x41, dtype=torch.uint8)
        sent = await asyncio.wait_for(channel.start([src.data_ptr(), SIZE], send=True, timeout_ms=5000,
                                                    what="push", keepalive=src), 10)
        assert sent == SIZE
        src.copy_(torch.frombuffer(bytearray(MARKER * (SIZE // len(MARKER) + 1)), dtype=torch.uint8)[:SIZE])
        server.go()
        got = await asyncio.to_thread(server.received)
        assert MARKER not in got, f"the peer read the caller's memory after the send returned ({server.error})"
        if not renegotiate:
            assert got == b"A" * SIZE, (len(got), server.error)
    finally:
        if channel is not None:
            channel.close()
        await asyncio.to_thread(server.close)


@pytest.mark.asyncio
async def test_every_connection_refuses_renegotiation_even_if_the_flag_was_cleared_after_the_check(
        pki_files: tuple[str, str]) -> None:
    """The flag is set again by every TLS connection made (``tls._no_renegotiation``), not only at option check:
    a context whose ``OP_NO_RENEGOTIATION`` the user cleared after it was checked still never lets the hostile
    peer read a send's memory after the send returned."""
    server = RenegServer(*pki_files, renegotiate=True, expect=SIZE)
    channel = None
    try:
        context = parse_options({"aio.TlsClientContext": client_context(PKI)}).tls_client_context
        assert context is not None
        context.options &= ~ssl.OP_NO_RENEGOTIATION  # the user's code, after the check
        assert not context.options & ssl.OP_NO_RENEGOTIATION
        channel = await asyncio.wait_for(tls.dial_data(("127.0.0.1", server.port), context, 5, lambda _: None), 10)
        assert context.options & ssl.OP_NO_RENEGOTIATION
        assert await asyncio.to_thread(server.asked.wait, 10)
        await asyncio.sleep(0.1)  # (as above: the channel reads the HelloRequest)
        src = torch.full((SIZE,), 0x41, dtype=torch.uint8)
        sent = await asyncio.wait_for(channel.start([src.data_ptr(), SIZE], send=True, timeout_ms=5000,
                                                    what="push", keepalive=src), 10)
        assert sent == SIZE
        src.copy_(torch.frombuffer(bytearray(MARKER * (SIZE // len(MARKER) + 1)), dtype=torch.uint8)[:SIZE])
        server.go()
        got = await asyncio.to_thread(server.received)
        assert MARKER not in got, f"the peer read the caller's memory after the send returned ({server.error})"
    finally:
        if channel is not None:
            channel.close()
        await asyncio.to_thread(server.close)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["data", "control"])
async def test_both_ends_of_every_connection_refuse_renegotiation_even_if_the_flag_was_cleared(kind: str) -> None:
    """As above, for the accepting end (``accept_data``, ``accept_control``: a client may start a renegotiation
    too) and for control connections: each sets the flag again on the context it is given (found by audit)."""
    client = parse_options({"aio.TlsClientContext": client_context(PKI)}).tls_client_context
    server = parse_options({"aio.TlsServerContext": server_context(PKI)}).tls_server_context  # mutual TLS
    assert client is not None and server is not None
    for context in (client, server):
        context.options &= ~ssl.OP_NO_RENEGOTIATION  # the user's code, after the check
    accepted: asyncio.Future = asyncio.get_running_loop().create_future()

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            preamble = tls.MAGIC + (tls.DATA if kind == "data" else tls.CONTROL)
            assert await reader.readexactly(tls.PREAMBLE_SIZE) == preamble
            if kind == "data":
                channel = await tls.accept_data(reader, writer, server, 5)
                accepted.set_result(None)
                channel.close()
            else:
                await tls.accept_control(reader, writer, server, 5)
                accepted.set_result(None)
                writer.transport.abort()
        except BaseException as exc:
            if not accepted.done():
                accepted.set_exception(exc)
            writer.transport.abort()

    listener = await asyncio.start_server(accept, "127.0.0.1", 0)
    address = listener.sockets[0].getsockname()[:2]
    try:
        async with asyncio.timeout(10):
            if kind == "data":
                channel = await tls.dial_data(address, client, 5, lambda _: None)
                await accepted  # (closed before the accepting end finished its handshake, uvloop's end resets)
                channel.close()
            else:
                reader, writer = await asyncio.open_connection(*address)
                await tls.dial_control(reader, writer, client, address[0], 5)
                await accepted
                writer.transport.abort()
    finally:
        listener.close()
    assert client.options & ssl.OP_NO_RENEGOTIATION, "dialling end"
    assert server.options & ssl.OP_NO_RENEGOTIATION, "accepting end"
