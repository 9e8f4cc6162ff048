"""llm_datadist behaviours of ``LLMConfig.ge_options`` and ``CacheKeyByIdAndIndex`` that clients rely on.

``ge_options`` reads as the config's own dict (the vLLM HIXL connector fills it in place:
``cfg.ge_options[k] = str(v)``), so keys added to it reach ``generate_options()``. A
``CacheKeyByIdAndIndex`` takes any int64 ``cache_id`` (reference §2.8); one that names no cache is the owner's
``LLM_KV_CACHE_NOT_EXIST`` at transfer time, not a construction error.
"""

from __future__ import annotations

import pytest
import torch

from aio_datadist import (
    CacheDesc,
    CacheIndex,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMException,
    LLMStatusCode,
    compat,
)
from aio_datadist.options import parse_options
from peers import linked_pair

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


@pytest.mark.parametrize("config_class", [LLMConfig, compat.LLMConfig, compat.LlmConfig])
def test_ge_options_filled_in_place_are_generated(config_class: type) -> None:
    config = config_class()
    config.device_id = 0
    config.ge_options["ge.flowGraphMemMaxSize"] = "1073741824"
    config.ge_options["llm.RdmaTrafficClass"] = "132"
    assert config.ge_options is config.ge_options
    options = config.generate_options()
    assert options["ge.flowGraphMemMaxSize"] == "1073741824"
    assert options["llm.RdmaTrafficClass"] == "132"
    parse_options(options)
    config.ge_options = {"a.b": "c"}  # assigned: checked, and from then on the config's own dict
    config.ge_options["d.e"] = "f"
    assert {"a.b": "c", "d.e": "f"}.items() <= config.generate_options().items()
    assert "ge.flowGraphMemMaxSize" not in config.generate_options()


def test_ge_options_filled_in_place_are_checked_by_generate_options() -> None:
    config = LLMConfig()
    config.ge_options["ge.flowGraphMemMaxSize"] = 1024  # type: ignore[assignment]  # not a str
    with pytest.raises(LLMException) as info:
        config.generate_options()
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "'ge_options'" in str(info.value)


def test_ge_options_of_two_configs_are_not_shared() -> None:
    first, second = LLMConfig(), LLMConfig()
    first.ge_options["k"] = "v"
    assert second.ge_options == {} and "k" not in second.generate_options()


@pytest.mark.parametrize("cls", [CacheKeyByIdAndIndex, CacheIndex, compat.CacheKeyByIdAndIndex])
def test_any_int64_cache_id_is_accepted(cls: type) -> None:
    for cache_id in (0, -1, INT64_MIN, INT64_MAX):
        key = cls(1, cache_id, 0)
        assert key.cache_id == cache_id
    for cache_id in (INT64_MAX + 1, INT64_MIN - 1):
        with pytest.raises(ValueError):
            cls(1, cache_id)


ROWS = CacheDesc(1, [2, 16], DataType.DT_UINT8)


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_a_pull_naming_no_cache_is_kv_cache_not_exist(transport: str) -> None:
    async with linked_pair(prompt_config={"transport": transport},
                           decoder_config={"transport": transport}) as pair:
        p_rows = pair.pm.allocate_cache(ROWS)
        p_rows.tensors[0].fill_(9)
        d_rows = pair.dm.allocate_cache(ROWS)
        for cache_id in (0, -1, INT64_MIN, p_rows.cache_id + 1000):
            with pytest.raises(LLMException) as info:
                await pair.dm.pull_cache(CacheKeyByIdAndIndex(pair.prompt.cluster_id, cache_id, 0), d_rows, 0)
            assert info.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST, (cache_id, info.value)
            assert not d_rows.tensors[0].any()
        # the link is still good for a cache that exists
        await pair.dm.pull_cache(CacheKeyByIdAndIndex(pair.prompt.cluster_id, p_rows.cache_id, 1), d_rows, 0)
        assert torch.equal(d_rows.tensors[0][0], torch.full((16,), 9, dtype=torch.uint8))
