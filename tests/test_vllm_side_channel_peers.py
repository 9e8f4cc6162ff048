"""The vLLM connector's decode against side-channel peers that are not (or no longer) the prefill its request
names: another engine at the address in ``kv_transfer_params``, a connection that went silent on the way.

Agents on real loopback sockets, as in ``tests/test_vllm_connector_logic.py``; no vLLM needed.
"""

from __future__ import annotations

import time

import _vllm_agents
import torch
from _vllm_agents import BLOCK_TOKENS, wait

from aio_datadist.integrations.vllm_wire import RemotePrefill, parse_transfer_params, transfer_params

agents = _vllm_agents.agents  # the fixture


def _remote(engine_id: str, side_channel: tuple[str, int], req: str, blocks: list[int]) -> RemotePrefill:
    host, port = side_channel
    return parse_transfer_params(transfer_params(engine_id=engine_id, request_id=req, host=host, port=port,
                                                 block_ids=blocks, num_tokens=len(blocks) * BLOCK_TOKENS))


def test_a_side_channel_that_answers_as_another_engine_is_not_pulled_from(agents) -> None:
    """``kv_transfer_params`` name engine ``engine-p`` but their address leads to engine ``engine-q`` (a prefill
    restarted on that port, a stale or misrouted proxy entry), which holds a request of the same id (a proxy
    that reuses its request ids on a retry): the decode must not claim it there, read its blocks as the
    request's, nor make ``engine-q`` free them under its own decode."""
    named, _ = agents(True)  # engine-p, the one the request names
    other, _ = agents(True)
    other.engine_id = "engine-q"
    decode, d_kv = agents(False)
    other.holds.add("r1", lease_s=60)
    named.holds.add("r1", lease_s=60)
    remote = _remote("engine-p", other.side_channel, "r1", [5, 9])  # engine-p's request, engine-q's address
    decode.start_pull("d1", remote, [2, 4])
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d1"}, {"d1"}, {2, 4})  # failed: vLLM recomputes
    assert not any(t.any() for t in d_kv.values())  # nothing of engine-q's landed
    decode.release_unpulled(remote)  # nor does a release free engine-q's request
    time.sleep(0.2)
    assert "r1" in other.holds.held and other.holds.held["r1"].owner is None
    assert not other.holds.take_released()
    # the same side channel still serves requests that name engine-q
    decode.start_pull("d2", _remote("engine-q", other.side_channel, "r1", [5]), [6])
    wait(lambda: not decode.pulls.pending(), 2.5)
    assert decode.pulls.take_finished() == ({"d2"}, set(), set())
    assert any(t[:, 6].any() for t in d_kv.values())
    assert torch.count_nonzero(torch.stack([t[:, [2, 4]] for t in d_kv.values()])) == 0
