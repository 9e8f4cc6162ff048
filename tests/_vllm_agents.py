"""What the vLLM connector's agent tests share (no vLLM needed): a small KV geometry, vLLM-shaped KV
tensors, and the ``agents`` fixture that makes prefill and decode worker agents and closes them."""

from __future__ import annotations

import time

import pytest
import torch

from aio_datadist.integrations.vllm_agent import Agent, AgentOptions, kv_layout

LAYERS, BLOCKS, BLOCK_TOKENS, HEADS, DIM = 3, 16, 8, 2, 16


def kv_caches(seed: int | None) -> dict[str, torch.Tensor]:
    """One vLLM-shaped ``(K/V, blocks, heads, tokens, dim)`` bf16 tensor per layer: seeded, or zero."""
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    shape = (2, BLOCKS, HEADS, BLOCK_TOKENS, DIM)
    return {f"layers.{i}": (torch.randn(shape, generator=gen) if gen else torch.zeros(shape)).to(torch.bfloat16)
            for i in range(LAYERS)}


def wait(predicate, timeout_s: float = 10.0) -> None:
    """Poll ``predicate`` until it holds (bounded)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def agents():
    """``make(producer, **options)``: a prefill (seeded KV) or decode (zero KV) agent with its registered
    caches; every agent made is closed after the test."""
    made: list[Agent] = []

    def make(producer: bool, **options: object) -> tuple[Agent, dict[str, torch.Tensor]]:
        agent = Agent(producer, not producer, "engine-p" if producer else "engine-d",
                      AgentOptions(**options))  # type: ignore[arg-type]
        made.append(agent)
        caches = kv_caches(1 if producer else None)
        tensors, layout, _ = kv_layout(caches, BLOCKS, BLOCK_TOKENS)
        agent.register(tensors, layout)
        return agent, caches

    yield make
    for agent in made:
        agent.close()
