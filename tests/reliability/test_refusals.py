"""A link's refusal is the server's word only when it proves it, and a peer's text never reaches a log raw.

A ``LINK_OK`` refusal used to carry no proof even with a shared secret: a
process in the path (a relay that cannot forge any proof) could swap the
server's answer for a refusal of its own, with the status code of its choice
and a text of up to 4096 characters that the dialler put verbatim into its
WARNING, newlines and terminal escapes included. With a secret the server now
proves every refusal to a client that proved itself (status and text), and a
dialler fails an unproven one as ``LLM_LINK_FAILED`` whatever it names. Every
text a peer sends is shown escaped (``wire.peer_text``), with or without a
secret.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

import pytest

from aio_datadist import LLMClusterInfo, LLMDataDist, LLMRole, LLMStatusCode, wire
from aio_datadist.testing import loopback_options
from relay import Relay

S = LLMStatusCode
SECRET = "s3cret-for-the-refusals"
FORGED = "ok\nCRITICAL aio_datadist.links forged line \x1b[31m\u202e"


class ForgedRefusal(Relay):
    """Passes the handshake through, then swaps the server's ``LINK_OK`` for a refusal of its own, with a
    status the dialler would otherwise report (``LLM_ALREADY_LINK``) and a text meant to forge a log line."""

    async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(wire.HEADER.size)
            _, _, length = wire.parse_header(head)
            writer.write(head + await reader.readexactly(length))  # HELLO_ACK, the server's own proof
            head = await reader.readexactly(wire.HEADER.size)
            _, req_id, length = wire.parse_header(head)
            await reader.readexactly(length)  # the server's LINK_OK: dropped
            ok = wire.LinkOk(status=int(S.LLM_ALREADY_LINK), cluster_id=0, role=0, link_token=bytes(32), channels=0,
                             boot_id=bytes(16), local_name=bytes(48), instance=bytes(32), proof=bytes(32), text=FORGED)
            writer.write(wire.encode_record(wire.Msg.LINK_OK, req_id, ok))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


def info_for(cluster_id: int, address: tuple[str, int]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = cluster_id
    info.append_remote_ip_info(*address)
    return info


def no_raw_text(caplog: pytest.LogCaptureFixture) -> None:
    said = [r.getMessage() for r in caplog.records if "forged line" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    assert all(m.isprintable() for m in said), said
    assert all("\\n" in m and "\\x1b" in m and "\\u202e" in m for m in said), said


@pytest.mark.asyncio
@pytest.mark.parametrize("secret", [SECRET, None], ids=["secret", "no_secret"])
async def test_a_refusal_forged_in_the_path_is_not_the_servers_word(caplog, secret):
    caplog.set_level(logging.WARNING, logger="aio_datadist")
    options = {} if secret is None else {"shared_secret": secret}
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 51), LLMDataDist(LLMRole.DECODER, 52)
    async with prompt, decoder:
        await prompt.init(loopback_options(listen=True, transport="tcp", **options))
        await decoder.init(loopback_options(transport="tcp", **options))
        async with ForgedRefusal(prompt.listen_address) as relay:
            _, rets = await decoder.link_clusters([info_for(51, relay.address)], timeout=3000)
        # With a secret the forged code is not reported: an unproven refusal is a failed link. Without one
        # nothing can be proven and the code is the peer's, as any peer could have refused.
        assert rets == [S.LLM_LINK_FAILED if secret else S.LLM_ALREADY_LINK]
        assert decoder.stats().links == {}
    no_raw_text(caplog)


@pytest.mark.asyncio
async def test_a_refusal_of_the_server_keeps_its_code_with_a_secret(caplog):
    """Two decoders of one cluster id: the second is refused ``LLM_ALREADY_LINK`` by the server, proven."""
    caplog.set_level(logging.WARNING, logger="aio_datadist")
    prompt = LLMDataDist(LLMRole.PROMPT, 61)
    first, second = LLMDataDist(LLMRole.DECODER, 62), LLMDataDist(LLMRole.DECODER, 62)
    async with prompt, first, second:
        await prompt.init(loopback_options(listen=True, transport="tcp", shared_secret=SECRET))
        await first.init(loopback_options(transport="tcp", shared_secret=SECRET))
        await second.init(loopback_options(transport="tcp", shared_secret=SECRET))
        assert (await first.link_clusters([info_for(61, prompt.listen_address)], timeout=3000))[1] == [S.LLM_SUCCESS]
        _, rets = await second.link_clusters([info_for(61, prompt.listen_address)], timeout=3000)
        assert rets == [S.LLM_ALREADY_LINK]
    said = [r.getMessage() for r in caplog.records if "peer refused" in r.getMessage()]
    assert said and all("unproven" not in m and "already linked" in m for m in said), said


class RewordedRefusal(Relay):
    """Passes the server's own refusal on with its status and proof, its text swapped for one of the relay's."""

    async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = await reader.readexactly(wire.HEADER.size)
            _, _, length = wire.parse_header(head)
            writer.write(head + await reader.readexactly(length))  # HELLO_ACK
            msg, req_id, length = wire.parse_header(await reader.readexactly(wire.HEADER.size))
            ok = wire.decode(msg, await reader.readexactly(length))
            assert ok.status == int(S.LLM_ALREADY_LINK) and ok.proof != bytes(32)
            ok = dataclasses.replace(ok, text="the relay's words " + FORGED)
            writer.write(wire.encode_record(wire.Msg.LINK_OK, req_id, ok))
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        writer.close()


@pytest.mark.asyncio
async def test_a_proven_refusal_whose_text_was_changed_in_the_path_is_not_the_servers_word(caplog):
    """The proof covers the refusal's text too: a relay that keeps the server's status and proof but swaps
    the text makes an unproven refusal (``LLM_LINK_FAILED``), not the server's ``LLM_ALREADY_LINK``."""
    caplog.set_level(logging.WARNING, logger="aio_datadist")
    prompt = LLMDataDist(LLMRole.PROMPT, 71)
    first, second = LLMDataDist(LLMRole.DECODER, 72), LLMDataDist(LLMRole.DECODER, 72)
    async with prompt, first, second:
        await prompt.init(loopback_options(listen=True, transport="tcp", shared_secret=SECRET))
        await first.init(loopback_options(transport="tcp", shared_secret=SECRET))
        await second.init(loopback_options(transport="tcp", shared_secret=SECRET))
        assert (await first.link_clusters([info_for(71, prompt.listen_address)], timeout=3000))[1] == [S.LLM_SUCCESS]
        async with RewordedRefusal(prompt.listen_address) as relay:
            _, rets = await second.link_clusters([info_for(71, relay.address)], timeout=3000)
        assert rets == [S.LLM_LINK_FAILED]
    no_raw_text(caplog)


def test_peer_text_escapes_what_is_not_printable():
    assert wire.peer_text(b"cluster 3 is already linked") == "cluster 3 is already linked"
    shown = wire.peer_text(FORGED.encode() + b"\xff\t\\")
    assert shown.isprintable()
    assert shown == "ok\\nCRITICAL aio_datadist.links forged line \\x1b[31m\\u202e\ufffd\\t\\"
