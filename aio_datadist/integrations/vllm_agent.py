"""The vLLM connector's worker machinery: an event loop of its own, the endpoint, the side channel, the pulls.

Nothing here imports vLLM: the worker half of the connector hands it tensors
and block ids. Every coroutine runs on :class:`LoopThread`'s loop; vLLM's
thread submits work and never waits on the network.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import math
import os
import random
import socket
import threading
import time
from collections.abc import Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aio_datadist.config import LLMConfig
from aio_datadist.datadist import LLMDataDist
from aio_datadist.integrations import vllm_auth
from aio_datadist.integrations.vllm_state import DecodePulls, PrefillHolds
from aio_datadist.integrations.vllm_wire import (
    HEADER,
    MAX_TEXT,
    OPS,
    Layout,
    RemotePrefill,
    blocks_digest,
    check_blocks_cover,
    decode_frame,
    decode_reply,
    encode_frame,
    frame_length,
)
from aio_datadist.option_checks import utf8_encodable
from aio_datadist.own_dials import OwnDials
from aio_datadist.refusal_log import RefusalLog
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import BlocksCacheKey, CacheDesc, DataType, LLMClusterInfo, LLMRole, Placement
from aio_datadist.wire import peer_str

__all__ = ["AgentOptions", "LoopThread", "Agent", "kv_layout", "SECRET_ENV", "MAX_PENDING_HANDSHAKES",
           "MAX_CONNECTIONS", "KEEPALIVE_IDLE_S", "KEEPALIVE_INTERVAL_S", "KEEPALIVE_COUNT"]

log = logging.getLogger("aio_datadist.integrations.vllm")

#: Where the shared secret is read from when ``kv_connector_extra_config`` has no ``shared_secret``.
SECRET_ENV = "AIO_DATADIST_SECRET"
#: Side-channel connections still in the handshake at once; a newcomer past it evicts the oldest.
MAX_PENDING_HANDSHAKES = 16
#: Side-channel connections past the handshake at once (authenticated, with a ``shared_secret``). A newcomer
#: past it evicts the one idle longest (no frame read from it for longest, else since it was admitted) that holds
#: no claim, has none waiting, and is no decode still linking (admitted under ``link_timeout_ms`` ago, no claim
#: sent yet); if none may be evicted, the newcomer is told so (a frame of id 0) and closed. With a secret only a
#: newcomer that proved it evicts anyone: a process without the secret never pushes an authenticated connection out.
MAX_CONNECTIONS = 1024
#: TCP keepalive on every side-channel socket, at both ends: a peer whose host vanished without a FIN or RST
#: (power lost, a partition) is found within about ``KEEPALIVE_IDLE_S + KEEPALIVE_COUNT * KEEPALIVE_INTERVAL_S``
#: (45 s) and its connection closed (its claims freed); the probes also keep an idle flow alive in a NAT or
#: firewall that forgets idle flows after longer than ``KEEPALIVE_IDLE_S``.
KEEPALIVE_IDLE_S = 30
KEEPALIVE_INTERVAL_S = 5
KEEPALIVE_COUNT = 3
#: Side-channel connections a decode tries (within ``link_timeout_ms``) when the prefill closes one in
#: the handshake.
HANDSHAKE_ATTEMPTS = 3
#: Claims one side-channel connection may have waiting, aside, for vLLM to name their request (``claim_wait_s``;
#: one prefill step may finish many prompts at once) while its later frames are served; past it a claim is
#: refused at once (a client's bogus ``kv_transfer_params`` must not hold up the connection).
MAX_WAITING_CLAIMS = 1024
#: How long a decode waits (at most: ``link_timeout_ms`` if shorter) for the ``hello`` it sends on a side
#: channel where a request went unanswered and nothing else was heard; unanswered, the connection is given up.
PROBE_TIMEOUT_S = 1.0
#: At most one WARNING per this many seconds about ``stats_path`` lines that could not be written.
STATS_LOG_EVERY_S = 30.0

DTYPES = {torch.bfloat16: DataType.DT_BF16, torch.float16: DataType.DT_FLOAT16, torch.float32: DataType.DT_FLOAT,
          torch.uint8: DataType.DT_UINT8, torch.int8: DataType.DT_INT8}
for _name in ("float8_e4m3fn", "float8_e5m2"):
    if hasattr(torch, _name):
        DTYPES[getattr(torch, _name)] = DataType.DT_UINT8


@dataclass
class AgentOptions:
    """``kv_connector_extra_config`` as the worker uses it (see docs/vllm.md)."""

    side_channel_host: str = "127.0.0.1"
    side_channel_port: int = 0
    data_host: str = "127.0.0.1"
    data_port: int = 0
    advertise_data: str = ""  # "host:port" decoders dial instead of the listen address
    pull_timeout_ms: int = 30_000
    lease_s: float = 120.0
    claim_grace_s: float = 5.0
    claim_wait_s: float = 5.0
    link_timeout_ms: int = 5_000
    transport: str = ""
    stats_path: str = ""  # append one JSON line per pull and per release here
    shared_secret: str = ""  # side channel handshake and aio.SharedSecret; else $AIO_DATADIST_SECRET
    max_claims_per_connection: int = 4096
    #: Where ``shared_secret`` came from: "code" (these options made in code), "config" (the config's key, which
    #: wins over the environment even when empty), "env" (``$AIO_DATADIST_SECRET``); set by :meth:`from_extra`.
    secret_source: str = dataclasses.field(default="code", init=False, compare=False)

    def __repr__(self) -> str:  # the secret stays out of logs and tracebacks
        shown = {f: getattr(self, f) for f in self.__dataclass_fields__ if f not in ("shared_secret", "secret_source")}
        return f"AgentOptions(shared_secret={'<set>' if self.shared_secret else '<none>'}, {shown})"

    def check_secret(self, source: str = "shared_secret") -> None:
        """Refuse a secret that is not text UTF-8 can carry (a JSON ``\\udcff``, non-UTF-8 bytes in the
        environment): ``LLM_PARAM_INVALID`` naming where it came from, never the secret."""
        if self.shared_secret and not utf8_encodable(self.shared_secret):
            raise LLMException(f"invalid argument 'shared_secret': must be encodable as UTF-8 (from {source})",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)

    def check_hosts(self) -> None:
        """Refuse an empty ``side_channel_host`` or ``data_host`` (a templated config left empty): asyncio takes ""
        for every interface."""
        for name in ("side_channel_host", "data_host"):
            if not getattr(self, name):
                _refuse_option(name, "must name an address (0.0.0.0 for every interface)", getattr(self, name))

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> AgentOptions:
        known = {f.name for f in dataclasses.fields(cls) if f.init}
        unknown = sorted(set(extra) - known - {"load_failure_log"})
        if unknown:
            raise LLMException(f"invalid argument 'kv_connector_extra_config': unknown key {unknown[0]!r}",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        opts = cls()
        # JSON null (a templated config leaving a key unset) for a text option is the option unset, not "None"
        given = {name for name in known & set(extra)
                 if not (extra[name] is None and isinstance(getattr(opts, name), str))}
        for name in given:
            kind, value = type(getattr(opts, name)), extra[name]
            # int() would take True as 1 and cut 2.9 to 2: a bool is no number, an integer has no fraction;
            # str() would take anything: `shared_secret: true` would be the secret "True" (the environment's
            # secret ignored, no warning), `stats_path: false` the file ./False
            taken = not ((kind is str and not isinstance(value, str)) or (kind is not str and isinstance(value, bool))
                         or (kind is int and isinstance(value, float) and not value.is_integer()))
            if taken:
                try:
                    setattr(opts, name, kind(value))
                except (TypeError, ValueError, OverflowError):  # (a JSON integer too big for a float)
                    taken = False
            if not taken:  # raised outside the except: no __context__ carries the value (a secret) along
                what = {int: "an integer", float: "a number", str: "a string"}[kind]
                # a secret given as another type is still the secret (a number): name its type, never its value
                shown = f"a JSON {_json_type(value)}" if name == "shared_secret" else f"{value!r:.60}"
                raise LLMException(f"invalid argument '{name}': must be {what}, got {shown}",
                                   status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if "shared_secret" not in given:
            opts.shared_secret = os.environ.get(SECRET_ENV, "")
        opts.secret_source = "config" if "shared_secret" in given else "env"
        opts.check_secret("shared_secret" if "shared_secret" in given else f"${SECRET_ENV}")
        for name, least in (("max_claims_per_connection", 1), ("pull_timeout_ms", 1), ("link_timeout_ms", 1),
                            ("side_channel_port", 0), ("data_port", 0)):
            if not least <= getattr(opts, name) <= (65535 if name.endswith("port") else 2**31 - 1):
                _refuse_option(name, f"must be an integer >= {least}" if least else "must be a port (0-65535)",
                               getattr(opts, name))
        for name, above in (("lease_s", True), ("claim_grace_s", False), ("claim_wait_s", False)):
            value = getattr(opts, name)
            if not math.isfinite(value) or value < 0 or (above and value == 0):
                _refuse_option(name, "must be a finite number " + ("> 0" if above else ">= 0"), value)
        if opts.pull_timeout_ms + opts.claim_grace_s * 1000 > 2**31 - 1:  # a claim's hold_ms, as the wire says
            _refuse_option("claim_grace_s", "with pull_timeout_ms must make a hold of at most 2**31-1 ms",
                           opts.claim_grace_s)
        opts.check_hosts()
        if opts.advertise_data:
            host, _, port = opts.advertise_data.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                _refuse_option("advertise_data", "must be 'host:port'", opts.advertise_data)
        return opts


def _json_type(value: object) -> str:
    """What JSON calls the type of ``value`` (as ``json.loads`` makes it)."""
    for kind, name in ((bool, "boolean"), ((int, float), "number"), (str, "string"), (list, "array"),
                       (dict, "object")):
        if isinstance(value, kind):
            return name
    return type(value).__name__


def _refuse_option(name: str, rule: str, value: object) -> None:
    raise LLMException(f"invalid argument '{name}': {rule}, got {value!r:.60}",
                       status_code=LLMStatusCode.LLM_PARAM_INVALID)


def kv_layout(kv_caches: dict[str, torch.Tensor], num_blocks: int,
              block_tokens: int) -> tuple[list[torch.Tensor], Layout, int]:
    """vLLM's per-layer KV tensors as cache tensors with blocks first, their layout, and tensors per layer.

    A layer tensor with ``num_blocks`` blocks outermost is one cache tensor;
    one shaped ``(2, num_blocks, ...)`` (K and V apart) is two.
    """
    tensors: list[torch.Tensor] = []
    per_layer = 0
    for name, t in kv_caches.items():
        if not t.is_contiguous():
            raise LLMException(f"invalid argument 'kv_caches': layer {name} is not contiguous",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if t.shape[0] == num_blocks:
            parts = [t]
        elif t.dim() > 1 and t.shape[0] == 2 and t.shape[1] == num_blocks:
            parts = [t[0], t[1]]
        else:
            raise LLMException(f"invalid argument 'kv_caches': layer {name} has shape {tuple(t.shape)}, without "
                               f"its {num_blocks} blocks outermost", status_code=LLMStatusCode.LLM_PARAM_INVALID)
        if per_layer and len(parts) != per_layer:
            raise LLMException(f"invalid argument 'kv_caches': layer {name} differs from the first",
                               status_code=LLMStatusCode.LLM_PARAM_INVALID)
        per_layer = len(parts)
        tensors.extend(parts)
    first = tensors[0]
    if any(t.shape != first.shape or t.dtype != first.dtype or t.device != first.device for t in tensors):
        raise LLMException("invalid argument 'kv_caches': layers differ in shape, dtype or device",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    if first.dtype not in DTYPES:
        raise LLMException(f"invalid argument 'kv_caches': dtype {first.dtype} is not supported",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID)
    block_bytes = first[0].numel() * first.element_size()
    return tensors, Layout(len(tensors), num_blocks, block_bytes, block_tokens, str(first.dtype)), per_layer


def _keepalive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive on ``writer``'s socket, probing after :data:`KEEPALIVE_IDLE_S` (where the OS lets us say)."""
    sock = writer.get_extra_info("socket")
    if sock is None or sock.family not in (socket.AF_INET, socket.AF_INET6):
        return
    idle = getattr(socket, "TCP_KEEPIDLE", None) or getattr(socket, "TCP_KEEPALIVE", None)  # Linux; macOS
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        for option, value in ((idle, KEEPALIVE_IDLE_S), (getattr(socket, "TCP_KEEPINTVL", None), KEEPALIVE_INTERVAL_S),
                              (getattr(socket, "TCP_KEEPCNT", None), KEEPALIVE_COUNT)):
            if option is not None:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)


class _Served:
    """A prefill's side-channel connection past the handshake: what eviction weighs (:meth:`Agent._idlest`)."""

    __slots__ = ("owner", "waiting", "admitted", "heard", "claimed")

    def __init__(self, owner: int, waiting: set[asyncio.Task]) -> None:
        self.owner = owner  # its claims' owner in PrefillHolds
        self.waiting = waiting  # its claims waiting for vLLM to name their request
        self.admitted = 0.0  # when it entered the table (Agent._admit), past its handshake
        self.heard = 0.0  # when its last frame was read, else when it was admitted
        self.claimed = False  # it sent a claim: a decode past its hello and its link


def _host(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return str(peer[0]) if peer else ""


class LoopThread:
    """An asyncio loop on a daemon thread of its own."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, Any]) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, Any], timeout_s: float = 60.0) -> Any:
        return self.submit(coro).result(timeout_s)

    def stop(self) -> None:
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(10)
        if not self._thread.is_alive():
            self.loop.close()


def _reply_frame(rid: int, reply: dict[str, Any]) -> bytes:
    """The prefill's answer to request ``rid``, its error cut to what a decode reads (``MAX_TEXT``): a longer one
    was a malformed frame to the decode, which dropped the side channel with every other load on it (an error
    naming a request id of up to 256 characters; found by a hunt, 2026-12-07)."""
    error = reply.get("error")
    if isinstance(error, str) and len(error) > MAX_TEXT:
        reply = {**reply, "error": error[:MAX_TEXT]}
    return encode_frame({"id": rid, **reply})


class _Peer:
    """A decode worker's side-channel connection to one prefill worker, and its link."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.replies: dict[int, tuple[str, asyncio.Future]] = {}
        self.next_id = 1
        self.cluster_id = 0
        self.engine_id = ""  # the engine its hello named: only requests naming that engine are claimed here
        self.ops: frozenset[str] = frozenset()  # the side-channel requests its hello said it serves
        self.cluster: LLMClusterInfo | None = None  # how to link its KV endpoint (again)
        self.link_lost = False  # a pull found the KV link failed while this side channel stayed up
        self.relinking = asyncio.Lock()
        self.relinks = 0  # attempts to link again that ended
        self.task: asyncio.Task | None = None
        self.broken: BaseException | None = None
        self.refused = ""  # why the prefill closed the side channel, if it said so (a frame of id 0)
        self.answered = 0  # the highest request id the prefill answered: a later one's answer shows it alive
        # prefill request -> pulls and releases of it on this connection: the prefill frees a request on the
        # first done, so done waits for the last of them (two decode requests may carry the same params)
        self.users: dict[str, int] = {}
        self.to_free: set[str] = set()  # requests one of those users claimed: done is owed

    def use(self, req: str) -> None:
        self.users[req] = self.users.get(req, 0) + 1

    def unuse(self, req: str, claimed: bool) -> None:
        """One user of ``req`` is finished (``claimed``: its claim was granted); the last one says done."""
        if claimed:
            self.to_free.add(req)
        left = self.users.pop(req) - 1
        if left:
            self.users[req] = left
        elif req in self.to_free:
            self.to_free.discard(req)
            # An id of its own that nothing awaits (its reply is dropped): a done the prefill cannot honour (the
            # hold ran out) is answered `ok: false` under it, which under id 0 would read as the prefill closing
            # the side channel (read_replies), failing every other load on it.
            rid, self.next_id = self.next_id, self.next_id + 1
            self.writer.write(encode_frame({"id": rid, "op": "done", "req": req}))

    async def request(self, op: str, timeout_s: float, **fields: Any) -> dict[str, Any]:
        """Send a request and await its reply. Unanswered within ``timeout_s`` and no request sent after it
        answered (a reply to an earlier one, read late, says nothing of it), the prefill is asked a ``hello``
        (answered at once, whatever its claims wait on): unanswered too, the connection went silent (no FIN or
        RST: a flow a NAT or firewall forgot, a host gone) and is given up, so the next request dials again
        instead of timing out on it in turn."""
        if self.broken is not None:
            raise ConnectionError(f"side channel lost: {self.broken}")
        rid, self.next_id = self.next_id, self.next_id + 1
        future = asyncio.get_running_loop().create_future()
        self.replies[rid] = (op, future)
        try:
            self.writer.write(encode_frame({"id": rid, "op": op, **fields}))
            # not asyncio.wait_for: on Python 3.11 it drops a cancel that comes as the reply lands (an abort)
            async with asyncio.timeout(timeout_s):
                return await future
        except TimeoutError:
            if op != "hello" and self.answered < rid and self.broken is None:
                try:
                    await self.request("hello", min(timeout_s, PROBE_TIMEOUT_S))
                except (TimeoutError, ConnectionError):
                    self.lose(f"no answer to a {op} nor to a hello after it")
            raise
        finally:
            self.replies.pop(rid, None)

    def lose(self, why: str) -> None:
        """Give the connection up: its requests fail, the next one dials again (the prefill frees our claims
        once it sees the close, else when they time out)."""
        if self.broken is None:
            self.broken = ConnectionError(why)
            log.warning("side channel to %s given up: %s", self.writer.get_extra_info("peername"), why)
        self.writer.transport.abort()

    async def read_replies(self) -> None:
        try:
            while True:
                body = await self.reader.readexactly(frame_length(await self.reader.readexactly(HEADER.size)))
                reply = decode_reply(body, "")
                rid = reply["id"]
                self.answered = max(self.answered, rid)
                if rid == 0 and not reply["ok"]:  # the prefill closes the side channel and says why (a full table)
                    self.refused = reply["error"][:200]
                    raise ConnectionError(f"the prefill closed the side channel: {self.refused}")
                op, future = self.replies.get(rid, ("", None))
                if future is not None and not future.done():
                    future.set_result(decode_reply(body, op))
        except (OSError, EOFError, asyncio.IncompleteReadError, LLMException) as exc:
            if self.broken is None:
                self.broken = exc
        finally:
            if self.broken is None:  # cancelled (the agent closing): nothing reads its replies any more
                self.broken = ConnectionError("side channel closed")
            self.writer.close()
            for _, future in self.replies.values():
                if not future.done():
                    future.set_exception(ConnectionError(
                        f"the prefill closed the side channel: {self.refused}" if self.refused
                        else "side channel closed"))


class Agent:
    """One vLLM worker's aio_datadist endpoint: a prefill serves its blocks, a decode pulls them."""

    def __init__(self, producer: bool, consumer: bool, engine_id: str, options: AgentOptions) -> None:
        options.check_secret()  # before anything is started
        options.check_hosts()
        self.producer, self.consumer = producer, consumer
        self.engine_id = engine_id
        self.options = options
        self.holds = PrefillHolds()
        self.pulls = DecodePulls()
        self.loop = LoopThread("aio-datadist-vllm")
        self.cluster_id = random.getrandbits(63)
        self.layout: Layout | None = None
        self.side_channel: tuple[str, int] | None = None
        self._dd: LLMDataDist | None = None
        self._cache: Any = None
        self._server: asyncio.Server | None = None
        self._peers: dict[tuple[str, int], asyncio.Task] = {}
        self._pulling: set[asyncio.Task] = set()  # decode: pulls and releases running; _close ends them
        #: Set by close() (under _submitting) before _close is submitted: nothing is dialled, no pull starts and
        #: nothing is submitted to the loop after it (a pull asked for then ends aborted at once).
        self._closing = False
        self._submitting = threading.Lock()  # start_pull and release_unpulled (vLLM's thread) against close()
        self._conns: set[asyncio.StreamWriter] = set()
        #: Side-channel connections past the handshake (MAX_CONNECTIONS), oldest first.
        self._established: dict[asyncio.StreamWriter, _Served] = {}
        self._serving: set[asyncio.Task] = set()  # side-channel connections being served: _close ends them
        self._handshaking: dict[asyncio.StreamWriter, bool] = {}  # oldest first; True once it sent its hello
        self._secret = options.shared_secret.encode() if options.shared_secret else None
        #: Our decode dials' hello nonces while they run: our side channel answers none of them (own_dials).
        self._own_dials = OwnDials()
        self._refusal_log = RefusalLog(log)  # one WARNING per REFUSAL_LOG_EVERY_S, with a count
        self._bad_frames = RefusalLog(log, "bad frames")  # any process can send them: paced as the refusals
        self._stats_failed_logged = -STATS_LOG_EVERY_S
        self.refusals = 0  # side-channel connections refused or evicted, all told
        self._expiry: asyncio.TimerHandle | None = None
        #: Claims waiting for vLLM to name their request, by request: woken by PrefillHolds.add (on_added).
        self._naming: dict[str, set[asyncio.Future]] = {}
        self.holds.on_added = self._added

    def record(self, event: str, **fields: Any) -> None:
        """One JSON line in ``stats_path`` (pulls, releases): the figures and the tests read them. Never raises:
        it runs in the cleanup of pulls and side-channel connections (a line that cannot be written is logged)."""
        if not self.options.stats_path:
            return
        try:
            with open(self.options.stats_path, "a") as out:
                out.write(json.dumps({"event": event, "t": time.time(), "engine": self.engine_id, **fields}) + "\n")
        except (OSError, ValueError) as exc:  # ValueError: a path open() refuses (a NUL, a lone surrogate)
            now = time.monotonic()
            if now - self._stats_failed_logged >= STATS_LOG_EVERY_S:
                self._stats_failed_logged = now
                log.warning("stats_path %s: %s line not written: %s", self.options.stats_path, event, exc)

    # -- set-up and shutdown ------------------------------------------------------------

    def register(self, tensors: Sequence[torch.Tensor], layout: Layout) -> None:
        """Start the endpoint, register vLLM's KV tensors, and (prefill) open the side channel."""
        self.layout = layout
        self.loop.call(self._start(list(tensors), layout))

    async def _start(self, tensors: list[torch.Tensor], layout: Layout) -> None:
        role = LLMRole.MIX if self.producer and self.consumer else LLMRole.PROMPT if self.producer else LLMRole.DECODER
        config = LLMConfig()
        config.device_id = 0
        config.sync_kv_timeout = self.options.pull_timeout_ms
        if self.producer:
            config.listen_ip_info = f"{self.options.data_host}:{self.options.data_port}"
        options = config.generate_options()
        if self.options.transport:
            options["aio.Transport"] = self.options.transport
        if self._secret is not None:
            options["aio.SharedSecret"] = self.options.shared_secret
        else:
            log.warning("aio_datadist connector: %s: the side channel and the KV "
                        "links are unauthenticated; any process that reaches them can claim, release or "
                        "read held blocks",
                        f"shared_secret is empty in kv_connector_extra_config, which wins over ${SECRET_ENV}"
                        if self.options.secret_source == "config" and os.environ.get(SECRET_ENV) else
                        "no shared_secret in its AgentOptions" if self.options.secret_source == "code" else
                        f"no shared_secret (nor ${SECRET_ENV})")
        self._dd = LLMDataDist(role, self.cluster_id)
        await self._dd.init(options)
        desc = CacheDesc(layout.tensors, tuple(tensors[0].shape), DTYPES[tensors[0].dtype], Placement.HOST)
        key = BlocksCacheKey(self.cluster_id, 0) if self.producer else None
        self._cache = self._dd.kv_cache_manager.register_blocks_cache(desc, tensors, key)
        if self.producer:
            self._server = await asyncio.start_server(self._accepted, self.options.side_channel_host,
                                                      self.options.side_channel_port)
            self.side_channel = self._server.sockets[0].getsockname()[:2]
            self._tick()

    def _tick(self) -> None:
        try:
            self.holds.expire()
            for req_id in self.holds.take_expired():
                log.warning("request %s: blocks released unpulled after its lease or claim ran out", req_id)
                self.record("release", req=req_id, why="expired")
        finally:
            self._expiry = self.loop.loop.call_later(0.5, self._tick)

    def close(self) -> None:
        with self._submitting:  # a pull or release asked for from now on is not submitted (start_pull)
            self._closing = True
        if not self.loop.loop.is_closed():
            with contextlib.suppress(Exception):
                self.loop.call(self._close(), 30)
        self.loop.stop()

    async def _close(self) -> None:
        if self._expiry is not None:
            self._expiry.cancel()
        if self._server is not None:
            self._server.close()
            await asyncio.sleep(0)  # connections accepted already get their task (_accepted) in this pass
        for writer in list(self._conns):
            writer.transport.abort()
        serving = [*self._serving]
        for task in serving:  # one waiting for a claim's request to be named reads nothing: cancel it
            task.cancel()
        if serving:
            await asyncio.wait(serving)
        # the decode's pulls and releases before its side channels: a pull cancelled ends as aborted, and its
        # release dials nothing now (_release); the prefill frees what those connections claimed when they close
        pulling = [*self._pulling]
        for task in pulling:
            task.cancel()
        if pulling:
            await asyncio.wait(pulling)
        for task in list(self._peers.values()):
            task.cancel()
            with contextlib.suppress(BaseException):
                peer = await task
                peer.writer.transport.abort()
                if peer.task is not None:
                    peer.task.cancel()
        if self._dd is not None:
            await self._dd.finalize()

    # -- prefill: the side-channel server -------------------------------------------------

    def _hello(self) -> dict[str, Any]:
        assert self._dd is not None and self.layout is not None
        address = self._dd.listen_address
        assert address is not None
        host, port = address
        if self.options.advertise_data:
            host, _, text = self.options.advertise_data.rpartition(":")
            port = int(text)
        return {"ok": True, "cluster_id": self.cluster_id, "data_host": host, "data_port": port,
                "engine_id": self.engine_id, "layout": self.layout.as_json(), "ops": list(OPS)}

    def _refuse(self, writer: asyncio.StreamWriter, why: object) -> None:
        """Note a refused side-channel connection (logged at the pace of ``refusal_log``)."""
        self.refusals += 1
        self._refusal_log.note("side channel from %s refused: %s", writer.get_extra_info("peername"), why)

    async def _authenticate(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
        """The handshake, bounded in time and in how many run at once; False: the connection is refused."""
        assert self._secret is not None
        if len(self._handshaking) >= MAX_PENDING_HANDSHAKES:
            # one of the host holding the most (anyone can send a hello: a flood from one host does not push
            # out a decode elsewhere, whose hello or proof may be a network away); of those, the oldest that
            # has said nothing yet (a flood of silent connections never pushes out a decode that sent its
            # hello), else the oldest
            hosts = collections.Counter(_host(w) for w in self._handshaking)
            top = max(hosts, key=hosts.__getitem__)
            theirs = [(w, spoke) for w, spoke in self._handshaking.items() if _host(w) == top]
            victim = next((w for w, spoke in theirs if not spoke), theirs[0][0])
            del self._handshaking[victim]
            victim.transport.abort()
        self._handshaking[writer] = False

        def spoke() -> None:
            if writer in self._handshaking:
                self._handshaking[writer] = True

        try:
            async with asyncio.timeout(self.options.link_timeout_ms / 1000):
                await vllm_auth.accept(reader, writer, self._secret, spoke, self._own_dials.came_back)
            return True
        except (vllm_auth.AuthError, OSError, TimeoutError) as exc:
            if writer not in self._handshaking:
                why = f"evicted: {MAX_PENDING_HANDSHAKES} newer connections in the handshake"
            else:
                why = str(exc) or "the handshake timed out"
            self._refuse(writer, why)
            return False
        finally:
            self._handshaking.pop(writer, None)

    def _accepted(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A side-channel connection came in: its task is ours from the start (``_close`` ends every one; the
        server's own task would log an ERROR for one cancelled on Python 3.11)."""
        task = asyncio.get_running_loop().create_task(self._serve(reader, writer))
        self._serving.add(task)
        task.add_done_callback(self._serving.discard)

    def _idlest(self) -> asyncio.StreamWriter | None:
        """The connection past the handshake idle longest that may be evicted, if any: one that holds no claim,
        has none waiting, and either claimed before or was admitted ``link_timeout_ms`` ago or longer (a decode
        between its hello and its first claim is linking: newcomers dialling at once do not push each other
        out before they can claim)."""
        owners = self.holds.owners()
        young = time.monotonic() - self.options.link_timeout_ms / 1000
        free = [(served.heard, writer) for writer, served in self._established.items()
                if not served.waiting and served.owner not in owners and (served.claimed or served.admitted <= young)]
        return min(free, key=lambda pair: pair[0])[1] if free else None

    def _admit(self, writer: asyncio.StreamWriter, served: _Served) -> str:
        """Take a connection past the handshake into the table (MAX_CONNECTIONS), evicting if need be
        (:meth:`_idlest`: a decode gone without a FIN or RST, a flow a NAT forgot, holds its slot until then);
        "" if taken, else why it is refused (no connection there may be evicted)."""
        if len(self._established) >= MAX_CONNECTIONS:
            victim = self._idlest()
            if victim is None:
                why = (f"the side channel is full: {MAX_CONNECTIONS} connections, each holding or awaiting a claim "
                       "or admitted under link_timeout_ms ago")
                self._refuse(writer, why)
                return why
            del self._established[victim]
            self._refuse(victim, f"evicted: idle longest of {MAX_CONNECTIONS} side-channel connections holding no "
                                 "claim, for a new one")
            victim.transport.abort()
        served.admitted = served.heard = time.monotonic()
        self._established[writer] = served
        return ""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        # A full table refuses a newcomer only past the handshake, with a frame saying so (id 0, as for a bad
        # frame): the decode reports why, not a secret mismatch, and a process without the secret learns nothing
        _keepalive(writer)
        self._conns.add(writer)
        owner = id(writer)
        hold_s = self.options.pull_timeout_ms / 1000 + self.options.claim_grace_s
        waiting: set[asyncio.Task] = set()  # claims waiting for their request to be named
        served = _Served(owner, waiting)
        try:
            # with a secret, only a connection that proved it may push another out of the table
            if self._secret is not None and not await self._authenticate(reader, writer):
                return
            refused = self._admit(writer, served)
            if refused:
                writer.write(encode_frame({"id": 0, "ok": False, "error": refused}))
                return
            while True:
                try:
                    header = await reader.readexactly(HEADER.size)
                    message = decode_frame(await reader.readexactly(frame_length(header)))
                    served.heard = time.monotonic()
                except LLMException as exc:  # a bad frame ends the connection: nothing of it is acted on
                    self._bad_frames.note("side channel from %s: %s", writer.get_extra_info("peername"),
                                          peer_str(str(exc)[:200]))
                    writer.write(encode_frame({"id": 0, "ok": False, "error": str(exc)[:200]}))
                    return
                op, rid = message["op"], message["id"]
                if op == "hello":
                    reply = self._hello()
                elif op == "claim":
                    served.claimed = True
                    req = message["req"]
                    if self.holds.known(req):
                        reply = self._claim_now(req, owner, hold_s)
                    elif len(waiting) < MAX_WAITING_CLAIMS:
                        # vLLM's metadata naming it may come a step later: wait aside, the next frames go on
                        claim = asyncio.ensure_future(self._answer_claim(writer, rid, req, owner, hold_s))
                        waiting.add(claim)
                        claim.add_done_callback(waiting.discard)
                        continue
                    else:  # refused at once: waiting here would stop this connection's other frames too
                        reply = {"ok": False, "error": f"request {req[:120]} is not known here, and this connection "
                                                      f"has {MAX_WAITING_CLAIMS} claims waiting already"}
                elif op == "held":
                    reply = {"ok": self.holds.held_by(message["req"], owner)}
                    if not reply["ok"]:
                        reply["error"] = "not held for this connection (released, or never claimed here)"
                else:
                    reply = {"ok": self.holds.done(message["req"], owner)}
                    if reply["ok"]:
                        self.record("release", req=message["req"], why="done")
                    else:
                        reply["error"] = "not claimed by this connection"
                writer.write(_reply_frame(rid, reply))
                await writer.drain()  # a peer that does not read its replies is not read either
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            try:
                for task in list(waiting):  # before the claims are dropped: none of these may claim afterwards
                    task.cancel()
                self._conns.discard(writer)
                if self._established.get(writer) is served:
                    del self._established[writer]
                self._handshaking.pop(writer, None)
                gone = self.holds.drop_owner(owner)
                if gone:
                    log.warning("side channel closed with requests %s claimed: their blocks are released", gone)
                for req_id in gone:
                    self.record("release", req=req_id, why="closed")
            finally:
                writer.close()

    async def _claim(self, req: str, owner: int, hold_s: float) -> dict[str, Any]:
        """Claim ``req`` for the connection ``owner``, once vLLM named it (``claim_wait_s`` at most); the reply."""
        named = asyncio.get_running_loop().create_future()
        waiting = self._naming.setdefault(req, set())
        waiting.add(named)
        try:
            if not self.holds.known(req):  # asked after the future is in place: an add now wakes it
                # not asyncio.wait_for: on Python 3.11 it drops the cancel of a connection closing as the request
                # is named, and the claim would be granted to that connection after its claims were dropped
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(self.options.claim_wait_s):
                        await named
        finally:
            waiting.discard(named)
            if not waiting and self._naming.get(req) is waiting:
                del self._naming[req]
        return self._claim_now(req, owner, hold_s)

    def _added(self, req: str) -> None:
        """vLLM named ``req`` (PrefillHolds.add, on vLLM's thread): wake the claims waiting for it."""
        with contextlib.suppress(RuntimeError):  # the loop closed: nothing waits any more
            self.loop.loop.call_soon_threadsafe(self._wake, req)

    def _wake(self, req: str) -> None:
        for named in self._naming.get(req, ()):
            if not named.done():
                named.set_result(None)

    def _claim_now(self, req: str, owner: int, hold_s: float) -> dict[str, Any]:
        limit = self.options.max_claims_per_connection
        if self.holds.claim(req, owner, hold_s, max_owned=limit):
            blocks = self.holds.blocks(req)
            return {"ok": True, "hold_ms": int(hold_s * 1000), **({"blocks": blocks} if blocks else {})}
        return {"ok": False, "error": f"request {req[:120]} holds no blocks here (finished or expired), "
                                      f"or this connection holds {limit} claims already"}

    async def _answer_claim(self, writer: asyncio.StreamWriter, rid: int, req: str, owner: int,
                            hold_s: float) -> None:
        reply = await self._claim(req, owner, hold_s)
        writer.write(_reply_frame(rid, reply))  # claimed and answered in one step of the loop

    # -- decode: pulls ---------------------------------------------------------------------

    def start_pull(self, req_id: str, remote: RemotePrefill, local_blocks: Sequence[int]) -> None:
        """Pull ``remote``'s blocks into ``local_blocks`` in the background; the result lands in :attr:`pulls`.
        Once :meth:`close` began, the pull ends at once as aborted (reported failed), as one it cut does."""
        with self._submitting:
            self.pulls.start(req_id, tuple(local_blocks))
            if not self._closing:
                self.loop.submit(self._pull(req_id, remote, tuple(local_blocks)))
                return
        self.pulls.end(req_id, False, "aborted")
        self._record_pull(req_id, len(local_blocks), False, "aborted", 0.0)

    def _record_pull(self, req_id: str, blocks: int, ok: bool, error: str, seconds: float) -> None:
        """The stats line of a pull that ended (:meth:`record`)."""
        self.record("pull", req=req_id, ok=ok, error=error, seconds=seconds, blocks=blocks,
                    authenticated=self._secret is not None,
                    bytes=blocks * (self.layout.block_bytes * self.layout.tensors if self.layout else 0))

    def _track(self) -> None:
        """The running pull or release is one :meth:`_close` cancels and awaits before the loop closes."""
        task = asyncio.current_task()
        if task is not None and task not in self._pulling:
            self._pulling.add(task)
            task.add_done_callback(self._pulling.discard)

    async def _peer(self, host: str, port: int) -> _Peer:
        if self._closing:  # a side channel dialled now would outlive the close
            raise ConnectionError("the connector is closing")
        task = self._peers.get((host, port))
        if task is not None and task.done() and (task.exception() is not None or task.result().broken is not None):
            task = None
        if task is None:
            task = self._peers[(host, port)] = asyncio.ensure_future(self._connect(host, port))
            task.add_done_callback(functools.partial(self._connected, (host, port)))
        return await asyncio.shield(task)

    def _connected(self, key: tuple[str, int], task: asyncio.Task) -> None:
        """A side channel that failed to connect, or once it is lost, leaves the table (the addresses come from
        request data: the table must not keep one entry per address ever named)."""
        if task.cancelled() or task.exception() is not None:
            self._forget_peer(key, task)
            return
        peer = task.result()
        if peer.task is not None:
            peer.task.add_done_callback(lambda _: self._forget_peer(key, task))

    def _forget_peer(self, key: tuple[str, int], task: asyncio.Task) -> None:
        if self._peers.get(key) is task:
            del self._peers[key]

    async def _peer_of(self, remote: RemotePrefill) -> _Peer:
        """The side channel to the prefill ``remote`` names, refused if the engine there is another one (a prefill
        restarted on that port, a stale address): its request of the same id holds other blocks, and a claim
        and done there would free them under its own decode."""
        peer = await self._peer(remote.host, remote.port)
        if peer.engine_id != remote.engine_id:
            raise ConnectionError(f"the side channel at {remote.host}:{remote.port} is engine {peer.engine_id!r}, "
                                  f"not {remote.engine_id!r} the request names")
        return peer

    async def _connect(self, host: str, port: int) -> _Peer:
        timeout_s = self.options.link_timeout_ms / 1000
        deadline = time.monotonic() + timeout_s
        for attempt in range(HANDSHAKE_ATTEMPTS):
            # asyncio.timeout, not wait_for: on Python 3.11 that drops a cancel (_close) coming as it finishes
            async with asyncio.timeout(max(0.0, deadline - time.monotonic())):
                reader, writer = await asyncio.open_connection(host, port)
            _keepalive(writer)
            if self._secret is not None:
                try:
                    async with asyncio.timeout(deadline - time.monotonic()):
                        await vllm_auth.dial(reader, writer, self._secret, self._own_dials)
                except vllm_auth.HandshakeClosed:  # a flood at the prefill may have evicted us: try again
                    writer.transport.abort()
                    if attempt == HANDSHAKE_ATTEMPTS - 1 or time.monotonic() >= deadline:
                        raise
                    continue
                except BaseException:
                    writer.transport.abort()
                    raise
            peer = _Peer(reader, writer)
            reading = peer.task = asyncio.ensure_future(peer.read_replies())
            try:
                hello = await peer.request("hello", timeout_s)
                break
            except ConnectionError:
                writer.transport.abort()
                reading.cancel()
                # closed before a word of answer, with no reason given: evicted from the prefill's handshake
                # while our proof was on its way (after its proof reached us): try again, as above
                if (self._secret is None or peer.answered or peer.refused or attempt == HANDSHAKE_ATTEMPTS - 1
                        or time.monotonic() >= deadline):
                    raise
            except BaseException:
                writer.transport.abort()
                reading.cancel()
                raise
        try:
            if not hello["ok"]:
                raise ConnectionError(f"prefill refused hello: {hello['error']}")
            theirs: Layout = hello["layout"]
            assert self.layout is not None
            if (theirs.tensors, theirs.block_bytes, theirs.block_tokens, theirs.dtype) != (
                    self.layout.tensors, self.layout.block_bytes, self.layout.block_tokens, self.layout.dtype):
                raise ConnectionError(f"prefill KV layout {theirs} differs from ours {self.layout}")
            cluster = LLMClusterInfo()
            cluster.remote_cluster_id = hello["cluster_id"]
            cluster.append_remote_ip_info(hello["data_host"], hello["data_port"])
            await self._link(cluster)
            peer.cluster_id, peer.cluster, peer.engine_id = hello["cluster_id"], cluster, hello["engine_id"]
            peer.ops = frozenset(hello.get("ops", ("hello", "claim", "done")))  # none said: a prefill before held
            return peer
        except BaseException:
            writer.transport.abort()
            reading.cancel()
            raise

    async def _link(self, cluster: LLMClusterInfo) -> None:
        assert self._dd is not None
        status, per = await self._dd.link_clusters([cluster], timeout=self.options.link_timeout_ms)
        # LLM_ALREADY_LINK: only the side channel was lost (a broken link is replaced, not reported so)
        if status != LLMStatusCode.LLM_SUCCESS and per != [LLMStatusCode.LLM_ALREADY_LINK]:
            raise ConnectionError(f"link to prefill cluster {cluster.remote_cluster_id} failed: {per}")

    async def _relink_if_lost(self, peer: _Peer) -> None:
        """Link the KV endpoint again after a pull found its link failed: one attempt for all the pulls
        waiting, and those pulls fail with it (rather than each trying again in turn)."""
        if not peer.link_lost:
            return
        tried = peer.relinks
        async with peer.relinking:
            if not peer.link_lost:
                return
            if peer.relinks != tried:  # an attempt ended while we waited, and failed
                raise ConnectionError(f"link to prefill cluster {peer.cluster_id} is lost: linking again failed")
            assert peer.cluster is not None
            try:
                await self._link(peer.cluster)
            except asyncio.CancelledError:
                raise  # this pull was aborted, the link did not fail: a pull waiting here tries in its turn
            except BaseException:
                peer.relinks += 1
                raise
            peer.link_lost = False

    async def _pull(self, req_id: str, remote: RemotePrefill, local: tuple[int, ...]) -> None:
        self._track()
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        self.pulls.set_cancel(req_id, lambda: loop.call_soon_threadsafe(task.cancel))
        ok, error, peer = False, "", None
        claimed = asking = using = False
        started = time.monotonic()
        try:
            if self._closing:  # started as the connector closes: ended as an abort, nothing dialled
                raise asyncio.CancelledError
            assert self.layout is not None
            check_blocks_cover(remote, self.layout.block_tokens)  # the blocks are taken by their place below
            if len(local) > len(remote.block_ids):
                raise ValueError(f"{len(local)} local blocks for {len(remote.block_ids)} remote ones")
            # blocks the decode found in its own prefix cache are not pulled: pull the tail
            src = list(remote.block_ids[len(remote.block_ids) - len(local):])
            peer = await self._peer_of(remote)
            await self._relink_if_lost(peer)
            peer.use(remote.request_id)
            using = asking = True
            asked = time.monotonic()
            reply = await peer.request("claim", self.options.link_timeout_ms / 1000, req=remote.request_id)
            asking = False
            if not reply["ok"]:
                raise ConnectionError(reply["error"])
            claimed = True
            if "blocks" in reply and reply["blocks"] != blocks_digest(remote.block_ids):
                # kv_transfer_params are request data (a client's own, a stale copy): the claim holds other blocks
                raise ConnectionError(f"request {remote.request_id} holds other blocks at the prefill than "
                                      "kv_transfer_params name")
            # the prefill frees the blocks hold_ms after it granted the claim (its own pull_timeout_ms and
            # claim_grace_s): stop pulling by then, counted from when the claim left
            left_ms = reply["hold_ms"] - int((time.monotonic() - asked) * 1000)
            if left_ms <= 0:
                raise TimeoutError(f"the claim's hold ({reply['hold_ms']} ms) ran out before the pull began")
            assert self._dd is not None
            await self._dd.kv_cache_manager.pull_blocks(BlocksCacheKey(peer.cluster_id, 0), self._cache,
                                                        src_blocks=src, dst_blocks=list(local),
                                                        timeout=min(self.options.pull_timeout_ms, left_ms))
            # The bytes are the request's only if the prefill held its blocks for us all along: it frees them on
            # our done, when it sees this side channel close (which we may not see: a reset on its side only),
            # or past hold_ms, and never holds them for this claim again, so held now means held throughout.
            if "held" in peer.ops:
                held = await peer.request("held", self.options.link_timeout_ms / 1000, req=remote.request_id)
                if not held["ok"]:
                    raise ConnectionError(f"the prefill released the blocks during the pull: {held['error']}")
            elif peer.task is None or peer.task.done() or peer.reader.at_eof() or peer.writer.is_closing():
                # a prefill of a release before held: only our own end of the side channel can tell
                raise ConnectionError("side channel lost during the pull: the prefill released the blocks")
            ok = True
        except asyncio.CancelledError:
            error = "aborted"
        except Exception as exc:  # the request is recomputed (or failed) by vLLM's load-failure policy
            # escaped: it may hold request data (kv_transfer_params' request id) or a peer's words
            error = peer_str(f"{type(exc).__name__}: {exc}")
            if peer is not None and isinstance(exc, LLMException) and exc.status_code in (
                    LLMStatusCode.LLM_LINK_FAILED, LLMStatusCode.LLM_NOT_YET_LINK):
                peer.link_lost = True  # the next pull through this side channel links again first
            log.warning("request %s: pull from %s:%s failed: %s", req_id, peer_str(remote.host), remote.port, error)
        finally:
            # pull_blocks has returned or raised: no byte of it can land in `local` any more
            self.pulls.end(req_id, ok, error)
            if using and peer is not None:
                with contextlib.suppress(Exception):
                    peer.unuse(remote.request_id, claimed)
            self._record_pull(req_id, len(local), ok, error, time.monotonic() - started)
        if not claimed and (asking or error == "aborted"):
            # aborted before its claim was sent, or its claim unanswered (it may still succeed at the prefill):
            # free the blocks as for a request aborted before its load (claim + done), not only after a timeout
            await self._release(remote)

    def release_unpulled(self, remote: RemotePrefill) -> None:
        """Tell the prefill that this decode will not pull ``remote`` (aborted, or a local prefix-cache hit).
        Once :meth:`close` began it is dropped: the prefill frees the blocks at their lease (or as the closing
        side channel drops its claims)."""
        with self._submitting:
            if not self._closing:
                self.loop.submit(self._release(remote))

    async def _release(self, remote: RemotePrefill) -> None:
        self._track()
        if self._closing:  # closing: no side channel is dialled for it (the prefill's lease frees the blocks)
            return
        try:
            peer = await self._peer_of(remote)
            peer.use(remote.request_id)
            claimed = False
            try:
                reply = await peer.request("claim", self.options.link_timeout_ms / 1000, req=remote.request_id)
                claimed = reply["ok"]
            finally:
                peer.unuse(remote.request_id, claimed)
        except Exception as exc:  # the prefill's lease frees the blocks in the end
            log.warning("request %s: could not tell the prefill to free its blocks: %s", peer_str(remote.request_id),
                        peer_str(str(exc)))
