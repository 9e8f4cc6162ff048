"""CacheManager ``transfer_cache_async`` from a contiguous cache into destination blocks.

LLM-DataDist's CacheManager cuts the source row ``src_batch_index`` of each
tensor into pieces of ``dst_block_memory_size`` bytes and writes piece ``j``
into block ``dst_block_indices[j]`` of the destination (the last piece may be
shorter); its KvCacheManager refuses the case. Two v2 endpoints run in the
test's loop, the PROMPT pushing into the DECODER's blocks cache, by raw
addresses (``TransferConfig``) and by key (``TransferWithCacheKeyConfig``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import numpy
import pytest
import torch
from _v2peer import v2_options
from peers import DECODER_ID, PROMPT_ID, TRANSPORTS, cluster_info, endpoint, fill, port_of, same, snapshot

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    KvCache,
    LayerSynchronizer,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferConfig,
    TransferWithCacheKeyConfig,
)

pytestmark = pytest.mark.asyncio
S = LLMStatusCode
LAYERS = 2
#: the source: 2 layers (K0, V0, K1, V1) of 3 rows of 512 bytes
ROWS = CacheDesc(2 * LAYERS, (3, 256), DataType.DT_FLOAT16, Placement.HOST)
ROW_BYTES = 512


def blocks_of(block_bytes: int) -> CacheDesc:
    """A destination of 8 blocks of ``block_bytes`` bytes per tensor."""
    return CacheDesc(2 * LAYERS, (8, block_bytes // 2), DataType.DT_FLOAT16, Placement.HOST)


class Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index: int, timeout_in_millis: int | None) -> bool:
        return True


class Pair:
    def __init__(self, prompt: LLMDataDist, decoder: LLMDataDist) -> None:
        self.prompt, self.decoder = prompt, decoder
        self.pm, self.dm = prompt.cache_manager, decoder.cache_manager

    def source(self, seed: int = 3) -> KvCache:
        src = self.pm.allocate_cache(ROWS)
        fill(src, seed)
        return src

    def destination(self, block_bytes: int, key: bool = True) -> tuple[KvCache, list[torch.Tensor]]:
        dst = self.dm.allocate_blocks_cache(blocks_of(block_bytes), BlocksCacheKey(DECODER_ID, 0) if key else None)
        for t in dst.tensors:
            t.fill_(-5.0)
        return dst, snapshot(dst)


@contextlib.asynccontextmanager
async def v2_pair(transport: str) -> AsyncIterator[Pair]:
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt, LLMDataDist(LLMRole.DECODER, DECODER_ID) as decoder:
        await prompt.init(v2_options(listen=True, transport=transport, sync_kv_timeout=10000))
        await decoder.init(v2_options(transport=transport, sync_kv_timeout=10000))
        yield Pair(prompt, decoder)


async def link(pair: Pair) -> None:
    assert await pair.decoder.link_clusters([cluster_info(PROMPT_ID, port_of(pair.prompt))]) == (
        S.LLM_SUCCESS, [S.LLM_SUCCESS])


def expected(before: list[torch.Tensor], sources: list[torch.Tensor], row: int, blocks: list[int],
             size: int) -> list[torch.Tensor]:
    """``before`` with piece ``j`` of row ``row`` of ``sources[t]`` in block ``blocks[j]`` of tensor ``t``
    (tensors past ``sources`` kept)."""
    out = [t.clone() for t in before]
    for t, tensor in enumerate(out[:len(sources)]):
        flat, block_bytes = tensor.view(torch.uint8).view(tensor.shape[0], -1), tensor[0].numel() * 2
        source = sources[t][row].view(torch.uint8)
        for j, block in enumerate(blocks):
            piece = source[j * size:min((j + 1) * size, ROW_BYTES)]
            assert piece.numel() <= block_bytes
            flat[block, :piece.numel()] = piece
    return out


# (block bytes of the destination, dst_block_memory_size, blocks): pieces that divide the row, a shorter
# last piece, and fewer blocks than the row has pieces
SPLITS = [(128, 128, [6, 1, 3, 0]), (192, 192, [2, 7, 4]), (128, 128, [5, 2])]


@pytest.mark.loops_take_turns
@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("by", ["key", "addrs"])
@pytest.mark.parametrize("split", SPLITS, ids=["whole", "shorter_last", "fewer"])
async def test_a_row_goes_into_blocks_piece_by_piece(transport: str, by: str, split: Any) -> None:
    block_bytes, size, blocks = split
    async with v2_pair(transport) as pair:
        dst, before = pair.destination(block_bytes)
        await link(pair)
        src = pair.source()
        if by == "key":  # a BlocksCacheKey destination takes source row 0 (LLM-DataDist sends row 0 then)
            config: Any = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0))
            row = 0
        else:
            config = TransferConfig(DECODER_ID, dst.per_device_tensor_addrs[0], src_batch_index=2)
            row = 2
        task = pair.pm.transfer_cache_async(src, Ready(), [config], None, blocks, dst_block_memory_size=size)
        assert await task == [S.LLM_SUCCESS]
        assert same(snapshot(dst), expected(before, src.tensors, row, blocks, size))


@pytest.mark.parametrize("transport", TRANSPORTS)
async def test_layer_ranges_map_source_layers_onto_destination_layers(transport: str) -> None:
    async with v2_pair(transport) as pair:
        dst, before = pair.destination(192)
        await link(pair)
        src = pair.source()
        config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0), range(1, 2), range(0, 1))
        task = pair.pm.transfer_cache_async(src, Ready(), [config], [], [3, 4, 5], dst_block_memory_size=192)
        assert await task == [S.LLM_SUCCESS]
        # source layer 1 (tensors 2, 3) lands in destination layer 0 (tensors 0, 1); layer 1 is kept
        assert same(snapshot(dst), expected(before, src.tensors[2:], 0, [3, 4, 5], 192))


async def test_a_destination_block_of_another_size_is_refused_before_any_byte_lands() -> None:
    """By key, the destination's blocks must be ``dst_block_memory_size`` bytes, as LLM-DataDist checks; the
    shorter last piece (its own request) is not sent once the whole pieces were refused."""
    async with v2_pair("tcp") as pair:
        dst, before = pair.destination(128)
        await link(pair)
        src = pair.source()
        config = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0))
        task = pair.pm.transfer_cache_async(src, Ready(), [config], None, [0, 1, 2], dst_block_memory_size=192)
        with pytest.raises(LLMException) as info:
            await task
        assert info.value.status_code == S.LLM_PARAM_INVALID
        assert await task.get_results() == [S.LLM_PARAM_INVALID]
        await asyncio.sleep(0.1)
        assert same(snapshot(dst), before)


async def test_bad_input_is_refused_at_the_call_with_nothing_sent() -> None:
    async with v2_pair("tcp") as pair:
        dst, before = pair.destination(128)
        await link(pair)
        src = pair.source()
        key = TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0))
        cases: list[tuple[str, Any, tuple]] = [
            ("dst_block_memory_size", key, ([0, 1], None)),
            ("dst_block_memory_size", key, ([0, 1], 0)),
            ("dst_block_memory_size", key, ([0], ROW_BYTES + 2)),
            ("dst_block_memory_size", key, ([0, 1], numpy.array([128, 128]))),  # was a raw ValueError
            ("dst_block_memory_size", key, ([0, 1], torch.tensor([128, 128]))),  # was a raw RuntimeError
            ("dst_block_memory_size", key, (None, numpy.array([128, 128]))),
            ("dst_block_memory_size", key, ([0, 1], 128.0)),
            ("dst_block_memory_size", key, (None, False)),  # was taken as unset
            ("dst_block_indices", key, ([0, 1, 2, 3, 4], 128)),  # five pieces of 128 bytes in a 512-byte row
            ("dst_block_indices", key, ([0, 1, 2, 3], 192)),  # 192 + 192 + 128: three pieces
            ("dst_block_indices", key, ([1, 1], 128)),
            ("dst_block_indices", key, ([-1], 128)),
            ("dst_block_indices", key, (numpy.array(0), 128)),  # no length: was a raw TypeError
            ("transfer_configs[0].cache_key", TransferWithCacheKeyConfig(CacheKeyByIdAndIndex(DECODER_ID, 1, 0)),
             ([0], 128)),
            ("transfer_configs[0].dst_addrs", TransferConfig(DECODER_ID, dst.per_device_tensor_addrs[0][:2]),
             ([0], 128)),
            ("transfer_configs[0].src_batch_index",
             TransferConfig(DECODER_ID, dst.per_device_tensor_addrs[0], src_batch_index=3), ([0], 128)),
        ]
        for arg, config, (blocks, size) in cases:
            with pytest.raises(LLMException) as info:
                pair.pm.transfer_cache_async(src, Ready(), [config], None, blocks, dst_block_memory_size=size)
            assert info.value.status_code == S.LLM_PARAM_INVALID, (arg, info.value)
            assert f"'{arg}" in str(info.value), (arg, str(info.value))
        with pytest.raises(ValueError):  # a negative size, as LLM-DataDist's uint64 check
            pair.pm.transfer_cache_async(src, Ready(), [key], None, [0], dst_block_memory_size=-128)
        await asyncio.sleep(0.1)
        assert same(snapshot(dst), before)


async def test_the_kv_cache_manager_refuses_a_cache_into_blocks_as_llm_datadist() -> None:
    async with endpoint(LLMRole.PROMPT, PROMPT_ID, listen=True) as prompt, endpoint(LLMRole.DECODER,
                                                                                   DECODER_ID) as decoder:
        dst = decoder.kv_cache_manager.allocate_blocks_cache(blocks_of(128), BlocksCacheKey(DECODER_ID, 0))
        before = snapshot(dst)
        assert await decoder.link_clusters([cluster_info(PROMPT_ID, port_of(prompt))]) == (
            S.LLM_SUCCESS, [S.LLM_SUCCESS])
        src = prompt.kv_cache_manager.allocate_cache(ROWS)
        fill(src, 4)
        config = TransferConfig(DECODER_ID, dst.per_device_tensor_addrs[0])
        with pytest.raises(LLMException) as info:
            prompt.kv_cache_manager.transfer_cache_async(src, Ready(), [config], None, [0, 1],
                                                         dst_block_memory_size=128)
        assert info.value.status_code == S.LLM_PARAM_INVALID and "'dst_block_indices'" in str(info.value)
        await asyncio.sleep(0.1)
        assert same(snapshot(dst), before)
