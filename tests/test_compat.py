"""The blocking facade runs llm_datadist-style programs unchanged but for the import."""

from __future__ import annotations

import importlib
import pathlib
import sys

import pytest

from aio_datadist import LLMStatusCode, compat
from aio_datadist.compat import LLMConfig, LLMDataDist, LLMRole

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def port_example():
    sys.path.insert(0, str(EXAMPLES))  # spawned children inherit sys.path and import it by name
    try:
        yield importlib.import_module("llm_datadist_port")
    finally:
        sys.path.remove(str(EXAMPLES))


@pytest.fixture
def private_loop():
    yield
    compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


def test_reference_flows_run_through_the_facade(port_example):
    outcome = port_example.main(limit_s=120)
    assert outcome["exitcodes"] == [0, 0]
    assert outcome["pull_cache"], "pull_cache rows differ from the prompt's cache"
    assert outcome["repeat_pull"] == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, "a pulled key must be consumed"
    assert outcome["pull_blocks"] and outcome["swap_blocks"]
    assert outcome["unlink"] == LLMStatusCode.LLM_SUCCESS


def test_blocking_calls_and_return_shapes(private_loop):
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.listen_ip_info = "127.0.0.1:0"
    dd.init(cfg.generate_options())
    try:
        status, per_cluster = dd.unlink_clusters([], 1000)
        assert status == LLMStatusCode.LLM_SUCCESS and per_cluster == []
        assert dd.kv_cache_manager.is_initialized()
    finally:
        dd.finalize()
    assert not dd.kv_cache_manager.is_initialized()


@pytest.mark.asyncio
async def test_refuses_to_block_inside_an_event_loop():
    dd = LLMDataDist(LLMRole.PROMPT, 8)
    cfg = LLMConfig()
    cfg.device_id = 0
    with pytest.raises(RuntimeError, match="async API"):
        dd.init(cfg.generate_options())
