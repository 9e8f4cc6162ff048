"""Port of the HIXL sample ``pull_blocks_xpyd_sample.py`` (v2, xPyD: every decoder links to every
prompt in one ``link_clusters`` call and ``pull_blocks`` from each of them in turn).

Source: libochao-huawei/hixl (a copy of the HIXL repository; hicann/hixl's stored
copy lacks the pull samples), ``examples/python/pull_blocks_xpyd_sample.py``,
commit 0d8af4f0cd4b318975e6ed9975264ec24e51c3c7 (xiaojia151/Hixl @ 2cdf7acf6a719db4dfa2ddb795f65c0be092530f
holds the same code).

Ported: ``ip_port_to_int``, ``init_llm_datadist``, ``run_prompt_sample``,
``run_decoder_sample``; llm_datadist calls verbatim and in order. Every
endpoint's cluster id is its ``ip:port`` as a 48-bit integer; a prompt
listens on its ``local_ip_port`` (``local_comm_res = ""``: CacheManager mode)
and registers a blocks cache under ``BlocksCacheKey(<its id>, 0)``; a decoder
does not listen, registers its own, builds one ``LLMClusterInfo`` per prompt
(local ip with port 0, the prompt's ip and port) and calls
``link_clusters(cluster_list, 5000)`` once for all of them, then
``pull_blocks(BlocksCacheKey(<prompt id>, 0), cache, src_blocks=[0, 1],
dst_blocks=[0, 2])`` from each prompt in turn (each pull overwrites the last),
a non-forced ``unlink_clusters(cluster_list, 5000)``, ``unregister_cache``,
``finalize``. The prompts never link or unlink: they ``unregister_cache`` and
``finalize`` once the decoders are done.

Scaffolding replaced:
- one process per prompt and per decoder (the README's 2P2D: prompts on
  ``...:26000`` / ``...:26001``, decoders on ``...:26002`` / ``...:26003``
  with ``--remote_ip_port '...:26000;...:26001'``) -> folded into two
  processes: the prefill process holds both prompts' endpoints, the decode
  process both decoders'; each endpoint's ``init_llm_datadist`` +
  ``run_*_sample`` runs in a thread of its own, as the separate processes run
  at once. ``init_llm_datadist`` reads the module global ``role`` that the
  sample's ``__main__`` sets; each process sets it the same way.
- argparse -> one namespace per endpoint (device ids 0..3, as the README);
  the prompts' ``ip:port`` are ``127.0.0.1`` with free ports, the decoders'
  ``127.0.0.2`` with two more (never listened on: they only make the ids).
- ``torch.npu.set_device`` dropped; ``.npu()`` tensors -> CPU tensors. The
  prompt's ``torch.full(..., ip_port_to_int(local_ip_port))`` becomes a
  pattern seeded per prompt (two ids on one host round to the same float32,
  so the decoder could not tell whose blocks it holds); the decoder's zeros
  are kept.
- the decoder's ``time.sleep(5)`` (register end) -> a wait until both
  prompts registered (one :meth:`Peer.barrier`); the prompt's
  ``time.sleep(30)`` -> a wait until both decoders are done (a second one).
- the logging of the decoder's tensor after each pull -> a check.
"""

from __future__ import annotations

import socket
import struct
import threading
from types import SimpleNamespace

import _client_harness as harness
import torch

from aio_datadist.compat import (  # was: from llm_datadist import (...)
    BlocksCacheKey,
    CacheDesc,
    DataType,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMRole,
    LLMStatusCode,
    Placement,
)

NUM_TENSORS = 1
BLOCKS_NUM = 3
KV_SHAPE = 10
SHAPE = (BLOCKS_NUM, KV_SHAPE)
PROMPTS = 2
DECODERS = 2

role = None  # the sample's __main__ sets this global, which init_llm_datadist reads


def ip_port_to_int(ip_port):
    ip, port_str = ip_port.split(':')
    port = int(port_str)
    if not (0 <= port <= 65535):
        raise ValueError("端口号必须在0-65535之间")
    ip_bytes = socket.inet_aton(ip)
    ip_int = struct.unpack('!I', ip_bytes)[0]
    result = (ip_int << 16) | port
    return result


def init_llm_datadist(args) -> LLMDataDist:
    datadist = LLMDataDist(role, ip_port_to_int(args.local_ip_port))
    llm_config = LLMConfig()
    llm_config.device_id = args.device_id
    llm_config.local_comm_res = ""
    if args.role == 'p':
        llm_config.listen_ip_info = args.local_ip_port
    llm_options = llm_config.generate_options()
    llm_options.update(harness.extra_options())  # harness: transport selection
    datadist.init(llm_options)
    return datadist


def run_prompt_sample(side, datadist, args):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                           placement=Placement.DEVICE)
    tensor = harness.pattern(SHAPE, torch.float, seed=args.seed)  # was torch.full(..., ip_port_to_int(...)).npu()

    addr = int(tensor.data_ptr())
    cache = cache_manager.register_blocks_cache(cache_desc, [addr],
                                                BlocksCacheKey(ip_port_to_int(args.local_ip_port), 0))

    side.sleep_30()  # was time.sleep(30): registered, then wait until the decoders are done
    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


def run_decoder_sample(side, datadist, args):
    cache_manager = datadist.cache_manager
    cache_desc = CacheDesc(num_tensors=NUM_TENSORS, shape=[BLOCKS_NUM, KV_SHAPE], data_type=DataType.DT_FLOAT,
                           placement=Placement.DEVICE)
    remote_list = args.remote_ip_port.split(';')

    tensor = torch.full((BLOCKS_NUM, KV_SHAPE), 0, dtype=torch.float)  # was .npu()
    addr = int(tensor.data_ptr())
    cache = cache_manager.register_blocks_cache(cache_desc, [addr],
                                                BlocksCacheKey(ip_port_to_int(args.local_ip_port), 0))

    side.sleep_5()  # was time.sleep(5): register end

    cluster_list = []
    for remote in remote_list:
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = ip_port_to_int(remote)
        cluster.append_local_ip_info(args.local_ip_port.split(':')[0], 0)
        cluster.append_remote_ip_info(remote.split(':')[0], int(remote.split(':')[1]))
        cluster_list.append(cluster)
    ret, _ = datadist.link_clusters(cluster_list, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("link failed")

    for i, remote in enumerate(remote_list):
        cache_manager.pull_blocks(BlocksCacheKey(ip_port_to_int(remote), 0),
                                  cache, src_blocks=[0, 1], dst_blocks=[0, 2])
        # was: logging.info(f'after decoder pull from {ip_port_to_int(remote)}, tensor={tensor.cpu()}')
        src = harness.pattern(SHAPE, torch.float, seed=args.remote_seeds[i])
        expected = torch.stack([src[0], torch.zeros(KV_SHAPE), src[1]])
        side.check(f"{args.name}_after_pull_from_prompt{i}", torch.equal(tensor, expected))

    ret, _ = datadist.unlink_clusters(cluster_list, 5000)
    if ret != LLMStatusCode.LLM_SUCCESS:
        raise Exception("unlink failed")

    cache_manager.unregister_cache(cache.cache_id)
    datadist.finalize()


# -- harness: several endpoints of one process, each in a thread of its own ---------------------

class Side:
    """One process's endpoints: the sample's sleeps become waits on the process's main thread."""

    def __init__(self, peer, endpoints: int) -> None:
        self.peer = peer
        self.registered = threading.Barrier(endpoints + 1)  # the prompts' registration, and the main thread
        self.go = threading.Event()  # set by the main thread once the other process is there
        self.failed = False
        self.errors: list[BaseException] = []

    def sleep_30(self) -> None:
        self.registered.wait(self.peer._limit_s)
        self._wait_go()

    def sleep_5(self) -> None:
        self._wait_go()

    def _wait_go(self) -> None:
        if not self.go.wait(self.peer._limit_s) or self.failed:
            raise harness.PeerFailed("the other process failed (the sample's sleep would have run out)")

    def check(self, name: str, ok: bool) -> None:
        self.peer.check(name, ok)

    def release(self, failed: bool) -> None:
        self.failed = failed
        self.go.set()

    def start(self, fn, args_list) -> list[threading.Thread]:
        def guarded(args):
            try:
                fn(self, args)
            except BaseException as exc:
                self.errors.append(exc)
                self.registered.abort()
                self.peer.abort()

        threads = [threading.Thread(target=guarded, args=(args,), name=args.name) for args in args_list]
        for thread in threads:
            thread.start()
        return threads

    def join(self, threads) -> None:
        for thread in threads:
            thread.join(self.peer._limit_s)
        if self.errors:
            raise self.errors[0]
        alive = [t.name for t in threads if t.is_alive()]
        if alive:
            raise TimeoutError(f"endpoints still running: {alive}")


def _prompt_main(side, args):
    run_prompt_sample(side, init_llm_datadist(args), args)


def _decoder_main(side, args):
    run_decoder_sample(side, init_llm_datadist(args), args)


def _prefill(peer, prompts):
    global role
    role = LLMRole.PROMPT  # the sample's __main__: role = LLMRole.PROMPT if args.role == 'p' else ...
    side = Side(peer, len(prompts))
    threads = side.start(_prompt_main, prompts)
    ok = False
    try:
        side.registered.wait(peer._limit_s)  # both prompts listen and registered
        peer.barrier()  # register end
        peer.barrier()  # the decoders are done
        ok = True
    finally:
        side.release(failed=not ok)
    side.join(threads)


def _decode(peer, decoders):
    global role
    role = LLMRole.DECODER
    side = Side(peer, 0)
    threads = side.start(_decoder_main, decoders)
    ok = False
    try:
        peer.barrier()  # register end: the prompts registered
        ok = True
    finally:
        side.release(failed=not ok)
    side.join(threads)
    peer.barrier()  # the decoders are done


def run(tmp_path, options=None, limit_s: float = 60.0) -> dict:
    """2P2D on loopback, folded into two processes; each decoder checks its tensor after each pull."""
    ports = harness.free_ports(PROMPTS + DECODERS)
    prompt_ip_ports = [f"{harness.LOCALHOST}:{port}" for port in ports[:PROMPTS]]
    seeds = [1 + i for i in range(PROMPTS)]
    prompts = [SimpleNamespace(name=f"prompt{i}", device_id=i, role='p', local_ip_port=ip_port, seed=seeds[i])
               for i, ip_port in enumerate(prompt_ip_ports)]
    decoders = [SimpleNamespace(name=f"decoder{j}", device_id=PROMPTS + j, role='d',
                                local_ip_port=f"{harness.OTHER_LOCALHOST}:{port}",
                                remote_ip_port=';'.join(prompt_ip_ports), remote_seeds=seeds)
                for j, port in enumerate(ports[PROMPTS:])]
    return harness.run_pair(_prefill, _decode, prefill_args=(prompts,), decode_args=(decoders,),
                            options=options, limit_s=limit_s)


if __name__ == "__main__":
    harness.main(run)
