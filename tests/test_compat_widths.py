"""The blocking v2 ``CacheManager`` with ints past the widths the reference checks, and a layer-wise transfer
that a bug ends.

LLM-DataDist raises ``ValueError`` for a ``size`` outside int64 (``check_int64``) and a layer outside uint32
(``layer_range_to_tensor_indices``); ours is ``LLMException(LLM_PARAM_INVALID)`` naming the argument and a
``ValueError`` too (``ParamValueError``), raised before anything is sent. A request carries its layers as int32,
so a layer past ``2**31 - 1`` is refused the same way: before, the remote side's range of a pull was checked
only when the request was encoded, and a bare ``struct.error`` reached the caller.
"""

from __future__ import annotations

import pytest
import torch
from test_compat_cache_manager import _init, _Ready

from aio_datadist import compat, layerwise
from aio_datadist.compat import (
    BlocksCacheKey,
    CacheDesc,
    CacheKey,
    CacheKeyByIdAndIndex,
    DataType,
    LLMClusterInfo,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferWithCacheKeyConfig,
)
from aio_datadist.task import TaskProgress

S = LLMStatusCode
ROWS = CacheDesc(4, (3, 256), DataType.DT_FLOAT16)
BLOCKS = CacheDesc(4, (8, 128), DataType.DT_FLOAT16)
PAST_INT32 = range(2**31, 2**31 + 1)
PAST_UINT32 = range(2**32, 2**32 + 1)
ENDS_PAST_INT32 = range(2**31 - 1, 2**31 + 1)  # starts inside int32: the last layer is what must be checked


@pytest.fixture
def linked():
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    _init(prompt, listen=True)
    _init(decoder)
    try:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = 1
        cluster.append_remote_ip_info(*prompt.listen_address)
        assert decoder.link_clusters([cluster], 5000) == (S.LLM_SUCCESS, [S.LLM_SUCCESS])
        yield prompt.cache_manager, decoder.cache_manager
    finally:
        decoder.finalize()
        prompt.finalize()
        compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


def refused_as_value_error(call, arg: str) -> None:
    with pytest.raises(LLMException) as info:
        call()
    assert info.value.status_code is S.LLM_PARAM_INVALID and f"'{arg}'" in str(info.value), info.value
    assert isinstance(info.value, ValueError), info.value


@pytest.mark.parametrize("layers", [PAST_INT32, PAST_UINT32, ENDS_PAST_INT32], ids=["int32", "uint32", "last"])
def test_a_pull_whose_remote_layers_are_past_int32_is_refused_before_it_is_sent(linked, layers):
    pm, dm = linked
    src = pm.allocate_cache(ROWS, [CacheKey(1, 5)])
    mem = [torch.zeros(3, 256, dtype=torch.float16) for _ in range(4)]
    rows = dm.register_cache(ROWS, [t.data_ptr() for t in mem])
    blocks_src = pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, 0))
    blocks = dm.allocate_blocks_cache(BLOCKS)
    refused_as_value_error(lambda: dm.pull_cache(CacheKey(1, 5), rows, 0, src_layer_range=layers,
                                                 dst_layer_range=range(len(layers))), "src_layer_range")
    refused_as_value_error(lambda: dm.pull_blocks(BlocksCacheKey(1, 0), blocks, [0], [0], src_layer_range=layers,
                                                  dst_layer_range=range(len(layers))), "src_layer_range")
    refused_as_value_error(lambda: TransferWithCacheKeyConfig(BlocksCacheKey(2, 0), range(len(layers)), layers),
                           "dst_layer_range")
    assert src is not None and blocks_src is not None
    dm.pull_cache(CacheKey(1, 5), rows, 0)  # the key is still there: nothing was sent


@pytest.mark.parametrize("call", ["pull_cache", "push_cache", "copy_cache"])
def test_a_size_outside_int64_is_a_value_error(linked, call):
    _, dm = linked
    mem = [torch.zeros(3, 256, dtype=torch.float16) for _ in range(4)]
    rows = dm.register_cache(ROWS, [t.data_ptr() for t in mem])
    other = dm.allocate_cache(ROWS)
    key = CacheKeyByIdAndIndex(1, 1, 0)
    calls = {"pull_cache": lambda size: dm.pull_cache(key, rows, 0, size=size),
             "push_cache": lambda size: dm.push_cache(key, rows, 0, size=size),
             "copy_cache": lambda size: dm.copy_cache(other, rows, 0, 0, 0, size=size)}
    for size in (2**63, -2**63 - 1):
        refused_as_value_error(lambda: calls[call](size), "size")


async def _awaited(task):
    return await task


def test_a_layer_wise_transfer_that_a_bug_ends_is_no_success(linked, monkeypatch):
    pm, dm = linked
    src = pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, 0))
    dst = dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(2, 0))

    async def broken_push(*args, **kwargs):
        raise RuntimeError("a bug in a layer's push")

    monkeypatch.setattr(layerwise, "run_push", broken_push)
    task = pm.transfer_cache_async(src, _Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0))], [0], [0])
    assert task.get_results(5000) == [S.LLM_FAILED]
    assert task.synchronize(5000) is S.LLM_FAILED
    with pytest.raises(RuntimeError, match="a bug in a layer's push"):  # ``await task`` raises the bug itself
        compat._RUNNER.run(_awaited(task._task))
    assert dst is not None


def test_a_layer_wise_transfer_that_a_confirmation_bug_ends_is_no_success(linked, monkeypatch):
    """The bug comes after the last layer's confirmation recorded the config's success: ``synchronize`` must
    still not answer ``LLM_SUCCESS`` for a transfer that ended by raising."""
    pm, dm = linked
    src = pm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(1, 0))
    dst = dm.allocate_blocks_cache(BLOCKS, BlocksCacheKey(2, 0))
    layer_done = TaskProgress.layer_done

    def broken_layer_done(self, layer, exc):
        if layer == 1:  # the last layer of BLOCKS (4 tensors, 2 per layer)
            raise RuntimeError("a bug in a layer's confirmation")
        layer_done(self, layer, exc)

    monkeypatch.setattr(TaskProgress, "layer_done", broken_layer_done)
    task = pm.transfer_cache_async(src, _Ready(), [TransferWithCacheKeyConfig(BlocksCacheKey(2, 0))], [0], [0])
    assert task.synchronize(5000) is S.LLM_FAILED
    assert dst is not None
