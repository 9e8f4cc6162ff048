"""KvCacheManager (v1) time-outs through the blocking facade, against a peer process stalled by SIGSTOP.

v1 LLM-DataDist has no ``LLM_TIMEOUT``: a transfer that runs out of time is ``LLM_WAIT_PROCESS_TIMEOUT``
(reference 2.11, its row; 2.4, ``transfer_cache_async``: "A timeout yields LLM_WAIT_PROCESS_TIMEOUT"; 6,
item 3: the v2 / v1 split). The facade raised (and a v1 task's results read) the async API's
``LLM_TIMEOUT``, which a ported v1 client's ``except`` on ``LLM_WAIT_PROCESS_TIMEOUT`` did not catch (found
by audit).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from peers import stop_process

import aio_datadist.compat as llm_datadist
from aio_datadist.compat import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LayerSynchronizer,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    TransferConfig,
)

PEER = Path(__file__).with_name("compat_v1_peer.py")
DESC = CacheDesc(2, [2, 4], DataType.DT_FLOAT)


@pytest.fixture
def private_loop():
    yield
    llm_datadist._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


class _Peer:
    def __init__(self, *args: str) -> None:
        self.proc = subprocess.Popen([sys.executable, str(PEER), *args], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline().split()
        assert line and line[0] == "ready", line
        self.state = line[1:]

    def stop(self) -> None:
        stop_process(self.proc.pid)

    def close(self) -> None:
        try:
            os.kill(self.proc.pid, signal.SIGCONT)
            self.proc.stdin.write("\n")
            self.proc.stdin.flush()
            self.proc.wait(20)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(10)
            self.proc.stdin.close()
            self.proc.stdout.close()


def _options(listen: str | None = None) -> dict:
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 300
    if listen:
        config.listen_ip_info = listen
    return config.generate_options()


def test_a_v1_pull_that_times_out_raises_wait_process_timeout(private_loop):
    """Reference 5.3 step 4 (the decoder's ``pull_cache``) with the prompt stalled."""
    peer = _Peer("prompt")
    datadist = LLMDataDist(LLMRole.DECODER, 2)
    try:
        datadist.init(_options())
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = 1
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", int(peer.state[1]))
        ret, _ = datadist.link_clusters([cluster], 3000)
        assert ret == LLMStatusCode.LLM_SUCCESS
        kv = datadist.kv_cache_manager
        cache = kv.allocate_cache(DESC)
        remote_id = int(peer.state[0])
        kv.pull_cache(CacheKeyByIdAndIndex(1, remote_id, 0), cache, batch_index=0)  # works while the peer runs
        peer.stop()
        started = time.monotonic()
        with pytest.raises(LLMException) as info:
            kv.pull_cache(CacheKeyByIdAndIndex(1, remote_id, 1), cache, batch_index=1)
        assert time.monotonic() - started < 5
        assert info.value.status_code == LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, info.value
    finally:
        peer.close()
        datadist.finalize()


class _Ready(LayerSynchronizer):
    def synchronize_layer(self, layer_index, timeout_in_millis):
        return True


def test_a_v1_transfer_cache_async_that_times_out_reads_wait_process_timeout(private_loop):
    """Reference 5.3 step 4's alternative (the prompt's ``transfer_cache_async`` with ``TransferConfig``, then
    ``task.synchronize()``) with the decoder stalled: the transfer times out by itself (``sync_kv_timeout``
    300 ms), and the task's codes are v1's."""
    datadist = LLMDataDist(LLMRole.PROMPT, 1)
    datadist.init(_options("127.0.0.1:0"))
    peer = None
    try:
        address = datadist.listen_address
        assert address is not None
        peer = _Peer("decoder", str(address[1]))
        addrs = [int(a) for a in peer.state]
        kv = datadist.kv_cache_manager
        cache = kv.allocate_cache(DESC)
        task = kv.transfer_cache_async(cache, _Ready(), [TransferConfig(2, addrs)])
        assert task.synchronize(5000) == LLMStatusCode.LLM_SUCCESS  # works while the peer runs
        peer.stop()
        started = time.monotonic()
        task = kv.transfer_cache_async(cache, _Ready(), [TransferConfig(2, addrs)])
        code = task.synchronize(5000)
        assert time.monotonic() - started < 4, "the transfer did not time out by itself"
        assert code == LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT, code
        assert task.get_results(1000) == [LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT]
    finally:
        if peer is not None:
            peer.close()
        datadist.finalize()


def _endpoint(role: LLMRole, cluster_id: int, v2: bool, **settings: object) -> LLMDataDist:
    dd = LLMDataDist(role, cluster_id)
    config = LLMConfig()
    config.device_id = 0
    config.enable_cache_manager = v2
    for name, value in settings.items():
        setattr(config, name, value)
    dd.init(config.generate_options())
    return dd


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_link_that_times_out_reads_each_modes_timeout_code(private_loop, v2: bool):
    """A dial whose listener never answers the handshake: v1 reports ``LLM_WAIT_PROCESS_TIMEOUT`` in
    ``link_clusters``' codes, v2 ``LLM_TIMEOUT``. Before, v1 read ``LLM_TIMEOUT``, a code v1 does not have
    (found by audit)."""
    silent = socket.create_server(("127.0.0.1", 0))  # its backlog takes the dial; nothing answers
    dd = _endpoint(LLMRole.DECODER, 2, v2)
    try:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = 1
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", silent.getsockname()[1])
        code = LLMStatusCode.LLM_TIMEOUT if v2 else LLMStatusCode.LLM_WAIT_PROCESS_TIMEOUT
        assert dd.link_clusters([cluster], 300) == (code, [code])
    finally:
        dd.finalize()
        silent.close()


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_an_allocation_past_the_memory_cap_reads_each_modes_out_of_memory_code(private_loop, v2: bool):
    """v1's pool is out of memory with ``LLM_DEVICE_OUT_OF_MEMORY``, v2's with ``LLM_OUT_OF_MEMORY`` (reference
    2.11, 3.3), through the facade. Before, v1 raised v2's code (found by audit)."""
    dd = _endpoint(LLMRole.PROMPT, 1, v2, registered_memory_cap=1 << 20)
    try:
        manager = dd.cache_manager if v2 else dd.kv_cache_manager
        desc = CacheDesc(2, (4, 1 << 18), DataType.DT_FLOAT16)  # 4 MiB past a 1 MiB cap
        mine = [torch.zeros(desc.shape, dtype=torch.float16) for _ in range(2)]
        code = LLMStatusCode.LLM_OUT_OF_MEMORY if v2 else LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
        for call in (manager.allocate_cache, manager.allocate_blocks_cache,
                     lambda d: manager.register_cache(d, mine), lambda d: manager.register_blocks_cache(d, mine)):
            with pytest.raises(LLMException) as info:
                call(desc)
            assert info.value.status_code == code, info.value
    finally:
        dd.finalize()


@pytest.mark.parametrize("v2", [False, True], ids=["v1", "v2"])
def test_a_transfer_refused_out_of_memory_reads_each_modes_code_in_the_call_and_its_task(private_loop, monkeypatch,
                                                                                         v2: bool):
    """An owner that answers a push with ``LLM_OUT_OF_MEMORY`` (stood in for here): v1's ``push_cache`` raises
    and its ``transfer_cache_async`` task reads ``LLM_DEVICE_OUT_OF_MEMORY``, v2's ``LLM_OUT_OF_MEMORY``. Before,
    a v1 task read v2's code where the same failure raised v1's (found by review)."""
    from aio_datadist import transfers
    from aio_datadist.transport import base

    prompt = _endpoint(LLMRole.PROMPT, 1, v2, listen_ip_info="127.0.0.1:0", transport="tcp")
    decoder = _endpoint(LLMRole.DECODER, 2, v2, transport="tcp")  # a push the owner answers (not a same-host copy)
    try:
        dst = decoder.cache_manager.allocate_cache(DESC) if v2 else decoder.kv_cache_manager.allocate_cache(DESC)
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = 1
        cluster.append_local_ip_info("127.0.0.1", 0)
        cluster.append_remote_ip_info("127.0.0.1", prompt.listen_address[1])
        assert decoder.link_clusters([cluster], 3000)[0] == LLMStatusCode.LLM_SUCCESS
        manager = prompt.cache_manager if v2 else prompt.kv_cache_manager
        src = manager.allocate_cache(DESC)
        addrs = [int(a) for a in (dst.tensor_addrs if v2 else dst.per_device_tensor_addrs[0])]

        async def out_of_memory(*args, **kwargs):
            raise base.Refused("cluster 2: out of memory", status_code=LLMStatusCode.LLM_OUT_OF_MEMORY)

        monkeypatch.setattr(transfers, "_ask", out_of_memory)
        code = LLMStatusCode.LLM_OUT_OF_MEMORY if v2 else LLMStatusCode.LLM_DEVICE_OUT_OF_MEMORY
        if not v2:
            with pytest.raises(LLMException) as info:
                manager.push_cache(CacheKeyByIdAndIndex(2, dst.cache_id, 0), src, 0)
            assert info.value.status_code == code, info.value
        task = manager.transfer_cache_async(src, _Ready(), [TransferConfig(2, addrs)])
        assert (task.synchronize(5000), task.get_results(1000)) == (code, [code])
    finally:
        decoder.finalize()
        prompt.finalize()
