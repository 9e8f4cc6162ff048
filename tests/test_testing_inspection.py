"""The plugin's inspection helpers (``engine_state``, ``link_to``, ...): what they report about live endpoints."""

from __future__ import annotations

import pytest

from aio_datadist import KvCache, LLMClusterInfo, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from aio_datadist.devices.host import round_up
from aio_datadist.testing import (
    admission_of,
    engine_state,
    handshakes_in_progress,
    link_count,
    link_table_of,
    link_to,
    links_of,
    loopback_options,
    nixl_agent_of,
    registry_of,
    rows_desc,
    runtime_of,
    share_listener_of,
    usable_link,
)

S = LLMStatusCode
HELPERS = (runtime_of, registry_of, engine_state, link_table_of, links_of, link_count, handshakes_in_progress,
           admission_of, share_listener_of, nixl_agent_of)

pytestmark = pytest.mark.asyncio


def held_by(cache: KvCache) -> int:
    """What an allocated cache counts against the cap: its tensors, each from a page of its own."""
    return sum(round_up(t.numel() * t.element_size()) for t in cache.tensors)


async def test_engine_state_counts_what_an_endpoint_holds_and_a_pull_gives_back(datadist_pair):
    pair = datadist_pair
    before = engine_state(pair.prompt)
    assert set(before) == {"pending tokens", "socket jobs", "copy jobs", "registered bytes", "caches",
                           "claimed keys", "serving registered"}
    assert before["caches"] == 2 == len(registry_of(pair.prompt).caches())
    held = held_by(pair.prompt_blocks) + held_by(pair.prompt_rows)
    assert before["registered bytes"] == held
    assert before["pending tokens"] == before["copy jobs"] == before["socket jobs"] == before["claimed keys"] == 0
    await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0, 1], [0, 1])
    assert engine_state(pair.prompt) == before
    extra = pair.prompt.kv_cache_manager.allocate_cache(rows_desc())
    grown = engine_state(pair.prompt)
    assert grown["caches"] == 3 and grown["registered bytes"] == held + held_by(extra)
    pair.prompt.kv_cache_manager.deallocate_cache(extra)
    assert engine_state(pair.prompt) == before
    assert registry_of(pair.prompt) is runtime_of(pair.prompt).registry


async def test_link_helpers_follow_link_and_unlink(datadist_pair):
    pair = datadist_pair
    prompt, decoder = pair.prompt_cluster_id, pair.decoder_cluster_id
    link = link_to(pair.decoder, prompt)
    assert link is not None and link.remote_cluster_id == prompt
    assert usable_link(pair.decoder, prompt) is link
    assert links_of(pair.decoder) == {prompt: link} and links_of(pair.prompt).keys() == {decoder}
    assert link_count(pair.decoder) == link_count(pair.prompt) == 1
    assert link_table_of(pair.decoder).links[prompt] is link
    links_of(pair.decoder).clear()  # a copy
    assert link_to(pair.decoder, prompt) is link
    assert link_to(pair.decoder, 99) is None

    info = LLMClusterInfo()
    info.remote_cluster_id = prompt
    info.append_remote_ip_info(*pair.prompt.listen_address)
    assert (await pair.decoder.unlink_clusters([info]))[0] == S.LLM_SUCCESS
    assert link_to(pair.decoder, prompt) is None and links_of(pair.decoder) == {} and link_count(pair.decoder) == 0
    with pytest.raises(LLMException) as info_:
        usable_link(pair.decoder, prompt)
    assert info_.value.status_code == S.LLM_NOT_YET_LINK


async def test_listener_helpers_see_only_a_listening_endpoint(datadist_pair):
    pair = datadist_pair
    assert admission_of(pair.prompt) is not None and admission_of(pair.decoder) is None
    assert handshakes_in_progress(pair.prompt) == handshakes_in_progress(pair.decoder) == 0
    assert nixl_agent_of(pair.prompt) is None and nixl_agent_of(pair.decoder) is None  # default transport
    async with LLMDataDist(LLMRole.PROMPT, 7) as tcp_only:
        await tcp_only.init(loopback_options(listen=True, transport="tcp"))
        assert admission_of(tcp_only) is not None and share_listener_of(tcp_only) is None


async def test_the_helpers_refuse_an_endpoint_before_init_and_after_finalize():
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    for helper in HELPERS:
        with pytest.raises(LLMException) as info:
            helper(dd)
        assert info.value.status_code == S.LLM_FAILED, helper.__name__
    await dd.init(loopback_options())
    assert runtime_of(dd).settings is not None and links_of(dd) == {}
    await dd.finalize()
    for helper in (*HELPERS, lambda dd: link_to(dd, 1), lambda dd: usable_link(dd, 1)):
        with pytest.raises(LLMException) as info:
            helper(dd)
        assert info.value.status_code == S.LLM_ENGINE_FINALIZED
