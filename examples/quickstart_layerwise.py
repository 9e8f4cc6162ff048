"""Quickstart: a PROMPT pushes a request's KV cache layer by layer while prefill computes it.

Both roles run in this one process and event loop, linked over loopback; in a
deployment each runs in its own serving process.

1. The DECODER keys its paged KV cache ``BlocksCacheKey(DECODER_ID, 0)`` so
   that peers can push into it, links to the prompt, picks the blocks the
   request goes to and opens a ``watch_pushes`` on them *before* telling the
   prompt where to push (the notice travels over your own side channel).
2. The PROMPT starts ``transfer_cache_async`` with an
   ``EventLayerSynchronizer``: the transfer waits for each layer's mark, and
   prefill calls ``record(layer)`` as soon as that layer's K and V are written,
   so layer ``i`` travels while layer ``i + 1`` is computed.
3. The DECODER awaits ``watch.layer(i)`` and could run its own layer ``i``
   then; the prompt awaits the task (per-destination status codes).

Run: ``python examples/quickstart_layerwise.py``; it ends with one ``OK: ...``
line naming what it checked, or a ``FAILED: ...`` line and exit status 1.
"""

from __future__ import annotations

import asyncio
import sys
import traceback

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    DataType,
    EventLayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
    TransferWithCacheKeyConfig,
)

PROMPT_ID, DECODER_ID = 1, 2
LAYERS = 8
#: K and V of every layer: tensors 2i and 2i + 1 hold layer i, each [blocks, tokens per block, kv heads, head dim].
BLOCKS = CacheDesc(2 * LAYERS, (32, 16, 4, 64), DataType.DT_FLOAT16, Placement.HOST)


def options(listen: str | None = None) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    if listen is not None:
        config.listen_ip_info = listen
    return config.generate_options()


def check(ok: bool, what: str) -> None:
    """Stop the example with ``what`` when ``ok`` is false (an ``assert`` would vanish under ``python -O``)."""
    if not ok:
        raise RuntimeError(what)


def compute_layer(cache_tensors: list[torch.Tensor], layer: int, blocks: list[int]) -> None:
    """Stands in for a model layer writing this request's K and V (runs in a worker thread)."""
    for tensor in cache_tensors[2 * layer:2 * layer + 2]:
        tensor[blocks] = torch.randn(tensor[blocks].shape).to(torch.float16)


async def main() -> None:
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt, \
            LLMDataDist(LLMRole.DECODER, DECODER_ID) as decoder:
        await prompt.init(options(listen="127.0.0.1:0"))
        await decoder.init(options())
        pkv, dkv = prompt.kv_cache_manager, decoder.kv_cache_manager
        prompt_cache = pkv.allocate_blocks_cache(BLOCKS)
        decoder_cache = dkv.allocate_blocks_cache(BLOCKS, BlocksCacheKey(DECODER_ID, 0))

        # -- DECODER: link, choose blocks, watch them, then tell the prompt -----------------
        assert prompt.listen_address is not None
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = PROMPT_ID
        cluster.append_remote_ip_info(*prompt.listen_address)
        status, per_cluster = await decoder.link_clusters([cluster], timeout=3000)
        if status != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link failed: {per_cluster}")
        decoder_blocks = [10, 11, 12, 20]
        with dkv.watch_pushes(decoder_cache, rows=decoder_blocks) as watch, \
                EventLayerSynchronizer(prompt, LAYERS) as layers_done:
            # (here the decoder sends decoder_blocks to the prompt over its side channel)

            # -- PROMPT: start the layer-wise push, then run prefill -------------------------
            prompt_blocks = [0, 1, 2, 3]
            task = pkv.transfer_cache_async(
                prompt_cache, layers_done, [TransferWithCacheKeyConfig(BlocksCacheKey(DECODER_ID, 0))],
                src_block_indices=prompt_blocks, dst_block_indices=decoder_blocks)

            async def prefill() -> None:
                for layer in range(LAYERS):
                    await asyncio.to_thread(compute_layer, prompt_cache.tensors, layer, prompt_blocks)
                    layers_done.record(layer)  # this layer may go now

            async def decode() -> None:
                for layer in range(LAYERS):
                    await watch.layer(layer)  # K and V of this layer are in place
                    for k in (2 * layer, 2 * layer + 1):
                        check(torch.equal(decoder_cache.tensors[k][decoder_blocks],
                                          prompt_cache.tensors[k][prompt_blocks]),
                              f"layer {layer}: tensor {k}'s blocks {decoder_blocks} differ from the prompt's")
                    print(f"decoder: layer {layer} landed in blocks {decoder_blocks}, verified")

            _, _, results = await asyncio.gather(prefill(), decode(), task)
        print(f"transfer_cache_async results: {[code.name for code in results]}")
        check(results == [LLMStatusCode.LLM_SUCCESS], f"transfer_cache_async returned {[c.name for c in results]}")
        await decoder.unlink_clusters([cluster])
    print(f"OK: quickstart_layerwise: {LAYERS} layers pushed one by one during prefill into decoder blocks "
          f"{decoder_blocks}, each layer's bytes equal on arrival; transfer_cache_async returned LLM_SUCCESS")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception as exc:
        traceback.print_exc()
        print(f"FAILED: quickstart_layerwise: {exc}")
        sys.exit(1)
