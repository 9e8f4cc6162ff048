"""Disaggregated generation with a real transformer: prefill in one process, decode in another.

A small Llama (``transformers``' ``LlamaForCausalLM``: 4 layers, hidden 128,
4 attention heads, 2 KV heads, vocabulary 512) with seeded random weights
runs in two processes, the way a prefill/decode split serves it:

* the DECODE process (``LLMRole.DECODER``, spawned) owns a paged KV cache
  (K and V of each layer as separate tensors: tensor ``2l`` is K of layer
  ``l``, ``2l+1`` its V; blocks of 16 tokens, ``[num_blocks, 16, kv_heads,
  head_dim]`` fp32) keyed ``BlocksCacheKey(DECODE_ID, 0)``. Per request it
  takes free blocks, starts ``kv.watch_pushes`` on them and sends the prompt
  and its block table to the prefill over the side channel;
* the PREFILL process (``LLMRole.PROMPT``, this one) runs the model's forward
  over the prompt. Its ``PagedKvWriter`` (a ``DynamicCache`` subclass) copies
  each layer's K and V into the prefill's own paged blocks as the attention
  produces them and ``record``s the layer on an ``EventLayerSynchronizer``;
  ``kv.transfer_cache_async`` pushes every recorded layer into the decoder's
  blocks while the forward goes on with the next layers. It then sends the
  first generated token;
* the decoder rebuilds a ``DynamicCache`` from its blocks layer by layer as
  ``watch.layer(l)`` reports each one in place, and decodes greedily.

The prefill process also runs the same requests through a plain
single-process ``model.generate(..., do_sample=False)`` and checks that the
decoder's tokens are equal and that the K and V it received are
bit-identical to a local prefill. Side-channel notices (listen port, block
tables, first tokens, results) travel over a multiprocessing pipe, where
serving frameworks use ZMQ.

Run: ``python examples/disaggregated_generation.py [--new-tokens 16] [--prompts 5,23,37,50]``
(needs ``pip install -e ".[examples]"``). Nothing is downloaded: prompts are
token ids and the weights come from ``torch.manual_seed``.
"""

from __future__ import annotations

import argparse
import asyncio
import inspect
import multiprocessing as mp
import random
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

try:
    from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM
except ImportError:  # pragma: no cover - depends on the environment
    sys.exit('this example needs transformers: pip install -e ".[examples]"')

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

PREFILL_ID, DECODE_ID = 1, 2
SEED = 0
# transformers 5.24 names the forward's cache argument ``cache``; earlier releases ``past_key_values``.
CACHE_ARG = "cache" if "cache" in inspect.signature(LlamaForCausalLM.forward).parameters else "past_key_values"
BLOCK_TOKENS = 16
NUM_BLOCKS = 64  # per process: 1024 tokens of room
LAYER_TIMEOUT_S = 30.0
RUN_LIMIT_S = 180.0
DEFAULT_PROMPTS = (5, 23, 37, 50)  # prompt lengths: none a multiple of the block size


# -- the model --------------------------------------------------------------------------


def model_config() -> LlamaConfig:
    # initializer_range 0.1 (not Llama's 0.02) gives random weights whose greedy output
    # depends on the whole context instead of repeating one token.
    return LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                       initializer_range=0.1, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_model() -> LlamaForCausalLM:
    """The same weights in every process: seeded, nothing downloaded."""
    torch.set_num_threads(1)  # two processes share the machine; one thread each also fixes the numerics
    torch.manual_seed(SEED)
    return LlamaForCausalLM(model_config()).eval()


@dataclass(frozen=True)
class PagedLayout:
    """Where the K and V of a model live in a blocks cache of aio_datadist."""

    layers: int
    kv_heads: int
    head_dim: int
    block_tokens: int = BLOCK_TOKENS
    num_blocks: int = NUM_BLOCKS

    @classmethod
    def of(cls, config: LlamaConfig) -> PagedLayout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, config.num_key_value_heads, head_dim)

    @property
    def desc(self) -> CacheDesc:
        shape = (self.num_blocks, self.block_tokens, self.kv_heads, self.head_dim)
        return CacheDesc(2 * self.layers, shape, DataType.DT_FLOAT, Placement.HOST)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_tokens)


def write_blocks(tensor: torch.Tensor, blocks: list[int], states: torch.Tensor) -> None:
    """Scatter ``states`` ``[1, kv_heads, tokens, head_dim]`` over ``blocks`` of one cache tensor."""
    tokens = states.shape[2]
    padded = states.new_zeros((len(blocks) * tensor.shape[1], *tensor.shape[2:]))
    padded[:tokens] = states[0].transpose(0, 1)
    tensor.index_copy_(0, torch.tensor(blocks), padded.view(len(blocks), *tensor.shape[1:]))


def read_blocks(tensor: torch.Tensor, blocks: list[int], tokens: int) -> torch.Tensor:
    """Gather the first ``tokens`` tokens of ``blocks`` as ``[1, kv_heads, tokens, head_dim]``."""
    gathered = tensor.index_select(0, torch.tensor(blocks)).flatten(0, 1)[:tokens]
    return gathered.transpose(0, 1).unsqueeze(0).contiguous()


class PagedKvWriter(DynamicCache):
    """A ``DynamicCache`` that also copies each layer's new K and V into paged blocks.

    ``update`` is where the attention hands over a layer's K and V: once they
    are copied, the layer is final and ``on_layer(layer)`` tells the transfer
    it may go, while the forward continues with the attention of this layer
    and the layers after it.
    """

    def __init__(self, config: LlamaConfig, tensors: list[torch.Tensor], blocks: list[int],
                 on_layer: Any) -> None:
        super().__init__(config=config)
        self._tensors = tensors
        self._blocks = blocks
        self._on_layer = on_layer

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int,
               *args: Any, **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = super().update(key_states, value_states, layer_idx, *args, **kwargs)
        write_blocks(self._tensors[2 * layer_idx], self._blocks, keys)
        write_blocks(self._tensors[2 * layer_idx + 1], self._blocks, values)
        self._on_layer(layer_idx)
        return keys, values


class BlockPool:
    """Free block ids of one paged cache, as a serving framework's block manager keeps them."""

    def __init__(self, num_blocks: int, seed: int) -> None:
        self._free = list(range(num_blocks))
        random.Random(seed).shuffle(self._free)  # non-contiguous tables, as after some traffic

    def take(self, count: int) -> list[int]:
        if count > len(self._free):
            raise RuntimeError(f"out of KV blocks: {count} wanted, {len(self._free)} free")
        taken, self._free = self._free[:count], self._free[count:]
        return taken

    def free(self, blocks: list[int]) -> None:
        self._free.extend(blocks)


# -- the side channel -------------------------------------------------------------------


async def recv(conn: Any) -> Any:
    """The next message on a pipe, waited for by the event loop (no thread, no polling)."""
    if not conn.poll():
        loop = asyncio.get_running_loop()
        readable = loop.create_future()
        loop.add_reader(conn.fileno(), lambda: readable.done() or readable.set_result(None))
        try:
            await readable
        finally:
            loop.remove_reader(conn.fileno())
    return conn.recv()


def options(*, listen: bool) -> dict[str, str]:
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 10_000
    if listen:
        config.listen_ip_info = "127.0.0.1:0"
    return config.generate_options()


# -- the PREFILL process ----------------------------------------------------------------


def prefill_forward(model: LlamaForCausalLM, prompt: list[int], tensors: list[torch.Tensor],
                    blocks: list[int], on_layer: Any) -> int:
    """The prompt's forward (in a worker thread); returns the first generated token."""
    ids = torch.tensor([prompt])
    writer = PagedKvWriter(model.config, tensors, blocks, on_layer)
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids), use_cache=True, **{CACHE_ARG: writer})
    return int(out.logits[0, -1].argmax())


async def prefill_main(model: LlamaForCausalLM, side: Any) -> list[dict]:
    """Serve the decoder's requests until it reports its results (returned)."""
    layout = PagedLayout.of(model.config)
    async with LLMDataDist(LLMRole.PROMPT, PREFILL_ID) as dd:
        await dd.init(options(listen=True))
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(layout.desc)  # the prefill's own paged KV store
        pool = BlockPool(layout.num_blocks, seed=1)
        side.send(("hello", dd.listen_address[1]))
        to_decoder = [TransferWithCacheKeyConfig(BlocksCacheKey(DECODE_ID, 0))]
        loop = asyncio.get_running_loop()
        while True:
            message = await recv(side)
            if message[0] == "done":
                return message[1]
            if message[0] == "error":
                raise RuntimeError(f"the decode process failed:\n{message[1]}")
            _, req_id, prompt, dst_blocks = message
            src_blocks = pool.take(layout.blocks_for(len(prompt)))
            recorded: list[float] = []
            confirmed: list[float] = []
            with EventLayerSynchronizer(dd, layout.layers) as sync:

                def on_layer(layer: int) -> None:  # runs in the forward's thread
                    recorded.append(time.perf_counter())
                    sync.record(layer)

                start = time.perf_counter()
                task = kv.transfer_cache_async(cache, sync, to_decoder, src_block_indices=src_blocks,
                                               dst_block_indices=dst_blocks)
                for layer in range(layout.layers):
                    task.layer(layer).add_done_callback(lambda _: confirmed.append(time.perf_counter()))
                try:
                    first = await loop.run_in_executor(None, prefill_forward, model, prompt, cache.tensors,
                                                       src_blocks, on_layer)
                    forward_done = time.perf_counter()
                    results = await task
                except BaseException:
                    task.cancel()
                    raise
            pool.free(src_blocks)
            assert results == [LLMStatusCode.LLM_SUCCESS], results

            def ms(stamps: list[float]) -> str:
                return " ".join(f"{(t - start) * 1e3:.1f}" for t in stamps)

            print(f"[prefill] request {req_id}: {len(prompt)} tokens in blocks {src_blocks} -> decoder blocks "
                  f"{dst_blocks}; forward {(forward_done - start) * 1e3:.1f} ms; layers recorded at "
                  f"[{ms(recorded)}] ms, in place at the decoder at [{ms(confirmed)}] ms", flush=True)
            side.send(("prefilled", req_id, first))


# -- the DECODE process -----------------------------------------------------------------


def greedy_decode(model: LlamaForCausalLM, cache: DynamicCache, first: int, prompt_len: int,
                  new_tokens: int) -> list[int]:
    """Greedy decoding from a cache that holds the prompt, as generate's decode steps run."""
    tokens = [first]
    with torch.no_grad():
        while len(tokens) < new_tokens:
            seen = prompt_len + len(tokens)
            out = model(torch.tensor([[tokens[-1]]]), attention_mask=torch.ones(1, seen, dtype=torch.long),
                        use_cache=True, **{CACHE_ARG: cache})
            tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


async def decode_main(side: Any, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    model = build_model()
    layout = PagedLayout.of(model.config)
    results = []
    async with LLMDataDist(LLMRole.DECODER, DECODE_ID) as dd:
        await dd.init(options(listen=False))
        kv = dd.kv_cache_manager
        cache = kv.allocate_blocks_cache(layout.desc, BlocksCacheKey(DECODE_ID, 0))
        pool = BlockPool(layout.num_blocks, seed=2)
        hello, port = await recv(side)
        assert hello == "hello", hello
        peer = LLMClusterInfo()
        peer.remote_cluster_id = PREFILL_ID
        peer.append_remote_ip_info("127.0.0.1", port)
        status, per_cluster = await dd.link_clusters([peer], timeout=5000)
        if status != LLMStatusCode.LLM_SUCCESS:
            raise RuntimeError(f"link_clusters failed: {per_cluster}")
        for req_id, prompt in enumerate(prompts):
            blocks = pool.take(layout.blocks_for(len(prompt)))
            start = time.perf_counter()
            hf_cache = DynamicCache(config=model.config)
            with kv.watch_pushes(cache, rows=blocks) as watch:  # before the prefill may push
                side.send(("prefill", req_id, prompt, blocks))
                for layer in range(layout.layers):
                    async with asyncio.timeout(LAYER_TIMEOUT_S):
                        await watch.layer(layer)
                    hf_cache.update(read_blocks(cache.tensors[2 * layer], blocks, len(prompt)),
                                    read_blocks(cache.tensors[2 * layer + 1], blocks, len(prompt)), layer)
            landed = time.perf_counter()
            async with asyncio.timeout(LAYER_TIMEOUT_S):
                prefilled, got_id, first = await recv(side)
            assert (prefilled, got_id) == ("prefilled", req_id), (prefilled, got_id)
            tokens = greedy_decode(model, hf_cache, first, len(prompt), new_tokens)
            done = time.perf_counter()
            pool.free(blocks)
            print(f"[decode]  request {req_id}: {layout.layers} layers landed in {(landed - start) * 1e3:.1f} ms, "
                  f"{new_tokens} tokens decoded in {(done - landed) * 1e3:.1f} ms: {tokens}", flush=True)
            # numpy arrays travel by value (torch tensors would go through shared memory that
            # disappears with this process)
            kv_states = [(hf_cache.layers[layer].keys[:, :, :len(prompt)].numpy().copy(),
                          hf_cache.layers[layer].values[:, :, :len(prompt)].numpy().copy())
                         for layer in range(layout.layers)]
            results.append({"tokens": tokens, "kv": kv_states})
        await dd.unlink_clusters([peer])
    return results


# -- processes --------------------------------------------------------------------------


def run_decode(side: Any, prompts: list[list[int]], new_tokens: int) -> None:
    try:
        side.send(("done", asyncio.run(decode_main(side, prompts, new_tokens))))
    except BaseException:
        side.send(("error", traceback.format_exc()))
        raise


def reference(model: LlamaForCausalLM, prompt: list[int], new_tokens: int) -> dict:
    """Single-process ground truth: model.generate's tokens and the prompt's K and V."""
    ids = torch.tensor([prompt])
    mask = torch.ones_like(ids)
    with torch.no_grad():
        generated = model.generate(ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                   do_sample=False)
        cache = DynamicCache(config=model.config)
        model(ids, attention_mask=mask, use_cache=True, **{CACHE_ARG: cache})
    return {"tokens": generated[0, len(prompt):].tolist(),
            "kv": [(layer.keys.numpy(), layer.values.numpy()) for layer in cache.layers]}


def make_prompts(lengths: list[int], vocab: int) -> list[list[int]]:
    rng = random.Random(SEED)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--new-tokens", type=int, default=16, help="tokens to generate per prompt (default 16)")
    parser.add_argument("--prompts", default=",".join(map(str, DEFAULT_PROMPTS)),
                        help="prompt lengths in tokens, comma-separated (default %(default)s)")
    args = parser.parse_args(argv)
    try:
        args.lengths = [int(x) for x in args.prompts.split(",") if x.strip()]
    except ValueError:
        parser.error(f"--prompts must be comma-separated token counts, got {args.prompts!r}")
    if not args.lengths or min(args.lengths) < 1 or args.new_tokens < 1:
        parser.error("prompt lengths and --new-tokens must be >= 1")
    room = NUM_BLOCKS * BLOCK_TOKENS
    if max(args.lengths) > room:
        parser.error(f"prompts of at most {room} tokens fit in the {NUM_BLOCKS} blocks of the example")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    config = model_config()
    prompts = make_prompts(args.lengths, config.vocab_size)
    print(f"Llama {config.num_hidden_layers} layers, hidden {config.hidden_size}, {config.num_attention_heads} heads, "
          f"{config.num_key_value_heads} KV heads, vocab {config.vocab_size}, seeded random weights; paged KV in "
          f"blocks of {BLOCK_TOKENS} tokens, fp32; prompts of {args.lengths} tokens, {args.new_tokens} new tokens each",
          flush=True)
    ctx = mp.get_context("spawn")
    side, side_decode = ctx.Pipe()
    decode = ctx.Process(target=run_decode, args=(side_decode, prompts, args.new_tokens), name="decode",
                         daemon=True)
    start = time.perf_counter()
    decode.start()
    side_decode.close()  # the decoder's end lives in the decoder: its exit reads as EOF here
    try:
        # This process is the prefill. The ground truth first, while the decoder starts up.
        model = build_model()
        expected = [reference(model, prompt, args.new_tokens) for prompt in prompts]
        results = asyncio.run(asyncio.wait_for(prefill_main(model, side), RUN_LIMIT_S))
        decode.join(30)
        ok = decode.exitcode == 0
        for req_id, (got, want) in enumerate(zip(results, expected)):
            same_tokens = got["tokens"] == want["tokens"]
            pairs = [(a, b) for got_kv, want_kv in zip(got["kv"], want["kv"]) for a, b in zip(got_kv, want_kv)]
            same_kv = all(np.array_equal(a, b) for a, b in pairs)
            close_kv = all(a.shape == b.shape and np.allclose(a, b, rtol=0, atol=1e-5) for a, b in pairs)
            kv_note = "bit-identical to" if same_kv else ("within 1e-5 of" if close_kv else "DIFFERENT from")
            print(f"request {req_id} ({len(prompts[req_id])} tokens): transferred K,V {kv_note} a local prefill's; "
                  f"tokens {'equal to' if same_tokens else 'DIFFERENT from'} model.generate"
                  + ("" if same_tokens else f" {want['tokens']}"), flush=True)
            ok = ok and same_tokens and close_kv
        print(f"{'OK' if ok else 'FAILED'}: disaggregated_generation: {len(prompts)} prompts, disaggregated tokens "
              f"{'equal' if ok else 'NOT equal'} to single-process model.generate "
              f"({time.perf_counter() - start:.1f} s)", flush=True)
        return 0 if ok else 1
    except Exception as exc:
        print(f"FAILED: disaggregated_generation: {exc!r}", flush=True)
        return 1
    finally:
        if decode.is_alive():
            decode.kill()
        decode.join(10)


if __name__ == "__main__":
    sys.exit(main())
