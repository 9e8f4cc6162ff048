"""vLLM's KV connector on aio_datadist: disaggregated prefill and decode, the decode pulling.

Use it with ``--kv-transfer-config``::

    {"kv_connector": "AioDatadistConnector",
     "kv_connector_module_path": "aio_datadist.integrations.vllm",
     "kv_role": "kv_producer" | "kv_consumer" | "kv_both",
     "kv_connector_extra_config": {...}}

The flow is NixlConnector's: a prefill request sent with
``kv_transfer_params={"do_remote_decode": true}`` keeps its blocks when it
finishes and returns ``kv_transfer_params`` naming them; the proxy passes
those to the decode instance, whose scheduler reports the prompt as external
tokens loaded asynchronously and whose worker pulls the blocks with
``pull_blocks``. The prefill frees the blocks when the decoder says ``done``,
when the decoder's side-channel connection closes, or on a timeout; the
decode reports a load finished only once its pull has returned, so no byte
lands in blocks vLLM gave back. See docs/vllm.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
)

from aio_datadist.integrations.vllm_agent import Agent, AgentOptions, kv_layout
from aio_datadist.integrations.vllm_wire import RemotePrefill, parse_transfer_params, tokens_to_load, transfer_params
from aio_datadist.status import LLMException

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["AioDatadistConnector", "AioDatadistMetadata", "AioDatadistHandshake"]

log = logging.getLogger("aio_datadist.integrations.vllm")


@dataclass
class AioDatadistHandshake(KVConnectorHandshakeMetadata):
    """What a worker tells its scheduler: where its side channel listens."""

    host: str
    port: int


@dataclass
class AioDatadistMetadata(KVConnectorMetadata):
    """One step's orders from the scheduler half to the worker half."""

    to_pull: dict[str, tuple[RemotePrefill, list[int]]] = field(default_factory=dict)
    to_hold: dict[str, tuple[float, list[int]]] = field(default_factory=dict)  # prefill request -> lease s, blocks
    to_release: dict[str, RemotePrefill] = field(default_factory=dict)  # decode aborted before pulling


def _extra(vllm_config: VllmConfig) -> dict[str, Any]:
    config = vllm_config.kv_transfer_config
    assert config is not None
    return dict(config.kv_connector_extra_config or {})


class AioDatadistConnector(KVConnectorBase_V1):
    """Both halves of the connector; vLLM makes one per role (scheduler, worker)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config, role, kv_cache_config)
        parallel = vllm_config.parallel_config
        if parallel.tensor_parallel_size != 1 or parallel.pipeline_parallel_size != 1:
            raise ValueError("AioDatadistConnector supports tensor and pipeline parallel size 1 only")
        if len(kv_cache_config.kv_cache_groups) != 1:
            raise ValueError("AioDatadistConnector supports models with one KV cache group (full attention) only")
        transfer = self._kv_transfer_config
        self.options = AgentOptions.from_extra(_extra(vllm_config))
        self.engine_id = str(transfer.engine_id)
        self.producer = bool(transfer.is_kv_producer)
        self.consumer = bool(transfer.is_kv_consumer)
        self.block_tokens = vllm_config.cache_config.block_size
        # scheduler half
        self._side_channel: tuple[str, int] | None = None
        self._meta = AioDatadistMetadata()
        self._recv_blocks: dict[str, tuple[RemotePrefill, list[int]]] = {}
        # worker half
        self.agent: Agent | None = None
        self._bad_blocks: set[int] = set()
        if role == KVConnectorRole.WORKER:
            self.agent = Agent(self.producer, self.consumer, self.engine_id, self.options)

    # -- worker half ---------------------------------------------------------------------------

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.agent is not None
        tensors, layout, _ = kv_layout(kv_caches, self._kv_cache_config.num_blocks, self.block_tokens)
        self.agent.register(tensors, layout)
        log.info("aio_datadist connector: %d KV tensors of %d blocks of %d bytes registered%s", layout.tensors,
                 layout.num_blocks, layout.block_bytes,
                 f"; side channel on {self.agent.side_channel}" if self.agent.side_channel else "")

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self.agent is None or self.agent.side_channel is None:
            return None
        host, port = self.agent.side_channel
        return AioDatadistHandshake(host, port)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        assert self.agent is not None
        meta = self._get_connector_metadata()
        assert isinstance(meta, AioDatadistMetadata)
        for req_id, (lease_s, blocks) in meta.to_hold.items():
            self.agent.holds.add(req_id, lease_s, blocks)
        for req_id, (remote, local) in meta.to_pull.items():
            self.agent.start_pull(req_id, remote, local)
        for remote in meta.to_release.values():
            self.agent.release_unpulled(remote)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: vLLM runs a request only after get_finished reported its pull

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: AttentionMetadata,
                      **kwargs: Any) -> None:
        return  # the decode pulls: nothing is saved or pushed

    def wait_for_save(self) -> None:
        return

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        assert self.agent is not None
        if finished_req_ids:
            self.agent.pulls.abort(finished_req_ids)  # aborted while pulling: stop; reported once stopped
        recving, failed, bad = self.agent.pulls.take_finished()
        self._bad_blocks |= bad
        return KVConnectorTransferResults(finished_sending=self.agent.holds.take_released(),
                                          finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        bad, self._bad_blocks = self._bad_blocks, set()
        return bad

    def shutdown(self) -> None:
        if self.agent is not None:
            self.agent.close()

    # -- scheduler half ------------------------------------------------------------------------

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        for meta in metadata.values():
            if isinstance(meta, AioDatadistHandshake):
                self._side_channel = (meta.host, meta.port)

    def _remote(self, request: Request) -> RemotePrefill | None:
        params = request.kv_transfer_params
        if not params or not params.get("do_remote_prefill"):
            return None
        try:
            return parse_transfer_params(params, self.block_tokens)
        except LLMException as exc:
            log.warning("request %s: kv_transfer_params ignored, the prompt is computed here: %s",
                        request.request_id, exc)
            return None

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        remote = self._remote(request)
        if remote is None:
            return 0, False
        try:
            count = tokens_to_load(remote, len(request.prompt_token_ids or ()), num_computed_tokens)
        except LLMException as exc:
            log.warning("request %s: kv_transfer_params ignored, the prompt is computed here: %s",
                        request.request_id, exc)
            return 0, False
        return (count, True) if count > 0 else (0, False)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        remote = self._remote(request)
        if remote is None:
            return
        params = request.kv_transfer_params
        assert params is not None
        params["do_remote_prefill"] = False  # one load per request
        if num_external_tokens > 0:
            local = list(blocks.get_unhashed_block_ids())
            self._meta.to_pull[request.request_id] = (remote, local)
        else:  # the local prefix cache had it all: the prefill may free its blocks
            self._meta.to_release[request.request_id] = remote

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta, self._meta = self._meta, AioDatadistMetadata()
        return meta

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus

        params = request.kv_transfer_params
        if not params:
            return False, None
        if params.get("do_remote_prefill"):  # a decode request finished (aborted) before its load began
            remote = self._remote(request)
            if remote is not None:
                self._meta.to_release[request.request_id] = remote
            return False, None
        if not params.get("do_remote_decode"):
            return False, None
        if request.status not in (RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED):
            return False, None  # aborted prefill: nobody will pull
        groups = block_ids if block_ids and isinstance(block_ids[0], (list, tuple)) else [block_ids]
        blocks = [int(b) for b in groups[0]]
        if not blocks or self._side_channel is None:
            return False, None
        self._meta.to_hold[request.request_id] = (self.options.lease_s, blocks)
        host, port = self._side_channel
        return True, transfer_params(engine_id=self.engine_id, request_id=request.request_id, host=host, port=port,
                                     block_ids=blocks, num_tokens=request.num_computed_tokens)
