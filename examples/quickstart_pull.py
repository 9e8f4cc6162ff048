"""Quickstart: a DECODER pulls a request's KV cache from a PROMPT.

Both roles run in this one process and event loop, linked over loopback; in a
deployment each runs in its own serving process, usually on its own host,
and the code of each role stays the same.

1. The PROMPT listens and allocates a paged KV cache (K and V of 4 layers,
   blocks of 16 tokens) that peers address by ``BlocksCacheKey(PROMPT_ID, 0)``;
   prefill has written a request into its blocks 3, 4 and 9.
2. The DECODER allocates a cache of the same layout, links to the prompt and
   pulls those blocks into its own blocks 0, 1 and 2.
3. The DECODER also pulls a contiguous cache row by its ``CacheKey`` (the
   LLM-DataDist KvCacheManager flow): the pull consumes the key.

Run: ``python examples/quickstart_pull.py``; it ends with one ``OK: ...`` line
naming what it checked, or a ``FAILED: ...`` line and exit status 1.
"""

from __future__ import annotations

import asyncio
import sys
import traceback

import torch

from aio_datadist import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)

PROMPT_ID, DECODER_ID = 1, 2
LAYERS = 4
#: K and V of every layer: 2 * LAYERS tensors of [blocks, tokens per block, kv heads, head dim].
BLOCKS = CacheDesc(2 * LAYERS, (32, 16, 4, 64), DataType.DT_FLOAT16, Placement.HOST)
#: A contiguous cache: 2 * LAYERS tensors of [batch rows, tokens * kv heads * head dim].
ROWS = CacheDesc(2 * LAYERS, (2, 128 * 4 * 64), DataType.DT_FLOAT16, Placement.HOST)


def options(listen: str | None = None) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    if listen is not None:
        config.listen_ip_info = listen  # port 0: any free port, read back from listen_address
    return config.generate_options()


def check(ok: bool, what: str) -> None:
    """Stop the example with ``what`` when ``ok`` is false (an ``assert`` would vanish under ``python -O``)."""
    if not ok:
        raise RuntimeError(what)


async def main() -> None:
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as prompt, \
            LLMDataDist(LLMRole.DECODER, DECODER_ID) as decoder:
        # -- PROMPT: listen, allocate keyed caches, "prefill" one request -----------------
        await prompt.init(options(listen="127.0.0.1:0"))
        pkv = prompt.kv_cache_manager
        paged = pkv.allocate_blocks_cache(BLOCKS, BlocksCacheKey(PROMPT_ID, 0))
        request_blocks = [3, 4, 9]
        for tensor in paged.tensors:  # stands in for prefill writing K and V
            tensor[request_blocks] = torch.randn(tensor[request_blocks].shape).to(torch.float16)
        rows = pkv.allocate_cache(ROWS, [CacheKey(PROMPT_ID, req_id=42)])  # row 0 offered as request 42
        for tensor in rows.tensors:
            tensor[0] = torch.randn(tensor.shape[1:]).to(torch.float16)
        assert prompt.listen_address is not None
        host, port = prompt.listen_address  # what a real prompt publishes to its decoders

        # -- DECODER: allocate, link, pull -----------------------------------------------
        await decoder.init(options())
        dkv = decoder.kv_cache_manager
        local = dkv.allocate_blocks_cache(BLOCKS)
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = PROMPT_ID
        cluster.append_remote_ip_info(host, port)
        status, per_cluster = await decoder.link_clusters([cluster], timeout=3000)
        if status != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link failed: {per_cluster}")

        await dkv.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), local, src_blocks=request_blocks, dst_blocks=[0, 1, 2],
                              timeout=2000)
        check(all(torch.equal(d[[0, 1, 2]], s[request_blocks])
                  for d, s in zip(local.tensors, paged.tensors, strict=True)),
              "pull_blocks: local blocks [0, 1, 2] differ from the prompt's blocks")
        nbytes = len(request_blocks) * BLOCKS.size // BLOCKS.shape[0] * BLOCKS.num_tensors
        print(f"pull_blocks: blocks {request_blocks} of cluster {PROMPT_ID} -> local blocks [0, 1, 2], "
              f"{nbytes} bytes, verified")

        local_rows = dkv.allocate_cache(ROWS)
        await dkv.pull_cache(CacheKey(PROMPT_ID, req_id=42), local_rows, batch_index=1, timeout=2000)
        check(all(torch.equal(d[1], s[0]) for d, s in zip(local_rows.tensors, rows.tensors, strict=True)),
              "pull_cache: local row 1 differs from request 42's row")
        print("pull_cache: request 42 -> local row 1, verified")
        try:
            await dkv.pull_cache(CacheKey(PROMPT_ID, req_id=42), local_rows, batch_index=0, timeout=2000)
            again = LLMStatusCode.LLM_SUCCESS
        except LLMException as exc:  # a pull by CacheKey consumed the key on the prompt
            again = exc.status_code
        print(f"pulling request 42 again: {again.name}")
        check(again == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST,
              f"pulling request 42 again gave {again.name}, not LLM_KV_CACHE_NOT_EXIST")

        await decoder.unlink_clusters([cluster])
    print(f"OK: quickstart_pull: pulled blocks {request_blocks} ({nbytes} bytes) and request 42's row from cluster "
          f"{PROMPT_ID}, bytes equal; the consumed key refused with LLM_KV_CACHE_NOT_EXIST")


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except Exception as exc:
        traceback.print_exc()
        print(f"FAILED: quickstart_pull: {exc}")
        sys.exit(1)
