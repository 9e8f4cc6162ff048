"""A linked NIXL peer that lies in its records: what it can and cannot make us keep or do.

The attacker is the decoder of an in-process pair: it sends ``Msg.NIXL``
records of its own making on its link (``NixlPeer._send``).
"""

from __future__ import annotations

import asyncio
import struct

import pytest
from peers import DECODER_ID, NIXL_MISSING, PROMPT_ID, linked_pair

from aio_datadist.testing import link_to, nixl_agent_of
from aio_datadist.transport import nixl

NIXL = {"transport": "nixl"}

needs_nixl = pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING)

pytestmark = [pytest.mark.asyncio, pytest.mark.nixl, pytest.mark.usefixtures("fork_server")]

_AGENT = b"nixlSerDes|Agent"


def renamed(metadata: bytes, name: bytes) -> bytes:
    """NIXL agent metadata naming agent ``name`` (its connection info unchanged: it still reaches the agent)."""
    assert metadata.startswith(_AGENT)
    (length,) = struct.unpack_from("<Q", metadata, len(_AGENT))
    return _AGENT + struct.pack("<Q", len(name)) + name + metadata[len(_AGENT) + 8 + length:]


async def on_worker(dd, fn):
    """``fn(nixl_agent)`` run on ``dd``'s NIXL worker (the one thread that calls into its agent)."""
    return await nixl_agent_of(dd).start(fn, "test")


@needs_nixl
async def test_metadata_naming_another_agent_is_not_kept_loaded():
    """An OFFER (or HELLO) whose metadata names an agent other than the peer's is refused, and that other
    agent does not stay loaded in ours: before, every such record left one more remote agent (its sections
    and a UCX endpoint) in our agent for the endpoint's life, after the link was gone."""
    async with linked_pair(prompt_config=NIXL, decoder_config=NIXL) as pair:
        attacker = link_to(pair.decoder, PROMPT_ID).nixl
        victim_link = link_to(pair.prompt, DECODER_ID)
        victim = victim_link.nixl
        assert attacker.usable() and victim.usable()
        metadata = nixl_agent_of(pair.decoder).metadata
        names = [b"forged-%03d" % n for n in range(20)]
        for n, name in enumerate(names):
            attacker._send(nixl.OFFER, 1000 + n, 16, 512, (1 << 20,), renamed(metadata, name))
        async with asyncio.timeout(10):
            while victim._pending:  # every load ran (and failed: the link goes on, those caches take TCP)
                await asyncio.sleep(0.01)
        assert link_to(pair.prompt, DECODER_ID) is victim_link and victim.usable()
        await pair.unlink()
        loaded = await on_worker(pair.prompt, lambda agent: [n for n in names
                                                             if agent.check_remote_metadata(n.decode())])
        assert loaded == [], f"{len(loaded)} agents named by the peer's metadata stay loaded"
