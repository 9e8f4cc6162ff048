"""``aio.RequireTransport``: a link or a transfer that would fall back to a slower transport is refused.

On each transport: the link that negotiated it works; one that negotiated
less is refused by ``link_clusters`` (and unlinked on both ends); a single
transfer that would take the data channels (a registered cache the peer
cannot share) is refused before a byte moves, by the requester and by an
owner that requires more than the requester asked for.
"""

from __future__ import annotations

import asyncio

import pytest
import torch

from aio_datadist import BlocksCacheKey, LLMConfig, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from aio_datadist.testing import blocks_desc, link_count, loopback_options, open_pair
from peers import NIXL_MISSING

PROMPT, DECODER = 21, 22


def cluster(remote_id: int, address: tuple[str, int]):
    from aio_datadist import LLMClusterInfo

    info = LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(*address)
    return info


async def _wait_unlinked(dd: LLMDataDist) -> None:
    for _ in range(100):
        if link_count(dd) == 0:
            return
        await asyncio.sleep(0.02)
    raise AssertionError("the refused link is still there")


def _zero(cache) -> bool:
    return all(int(torch.count_nonzero(t)) == 0 for t in cache.tensors)


@pytest.mark.parametrize("options, message", [
    ({"aio.RequireTransport": "rdma"}, "aio.RequireTransport"),
    ({"aio.RequireTransport": "nixl"}, "'nixl' needs aio.Transport=nixl"),
    ({"aio.RequireTransport": "local", "aio.Transport": "tcp"}, "'local' needs aio.Transport 'auto' or 'local'"),
])
def test_a_requirement_that_cannot_hold_is_refused_at_init(options, message):
    from aio_datadist.options import parse_options

    with pytest.raises(LLMException) as bad:
        parse_options(options)
    assert bad.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and message in str(bad.value)
    cfg = LLMConfig()
    with pytest.raises(LLMException):
        cfg.require_transport = "rdma"
    cfg.require_transport = "local"
    assert cfg.generate_options()["aio.RequireTransport"] == "local"


@pytest.mark.asyncio
@pytest.mark.parametrize("required, prompt_transport, negotiated", [
    ("local", "auto", "local"),
    ("tcp", "auto", "local"),
    ("tcp", "tcp", "tcp"),
])
async def test_a_link_that_meets_the_requirement_moves_bytes(required, prompt_transport, negotiated):
    async with open_pair(prompt_config={"transport": prompt_transport},
                         decoder_config={"require_transport": required}) as pair:
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0, 1], [0, 1])
        link = pair.decoder.stats().links[pair.prompt_cluster_id]
        assert link.transport == negotiated and link.kinds["pull"].transport == negotiated
        for got, want in zip(pair.decoder_blocks.tensors, pair.expected_blocks, strict=True):
            assert torch.equal(got[:2], want[:2])


@pytest.mark.asyncio
async def test_local_required_but_the_peer_does_not_share_refuses_the_link_on_both_ends(caplog):
    async with LLMDataDist(LLMRole.PROMPT, PROMPT) as prompt, LLMDataDist(LLMRole.DECODER, DECODER) as decoder:
        await prompt.init(loopback_options(listen=True, transport="tcp"))
        await decoder.init(loopback_options(require_transport="local"))
        assert prompt.listen_address is not None
        status, per_cluster = await decoder.link_clusters([cluster(PROMPT, prompt.listen_address)], timeout=3000)
        assert status == LLMStatusCode.LLM_LINK_FAILED and per_cluster == [LLMStatusCode.LLM_LINK_FAILED]
        assert any("aio.RequireTransport=local but the link to cluster 21 negotiated tcp" in r.getMessage()
                   for r in caplog.records)
        assert link_count(decoder) == 0
        await _wait_unlinked(prompt)
        assert decoder.stats().links == {}


@pytest.mark.asyncio
async def test_a_transfer_that_would_fall_back_to_tcp_is_refused_before_a_byte_moves():
    """Local required and a local link, but the prompt's cache is registered framework memory, which
    same-host links do not share: the pull is refused once the owner answers for the data channels, the
    channel is dropped, and nothing lands; a pull from an allocated cache still works after it."""
    async with open_pair(decoder_config={"require_transport": "local"}) as pair:
        desc = blocks_desc()
        owned = [torch.full(desc.shape, 7, dtype=desc.data_type.torch_dtype) for _ in range(desc.num_tensors)]
        pair.prompt.kv_cache_manager.register_blocks_cache(desc, owned, BlocksCacheKey(pair.prompt_cluster_id, 5))
        kv = pair.decoder.kv_cache_manager
        with pytest.raises(LLMException) as refused:
            await kv.pull_blocks(BlocksCacheKey(pair.prompt_cluster_id, 5), pair.decoder_blocks, [0, 1], [0, 1])
        assert refused.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert "aio.RequireTransport=local" in str(refused.value) and "would take tcp" in str(refused.value)
        await asyncio.sleep(0.3)
        assert _zero(pair.decoder_blocks)
        pull = pair.decoder.stats().links[pair.prompt_cluster_id].kinds["pull"]
        assert dict(pull.failures) == {"LLM_FEATURE_NOT_ENABLED": 1} and pull.in_flight == 0
        await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        assert torch.equal(pair.decoder_blocks.tensors[0][0], pair.expected_blocks[0][0])


@pytest.mark.asyncio
async def test_an_owner_that_requires_local_refuses_a_pull_over_tcp():
    """The prompt requires local; the decoder asked for TCP only. The link stands (the decoder asked for
    nothing), but a pull that would move over the data channels is refused by the owner, with the reason,
    before a byte moves."""
    async with open_pair(prompt_config={"require_transport": "local"}, decoder_config={"transport": "tcp"}) as pair:
        with pytest.raises(LLMException) as refused:
            await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0, 1], [0, 1])
        assert refused.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        assert "requires transport local" in str(refused.value) and "would take tcp" in str(refused.value)
        await asyncio.sleep(0.2)
        assert _zero(pair.decoder_blocks)
        served = pair.prompt.stats().links[pair.decoder_cluster_id].kinds["served_pull"]
        assert dict(served.failures) == {"LLM_FEATURE_NOT_ENABLED": 1} and served.transfers == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("requirer", ["decoder", "prompt"])
async def test_an_owner_that_requires_local_refuses_a_push_from_memory_it_cannot_map(requirer):
    """A local link, but the prompt pushes from registered framework memory (not shared): the push would
    take the data channels, and the decoder, which requires local, refuses it; its cache stays zero. A prompt
    that requires local refuses it itself, before a byte is sent."""
    required = {"require_transport": "local"}
    async with open_pair(**{f"{requirer}_config": required}) as pair:
        desc = blocks_desc()
        owned = [torch.full(desc.shape, 7, dtype=desc.data_type.torch_dtype) for _ in range(desc.num_tensors)]
        source = pair.prompt.kv_cache_manager.register_blocks_cache(desc, owned)
        with pytest.raises(LLMException) as refused:
            await pair.prompt.kv_cache_manager.push_blocks(pair.decoder_blocks_key, source, [0, 1], [0, 1])
        assert refused.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
        await asyncio.sleep(0.2)
        assert _zero(pair.decoder_blocks)
        if requirer == "prompt":
            assert "aio.RequireTransport=local" in str(refused.value) and "would take tcp" in str(refused.value)
            assert dict(pair.prompt.stats().links[pair.decoder_cluster_id].kinds["push"].failures) == {
                "LLM_FEATURE_NOT_ENABLED": 1}
            return
        assert "requires transport local" in str(refused.value)
        served = pair.decoder.stats().links[pair.prompt_cluster_id].kinds["served_push"]
        assert dict(served.failures) == {"LLM_FEATURE_NOT_ENABLED": 1} and served.transfers == 0


@pytest.mark.nixl
@pytest.mark.skipif(bool(NIXL_MISSING), reason=NIXL_MISSING or "")
@pytest.mark.asyncio
async def test_nixl_required_links_over_nixl_and_refuses_a_peer_without_it():
    nixl = {"transport": "nixl", "require_transport": "nixl"}
    async with open_pair(prompt_config={"transport": "nixl"}, decoder_config=nixl) as pair:
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0, 1], [0, 1])
        link = pair.decoder.stats().links[pair.prompt_cluster_id]
        assert link.transport == "nixl" and link.kinds["pull"].transport == "nixl"
    async with LLMDataDist(LLMRole.PROMPT, PROMPT) as prompt, LLMDataDist(LLMRole.DECODER, DECODER) as decoder:
        await prompt.init(loopback_options(listen=True, transport="tcp"))
        await decoder.init(loopback_options(**nixl))
        assert prompt.listen_address is not None
        status, _ = await decoder.link_clusters([cluster(PROMPT, prompt.listen_address)], timeout=5000)
        assert status == LLMStatusCode.LLM_LINK_FAILED
        await _wait_unlinked(prompt)
