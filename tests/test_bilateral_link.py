"""Bilateral links: ``LLMDataDist.link``, ``query_register_mem_status``, ``unlink`` (CacheManager mode).

The peers are spawned processes that answer commands (``link``, ``status``,
``wait``, ``unlink``, ``cm`` for a CacheManager method, ``dump``); each test
runs on both event loops here, and its peers on the other one. Addresses
are loopback "device ips": the prompt is 127.0.0.1 (rank 0, it dials), the
decoder 127.0.0.2 (rank 1, it listens on ``aio.LinkPort + 1``), so every
process of a test is given the same ``aio.LinkPort`` or ``aio.RankAddresses``,
as one deployment would be.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing.connection
import traceback
from typing import Any

import pytest
import torch
from peers import (
    BLOCKS_DESC,
    CACHE_DESC,
    CacheSpec,
    EndpointSpec,
    Ref,
    _next_command,
    _watchdog,
    fill,
    free_port,
    leave_during_set_up,
    pattern,
    run_endpoint,
    spawned,
    tensors_from_dump,
)

from aio_datadist import (
    BlocksCacheKey,
    CacheKey,
    KvCache,
    LLMClusterInfo,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    RegisterMemStatus,
    bilateral,
    compat,
)
from aio_datadist._negotiated_transport import negotiated_transport
from aio_datadist.link_table import LinkTable
from aio_datadist.ranktable import RankEntry, rank_address
from aio_datadist.testing import link_to

pytestmark = pytest.mark.usefixtures("fork_server")  # peers are forked from it

S = LLMStatusCode
OK, PREPARING, FAILED = RegisterMemStatus.OK, RegisterMemStatus.PREPARING, RegisterMemStatus.FAILED
PROMPT_IP, DECODER_IP, THIRD_IP = "127.0.0.1", "127.0.0.2", "127.0.0.3"
PROMPT_ID, DECODER_ID, THIRD_ID = 1, 2, 3
#: How long a test waits for a status to settle; far above what linking takes on loopback.
SETTLE_S = 20.0
STATUS_VALUES = {int(code) for code in LLMStatusCode}


def rank_table(*device_ips: str) -> str:
    """The HIXL samples' rank table: one server per device, rank i at ``device_ips[i]``."""
    return json.dumps({
        "server_count": str(len(device_ips)), "status": "completed", "version": "1.2",
        "server_list": [{"device": [{"device_id": "0", "device_ip": ip, "rank_id": str(rank)}],
                         "host_ip": ip, "server_id": str(rank + 1)} for rank, ip in enumerate(device_ips)],
    })


def v2_options(transport: str = "tcp", **config: Any) -> dict[str, Any]:
    """CacheManager-mode options for a loopback endpoint that does not listen by itself."""
    cfg = LLMConfig()
    cfg.device_id = 0
    cfg.enable_cache_manager = True
    cfg.transport = transport
    for name, value in config.items():
        setattr(cfg, name, value)
    return cfg.generate_options()


def other_loop() -> str:
    """The loop the spawned peers run: the one this test does not."""
    return "asyncio" if "uvloop" in type(asyncio.get_running_loop()).__module__ else "uvloop"


async def settled(dd: LLMDataDist, comm_id: int, limit_s: float = SETTLE_S) -> RegisterMemStatus:
    """Poll as the clients do until the comm is no longer PREPARING (or ``limit_s`` passed)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + limit_s
    while (status := dd.query_register_mem_status(comm_id)) is PREPARING and loop.time() < deadline:
        await asyncio.sleep(0.02)
    return status


async def expect_code(code: LLMStatusCode, awaitable: Any) -> LLMException:
    with pytest.raises(LLMException) as exc:
        await awaitable
    assert exc.value.status_code == code, exc.value
    return exc.value


def prompt_spec(config: dict[str, Any], cluster_id: int = PROMPT_ID) -> EndpointSpec:
    caches = (CacheSpec("blocks", BLOCKS_DESC, seed=21, blocks=True, model_id=0),
              CacheSpec("rows", CACHE_DESC, seed=22, req_ids=(100, 101, 102)))
    return EndpointSpec(LLMRole.PROMPT, cluster_id, listen=False, caches=caches, config=tuple(config.items()),
                        loop=other_loop())


# -- the spawned peer ------------------------------------------------------------------------


def _v2_main(conn: multiprocessing.connection.Connection, spec: EndpointSpec, parent_pid: int) -> None:
    run_endpoint(conn, spec, parent_pid, _serve_v2, _watchdog)


async def _serve_v2(conn: multiprocessing.connection.Connection, spec: EndpointSpec) -> None:
    async with LLMDataDist(spec.role, spec.cluster_id) as dd:
        await dd.init(v2_options(**dict(spec.config)))
        cm = dd.cache_manager
        caches: dict[str, KvCache] = {}
        for c in spec.caches:
            if c.blocks:
                caches[c.name] = cm.allocate_blocks_cache(c.desc, BlocksCacheKey(spec.cluster_id, c.model_id or 0))
            else:
                caches[c.name] = cm.allocate_cache(c.desc, [CacheKey(spec.cluster_id, r) for r in c.req_ids])
            fill(caches[c.name], c.seed)
        conn.send(("ready", {"port": 0, "caches": {n: c.cache_id for n, c in caches.items()}}))
        while True:
            command, args, kwargs = await _next_command(conn)
            if command == "exit":
                break
            try:
                result = await _v2_command(dd, caches, command, args, kwargs)
            except LLMException as exc:
                conn.send(("llm", int(exc.status_code), str(exc)))
            except Exception:
                conn.send(("error", traceback.format_exc()))
            else:
                conn.send(("ok", result))


async def _v2_command(dd: LLMDataDist, caches: dict[str, KvCache], command: str, args: tuple,
                      kwargs: dict) -> Any:
    if command == "link":
        return await dd.link(*args)
    if command == "status":
        return dd.query_register_mem_status(args[0]).name
    if command == "wait":
        return (await settled(dd, args[0])).name
    if command == "unlink":
        return await dd.unlink(args[0])
    if command == "cm":
        def resolve(value: Any) -> Any:
            return caches[value.name] if isinstance(value, Ref) else value

        result = getattr(dd.cache_manager, args[0])(*map(resolve, args[1:]), **kwargs)
        if asyncio.iscoroutine(result):
            result = await result
        return None if isinstance(result, KvCache) else result
    if command == "dump":
        return [t.numpy().tobytes() for t in caches[args[0]].tensors]
    if command == "transport":
        return negotiated_transport(dd, args[0])
    raise ValueError(f"unknown command {command!r}")


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_link_transfer_unlink_between_processes(transport):
    """The decoder links first (PREPARING, transfers refused), the prompt follows; both reach OK, bytes
    move both ways over the transport asked for; the decoder unlinks and the prompt sees FAILED."""
    config = {"transport": transport, "link_port": free_port(DECODER_IP) - 1, "link_total_time": 30}
    table = rank_table(PROMPT_IP, DECODER_IP)
    async with spawned(prompt_spec(config), target=_v2_main) as (prompt,), \
            LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(v2_options(**config))
        cm = dd.cache_manager
        blocks = cm.allocate_blocks_cache(BLOCKS_DESC)
        rows = cm.allocate_cache(CACHE_DESC)
        pushed = cm.allocate_blocks_cache(BLOCKS_DESC)
        fill(pushed, seed=31)

        comm = await dd.link("link", {PROMPT_ID: 0, DECODER_ID: 1}, table)
        assert comm not in STATUS_VALUES
        assert dd.query_register_mem_status(comm) is PREPARING
        assert dd.query_register_mem_status(comm_id=comm) is PREPARING
        await expect_code(S.LLM_NOT_YET_LINK, cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), blocks, [0], [0]))
        assert dd.listen_address == (DECODER_IP, config["link_port"] + 1)

        prompt_comm = await prompt.call("link", "link", {PROMPT_ID: 0, DECODER_ID: 1}, table)
        assert await settled(dd, comm) is OK
        assert await prompt.call("wait", prompt_comm) == "OK"

        await cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), blocks, [0, 1, 5], [7, 6, 5])
        expected = prompt.expected("blocks")
        for got, want in zip(blocks.tensors, expected, strict=True):
            assert torch.equal(got[[7, 6, 5]], want[[0, 1, 5]])
        await cm.pull_cache(CacheKey(PROMPT_ID, 101), rows, batch_index=2)
        for got, want in zip(rows.tensors, prompt.expected("rows"), strict=True):
            assert torch.equal(got[2], want[1])
        await cm.push_blocks(BlocksCacheKey(PROMPT_ID, 0), pushed, [0, 1], [3, 4])
        remote = tensors_from_dump(BLOCKS_DESC, await prompt.call("dump", "blocks"))
        for theirs, ours in zip(remote, pushed.tensors, strict=True):
            assert torch.equal(theirs[[3, 4]], ours[[0, 1]])
        assert negotiated_transport(dd, PROMPT_ID) == transport
        assert await prompt.call("transport", DECODER_ID) == transport

        await dd.unlink(comm)
        assert await prompt.call("wait", prompt_comm) == "FAILED"  # the peer's status reflects the unlink
        assert link_to(dd, PROMPT_ID) is None
        await expect_code(S.LLM_NOT_YET_LINK, cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), blocks, [0], [0]))
        await expect_code(S.LLM_NOT_YET_LINK, dd.unlink(comm))
        with pytest.raises(LLMException) as exc:
            dd.query_register_mem_status(comm)
        assert exc.value.status_code == S.LLM_NOT_YET_LINK
        assert await prompt.call("unlink", prompt_comm) is None
        with pytest.raises(LLMException) as exc:
            await prompt.call("unlink", prompt_comm)
        assert exc.value.status_code == S.LLM_NOT_YET_LINK


@pytest.mark.asyncio
async def test_unlink_from_the_peer_relink_and_unlink_together():
    """The prompt unlinks: the decoder sees FAILED and its transfers are refused; both link the same pair
    again at once (OK); a second link of a linked pair fails at once and leaves the first alone; then both
    unlink at the same moment."""
    config = {"link_port": free_port(DECODER_IP) - 1, "link_total_time": 30}
    table = rank_table(PROMPT_IP, DECODER_IP)
    info = {PROMPT_ID: 0, DECODER_ID: 1}
    async with spawned(prompt_spec(config), target=_v2_main) as (prompt,), \
            LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(v2_options(**config))
        cm = dd.cache_manager
        blocks = cm.allocate_blocks_cache(BLOCKS_DESC)
        prompt.send("link", "link", info, table)
        comm = await dd.link("link", info, table)
        prompt_comm = await prompt.answer()
        assert await settled(dd, comm) is OK
        assert await prompt.call("wait", prompt_comm) == "OK"

        await prompt.call("unlink", prompt_comm)
        assert await settled(dd, comm) is FAILED
        assert dd.query_register_mem_status(comm) is FAILED
        await expect_code(S.LLM_NOT_YET_LINK, cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), blocks, [0], [0]))
        await dd.unlink(comm)

        prompt.send("link", "link-again", info, table)
        again = await dd.link("link-again", info, table)
        prompt_again = await prompt.answer()
        assert again != comm
        assert await settled(dd, again) is OK
        assert await prompt.call("wait", prompt_again) == "OK"

        second = await dd.link("link-again", info, table)
        assert second not in STATUS_VALUES and second != again
        assert dd.query_register_mem_status(second) is FAILED
        await dd.unlink(second)
        assert dd.query_register_mem_status(again) is OK
        await cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), blocks, [2], [2])
        for got, want in zip(blocks.tensors, prompt.expected("blocks"), strict=True):
            assert torch.equal(got[2], want[2])

        prompt.send("unlink", prompt_again)
        await dd.unlink(again)
        assert await prompt.answer() is None
        assert link_to(dd, PROMPT_ID) is None
        await expect_code(S.LLM_NOT_YET_LINK, cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), blocks, [0], [0]))


@pytest.mark.asyncio
async def test_concurrent_links_to_several_peers():
    """One endpoint links to two peer processes at once: rank 1 (listening) in one comm, rank 0 (dialling)
    in the other; addresses come from aio.RankAddresses; it pulls from both at once, then unlinks both."""
    addresses = {ip: f"{ip}:{free_port(ip)}" for ip in (PROMPT_IP, DECODER_IP, THIRD_IP)}
    config = {"rank_addresses": json.dumps(addresses), "link_total_time": 30}
    first = {PROMPT_ID: 0, DECODER_ID: 1}
    second = {DECODER_ID: 0, THIRD_ID: 1}
    first_table, second_table = rank_table(PROMPT_IP, DECODER_IP), rank_table(DECODER_IP, THIRD_IP)
    async with spawned(prompt_spec(config), prompt_spec(config, THIRD_ID), target=_v2_main) as (a, b), \
            LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(v2_options(**config))
        cm = dd.cache_manager
        from_a, from_b = cm.allocate_blocks_cache(BLOCKS_DESC), cm.allocate_blocks_cache(BLOCKS_DESC)
        a.send("link", "a", first, first_table)
        b.send("link", "b", second, second_table)
        comm_a, comm_b = await asyncio.gather(dd.link("a", first, first_table), dd.link("b", second, second_table))
        peer_a, peer_b = await a.answer(), await b.answer()
        assert await settled(dd, comm_a) is OK
        assert await settled(dd, comm_b) is OK
        assert [await a.call("wait", peer_a), await b.call("wait", peer_b)] == ["OK", "OK"]
        assert dd.listen_address == (DECODER_IP, int(addresses[DECODER_IP].rsplit(":", 1)[1]))

        await asyncio.gather(cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), from_a, [0, 1], [0, 1]),
                             cm.pull_blocks(BlocksCacheKey(THIRD_ID, 0), from_b, [0, 1], [0, 1]))
        for cache, peer in ((from_a, a), (from_b, b)):
            for got, want in zip(cache.tensors, peer.expected("blocks"), strict=True):
                assert torch.equal(got[:2], want[:2])

        await asyncio.gather(dd.unlink(comm_a), dd.unlink(comm_b))
        assert [await a.call("wait", peer_a), await b.call("wait", peer_b)] == ["FAILED", "FAILED"]
        await a.call("unlink", peer_a)
        await b.call("unlink", peer_b)


@pytest.mark.asyncio
async def test_many_links_at_once_in_one_process():
    """Six endpoints link with one hub at the same moment (MindIE keeps up to 16 links in flight), with a
    shared secret: the hub dials three of them and listens for the other three; every comm reaches OK and
    carries a pull."""
    ips = [f"127.0.1.{i}" for i in range(1, 8)]  # the hub is ips[0]
    addresses = {ip: f"{ip}:{free_port(ip)}" for ip in ips}
    config = {"rank_addresses": json.dumps(addresses), "link_total_time": 30, "copy_threads": 1,
              "shared_secret": "s3cret"}  # the bilateral flag is part of the proven identity
    async with LLMDataDist(LLMRole.MIX, 100) as hub:
        await hub.init(v2_options(**config))
        peers = [LLMDataDist(LLMRole.PROMPT, 101 + i) for i in range(6)]
        try:
            calls = []
            for i, peer in enumerate(peers):
                await peer.init(v2_options(**config))
                fill(peer.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(peer.cluster_id)), 40 + i)
                hub_first = i % 2 == 0  # the hub is rank 0 (dials) with even peers, rank 1 (listens) with odd ones
                order = [(hub, ips[0]), (peer, ips[i + 1])] if hub_first else [(peer, ips[i + 1]), (hub, ips[0])]
                info = {end.cluster_id: rank for rank, (end, _) in enumerate(order)}
                table = rank_table(*(ip for _, ip in order))
                calls += [hub.link(f"hub-{i}", info, table), peer.link(f"hub-{i}", info, table)]
            comms = await asyncio.gather(*calls)
            assert len(set(comms[0::2])) == 6
            assert [await settled(hub, c) for c in comms[0::2]] == [OK] * 6
            assert [await settled(peer, c) for peer, c in zip(peers, comms[1::2], strict=True)] == [OK] * 6
            pulled = [hub.cache_manager.allocate_blocks_cache(BLOCKS_DESC) for _ in peers]
            await asyncio.gather(*(hub.cache_manager.pull_blocks(BlocksCacheKey(peer.cluster_id), cache, [3], [3])
                                   for peer, cache in zip(peers, pulled, strict=True)))
            for i, cache in enumerate(pulled):
                for got, want in zip(cache.tensors, pattern(BLOCKS_DESC, 40 + i), strict=True):
                    assert torch.equal(got[3], want[3])
            await asyncio.gather(*(hub.unlink(c) for c in comms[0::2]))
            assert [await settled(peer, c) for peer, c in zip(peers, comms[1::2], strict=True)] == [FAILED] * 6
        finally:
            for peer in peers:
                await peer.finalize()


@pytest.mark.asyncio
@pytest.mark.parametrize("rank", [0, 1])
async def test_a_peer_that_never_comes_fails_after_the_link_time(rank):
    """Rank 0 dials an address nobody listens on, rank 1 waits for a dial that never comes: PREPARING,
    then FAILED once llm.LinkTotalTime (1 s) is spent; transfers are refused throughout; unlink works."""
    ips = [PROMPT_IP, DECODER_IP]
    config = {"link_port": free_port(ips[rank]) - rank, "link_total_time": 1}
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(v2_options(**config))
        cm = dd.cache_manager
        blocks = cm.allocate_blocks_cache(BLOCKS_DESC)
        info = {DECODER_ID: 0, PROMPT_ID: 1} if rank == 0 else {PROMPT_ID: 0, DECODER_ID: 1}
        loop = asyncio.get_running_loop()
        start = loop.time()
        comm = await dd.link("alone", info, rank_table(*ips))
        assert dd.query_register_mem_status(comm) is PREPARING
        await expect_code(S.LLM_NOT_YET_LINK, cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), blocks, [0], [0]))
        assert await settled(dd, comm, limit_s=10) is FAILED
        assert loop.time() - start < 1 + 5
        await expect_code(S.LLM_NOT_YET_LINK, cm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), blocks, [0], [0]))
        await dd.unlink(comm)


@pytest.mark.asyncio
async def test_a_dial_is_taken_only_while_the_peer_links():
    """An endpoint that listens (for another comm) but never calls link() for this pair refuses the
    dial: the dialling comm ends FAILED after the link time and no link is left on either end."""
    addresses = {PROMPT_IP: f"{PROMPT_IP}:{free_port(PROMPT_IP)}", DECODER_IP: f"{DECODER_IP}:{free_port(DECODER_IP)}"}
    config = {"rank_addresses": json.dumps(addresses), "link_total_time": 1}
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(v2_options(**config))
        await d.init(v2_options(**config))
        other = await d.link("other", {9: 0, DECODER_ID: 1}, rank_table(THIRD_IP, DECODER_IP))  # d listens now
        assert d.listen_address is not None
        loop = asyncio.get_running_loop()
        start = loop.time()
        comm = await p.link("never", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP))
        assert await settled(p, comm, limit_s=10) is FAILED
        assert loop.time() - start >= 0.9  # PREPARING for the link time: a refused dial is tried again
        assert await settled(d, other, limit_s=10) is FAILED
        assert link_to(p, DECODER_ID) is None and link_to(d, PROMPT_ID) is None
        await p.unlink(comm)
        await d.unlink(other)


@pytest.mark.asyncio
async def test_switch_role_while_a_comm_waits_for_its_dial_is_exist_link():
    """A comm still PREPARING counts as a link for ``switch_role``: the rank that waits for the dial keeps
    listening (``LLM_EXIST_LINK``, role unchanged) and the comm comes up once the other rank links. Before,
    switch_role stopped the listener under the waiting comm, and the comm failed after the link time."""
    addresses = {PROMPT_IP: f"{PROMPT_IP}:{free_port(PROMPT_IP)}", DECODER_IP: f"{DECODER_IP}:{free_port(DECODER_IP)}"}
    config = {"rank_addresses": json.dumps(addresses), "link_total_time": 5}
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(v2_options(**config))
        await d.init(v2_options(**config))
        waiting = await d.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP))
        assert d.query_register_mem_status(waiting) is PREPARING and d.listen_address is not None
        for options in (None, {"llm.listenIpInfo": f"{DECODER_IP}:0"}):
            await expect_code(S.LLM_EXIST_LINK, d.switch_role(LLMRole.PROMPT, options))
        assert d.role is LLMRole.DECODER and d.listen_address is not None
        dialling = await p.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP))
        assert await settled(p, dialling, limit_s=10) is OK
        assert await settled(d, waiting, limit_s=10) is OK
        await p.unlink(dialling)
        await d.unlink(waiting)


def _bad(table: str = "", **changes: Any) -> str:
    obj = json.loads(table or rank_table(PROMPT_IP, DECODER_IP))
    for path, value in changes.items():
        target = obj
        *parents, last = path.split("__")
        for part in parents:
            target = target[int(part)] if part.isdigit() else target[part]
        if value is None:
            del target[int(last) if last.isdigit() else last]
        else:
            target[int(last) if last.isdigit() else last] = value
    return json.dumps(obj)


GOOD_INFO = {PROMPT_ID: 0, DECODER_ID: 1}
BAD_ARGUMENTS = [
    ("comm_name", ("", GOOD_INFO, None)),
    ("comm_name", ("x" * 128, GOOD_INFO, None)),
    ("comm_name", (7, GOOD_INFO, None)),
    ("cluster_rank_info", ("c", [(PROMPT_ID, 0), (DECODER_ID, 1)], None)),
    ("cluster_rank_info", ("c", {DECODER_ID: 0}, None)),
    ("cluster_rank_info", ("c", {1: 0, 2: 1, 3: 2, 4: 3, 5: 4}, None)),
    ("cluster_rank_info", ("c", {PROMPT_ID: 1, DECODER_ID: 0}, None)),
    ("cluster_rank_info", ("c", {PROMPT_ID: 0, DECODER_ID: 0}, None)),
    ("cluster_rank_info", ("c", {PROMPT_ID: 0, 7: 1}, None)),
    ("cluster_rank_info", ("c", {PROMPT_ID: 0, DECODER_ID: -1}, None)),
    ("cluster_rank_info", ("c", {-1: 0, DECODER_ID: 1}, None)),
    ("cluster_rank_info", ("c", {PROMPT_ID: 0, DECODER_ID: "1"}, None)),
    ("rank_table", ("c", GOOD_INFO, "{not json")),
    ("rank_table", ("c", GOOD_INFO, "[" * 100000)),  # was a bare RecursionError
    ("rank_table", ("c", GOOD_INFO, b"{}")),
    ("rank_table", ("c", GOOD_INFO, "[]")),
    ("rank_table", ("c", GOOD_INFO, "{}")),
    ("rank_table", ("c", GOOD_INFO, _bad(server_list=[]))),
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__0__device="x"))),
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__1=None))),  # rank 1 missing
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__1__device__0__rank_id="0"))),  # rank 0 twice
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__1__device__0__rank_id="one"))),
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__1__device__0__rank_id=None))),
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__1__device__0__device_ip="localhost"))),
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__1__device__0__device_ip=None))),  # no address for rank 1
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__1__device__0__device_ip=2130706433))),  # ipaddress takes ints
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__1__device__0__device_ip=True))),
    ("rank_table", ("c", GOOD_INFO, _bad(server_list__0__device__0__device_ip=2130706433))),  # the dialled rank's
]


@pytest.mark.asyncio
async def test_bad_arguments_are_refused_naming_them():
    config = {"link_port": free_port(DECODER_IP) - 1, "link_total_time": 1}
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(v2_options(**config))
        for argument, (name, info, table) in BAD_ARGUMENTS:
            table = rank_table(PROMPT_IP, DECODER_IP) if table is None else table
            exc = await expect_code(S.LLM_PARAM_INVALID, dd.link(name, info, table))
            assert exc.argument == argument, (argument, name, info, table, exc)
            assert argument in str(exc)
        for info, kind in (([(PROMPT_ID, 0), (DECODER_ID, 1)], TypeError), ({PROMPT_ID: 0, DECODER_ID: "1"}, TypeError),
                           ({PROMPT_ID: 0, DECODER_ID: -1}, ValueError), ({-1: 0, DECODER_ID: 1}, ValueError)):
            exc = await expect_code(S.LLM_PARAM_INVALID, dd.link("c", info, rank_table(PROMPT_IP, DECODER_IP)))
            assert isinstance(exc, kind), (info, exc)  # as LLM-DataDist's check_dict / check_uint raise
        assert dd.listen_address is None  # nothing was started for a refused call
        for comm_id in (-1, 2**64, "1", None):
            for call in (dd.query_register_mem_status, dd.unlink):
                with pytest.raises(LLMException) as raised:
                    result = call(comm_id)
                    if asyncio.iscoroutine(result):
                        await result
                assert raised.value.status_code == S.LLM_PARAM_INVALID and raised.value.argument == "comm_id"
        with pytest.raises(LLMException) as raised:
            dd.query_register_mem_status(12345)
        assert raised.value.status_code == S.LLM_NOT_YET_LINK
        await expect_code(S.LLM_NOT_YET_LINK, dd.unlink(12345))


@pytest.mark.asyncio
async def test_address_conflicts_and_modes_are_refused():
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        listen = free_port(DECODER_IP)
        await dd.init(v2_options(listen_ip_info=f"{DECODER_IP}:{listen}", link_port=listen + 5))
        exc = await expect_code(S.LLM_PARAM_INVALID, dd.link("c", GOOD_INFO, rank_table(PROMPT_IP, DECODER_IP)))
        assert exc.argument == "rank_table" and "listens on" in str(exc)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:  # its port, but on another host
        listen = free_port(DECODER_IP)
        await dd.init(v2_options(listen_ip_info=f"{DECODER_IP}:{listen}", rank_addresses={1: f"{THIRD_IP}:{listen}"}))
        exc = await expect_code(S.LLM_PARAM_INVALID, dd.link("c", GOOD_INFO, rank_table(PROMPT_IP, DECODER_IP)))
        assert exc.argument == "rank_table" and "listens on" in str(exc)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:  # two ranks mapped to one address
        await dd.init(v2_options(rank_addresses={0: f"{PROMPT_IP}:5000", 1: f"{PROMPT_IP}:5000"}))
        exc = await expect_code(S.LLM_PARAM_INVALID, dd.link("c", GOOD_INFO, rank_table(PROMPT_IP, DECODER_IP)))
        assert exc.argument == "rank_table" and "both map to" in str(exc)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:  # an address this host does not have
        await dd.init(v2_options())
        exc = await expect_code(S.LLM_LINK_FAILED, dd.link("c", GOOD_INFO, rank_table(PROMPT_IP, "192.0.2.1")))
        assert "192.0.2.1:26001" in str(exc)
        assert dd.listen_address is None
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:  # KvCacheManager mode: link is v2 only
        cfg = LLMConfig()
        cfg.device_id = 0
        await dd.init(cfg.generate_options())
        exc = await expect_code(S.LLM_PARAM_INVALID, dd.link("c", GOOD_INFO, rank_table(PROMPT_IP, DECODER_IP)))
        assert "llm.EnableCacheManager" in str(exc)
    for key, value in (("aio.LinkPort", "0"), ("aio.LinkPort", "70000"), ("aio.RankAddresses", "[]"),
                       ("aio.RankAddresses", '{"1": "nohost"}'), ("aio.RankAddresses", '{"x": "127.0.0.1:5"}'),
                       ("aio.RankAddresses", '{"1": "127.0.0.1:0"}')):
        async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
            exc = await expect_code(S.LLM_PARAM_INVALID, dd.init({**v2_options(), key: value}))
            assert key in str(exc)


@pytest.mark.asyncio
async def test_a_refused_link_leaves_no_listener_and_no_comm():
    """Guarantee 56: a conflict in the rank table starts no listener, and a link() that could not listen leaves
    no comm behind: the pair's next link() is PREPARING, not refused as a pair in a comm already."""
    port = free_port(PROMPT_IP)
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:  # two ranks mapped to one address
        await dd.init(v2_options(rank_addresses={0: f"{PROMPT_IP}:{port}", 1: f"{PROMPT_IP}:{port}"}))
        exc = await expect_code(S.LLM_PARAM_INVALID, dd.link("c", GOOD_INFO, rank_table(PROMPT_IP, DECODER_IP)))
        assert exc.argument == "rank_table" and dd.listen_address is None
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(v2_options(link_port=free_port(DECODER_IP) - 1, link_total_time=30))
        await expect_code(S.LLM_LINK_FAILED, dd.link("c", GOOD_INFO, rank_table(PROMPT_IP, "192.0.2.1")))
        comm = await dd.link("c", GOOD_INFO, rank_table(PROMPT_IP, DECODER_IP))
        assert dd.query_register_mem_status(comm) is PREPARING


def test_the_address_rule():
    assert rank_address(RankEntry(0, "10.0.0.1"), 26000, {}) == ("10.0.0.1", 26000)
    assert rank_address(RankEntry(3, "10.0.0.1"), 26000, {}) == ("10.0.0.1", 26003)
    overrides = {"3": ("127.0.0.5", 7000), "10.0.0.1": ("127.0.0.6", 7001)}
    assert rank_address(RankEntry(3, "10.0.0.1"), 26000, overrides) == ("127.0.0.5", 7000)  # rank id first
    assert rank_address(RankEntry(2, "10.0.0.1"), 26000, overrides) == ("127.0.0.6", 7001)
    assert rank_address(RankEntry(3, None), 26000, overrides) == ("127.0.0.5", 7000)
    with pytest.raises(LLMException) as exc:
        rank_address(RankEntry(2, None), 26000, overrides)
    assert exc.value.argument == "rank_table"
    with pytest.raises(LLMException) as exc:
        rank_address(RankEntry(2, "10.0.0.2"), 65535, {})
    assert exc.value.argument == "rank_table"
    cfg = LLMConfig()
    cfg.rank_addresses = {1: "127.0.0.1:5", "10.0.0.1": "127.0.0.2:6"}
    cfg.link_port = 30000
    options = cfg.generate_options()
    assert json.loads(options["aio.RankAddresses"]) == {"1": "127.0.0.1:5", "10.0.0.1": "127.0.0.2:6"}
    assert options["aio.LinkPort"] == "30000"


@pytest.fixture
def compat_loop():
    yield
    compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


@pytest.mark.asyncio
async def test_compat_blocks_and_takes_comm_id_by_keyword(compat_loop):
    """The blocking facade (called from a worker thread here): link returns the comm id at once,
    query_register_mem_status(comm_id=...) is polled to OK, a pull moves the bytes, unlink tears down."""
    config = {"link_port": free_port(DECODER_IP) - 1, "link_total_time": 30}
    table = rank_table(PROMPT_IP, DECODER_IP)
    async with spawned(prompt_spec(config), target=_v2_main) as (prompt,):
        prompt.send("link", "link", GOOD_INFO, table)

        def decoder() -> list[torch.Tensor]:
            dd = compat.LLMDataDist(LLMRole.DECODER, DECODER_ID)
            dd.init(v2_options(**config))
            try:
                cache = dd.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
                comm = dd.link("link", GOOD_INFO, table)
                while (status := dd.query_register_mem_status(comm_id=comm)) != RegisterMemStatus.OK:
                    assert status == RegisterMemStatus.PREPARING
                dd.cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), cache, [0, 1], [0, 1])
                got = [t.clone() for t in cache.tensors]
                dd.unlink(comm)
                with pytest.raises(LLMException) as exc:
                    dd.unlink(comm)
                assert exc.value.status_code == S.LLM_NOT_YET_LINK
                return got
            finally:
                dd.finalize()

        got = await asyncio.to_thread(decoder)
        await prompt.answer()
        for tensor, want in zip(got, prompt.expected("blocks"), strict=True):
            assert torch.equal(tensor[:2], want[:2])


@pytest.mark.asyncio
async def test_finalize_ends_comms_in_any_state():
    """finalize with one comm OK and one still PREPARING (dialling, or waiting for a dial): the attempts
    stop, the peer's comm turns FAILED, and nothing is left behind (the leak check runs after)."""
    addresses = {ip: f"{ip}:{free_port(ip)}" for ip in (PROMPT_IP, DECODER_IP, THIRD_IP)}
    config = {"rank_addresses": json.dumps(addresses), "link_total_time": 60}
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p:
        await p.init(v2_options(**config))
        d = LLMDataDist(LLMRole.DECODER, DECODER_ID)
        await d.init(v2_options(**config))
        info = {PROMPT_ID: 0, DECODER_ID: 1}
        comm_p, comm_d = await asyncio.gather(p.link("x", info, rank_table(PROMPT_IP, DECODER_IP)),
                                              d.link("x", info, rank_table(PROMPT_IP, DECODER_IP)))
        assert await settled(p, comm_p) is OK and await settled(d, comm_d) is OK
        dialling = await d.link("y", {DECODER_ID: 0, THIRD_ID: 1}, rank_table(DECODER_IP, THIRD_IP))
        waiting = await d.link("z", {7: 0, DECODER_ID: 1}, rank_table(THIRD_IP, DECODER_IP))
        assert d.query_register_mem_status(dialling) is PREPARING
        assert d.query_register_mem_status(waiting) is PREPARING
        assert len(_link_attempts()) == 2
        await d.finalize()
        # Stopped by finalize, not left to run out the link time (the leak check sees fds, not tasks: the test
        # passed with the attempts left running until an audit, 2026-12-07)
        assert not _link_attempts(), _link_attempts()
        assert await settled(p, comm_p) is FAILED
        await p.unlink(comm_p)


def _link_attempts() -> list[asyncio.Task]:
    """The endpoint's bilateral ``link()`` attempts still running in this loop (the dialling and the waiting end)."""
    return [task for task in asyncio.all_tasks() if not task.done()
            and task.get_coro().__name__ in ("_dial_bilateral", "_await_bilateral")]


@pytest.mark.asyncio
async def test_a_bilateral_link_that_goes_down_while_it_is_set_up_fails_at_once(monkeypatch):
    """The dialling end of link() sees the peer finalize after LINK_OK (during the transport check): its comm
    is FAILED at once, not after dialling the gone peer again for the whole link time."""
    addresses = {PROMPT_IP: f"{PROMPT_IP}:{free_port(PROMPT_IP)}", DECODER_IP: f"{DECODER_IP}:{free_port(DECODER_IP)}"}
    config = {"rank_addresses": json.dumps(addresses), "link_total_time": 8}
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(v2_options(**config))
        await d.init(v2_options(**config))
        leave_during_set_up(monkeypatch, p, d)
        info = {PROMPT_ID: 0, DECODER_ID: 1}
        table = rank_table(PROMPT_IP, DECODER_IP)
        await d.link("c", info, table)
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        comm = await p.link("c", info, table)
        status = await settled(p, comm, limit_s=15)
        took = loop.time() - t0
        assert status is RegisterMemStatus.FAILED
        assert took < 4, f"the comm stayed PREPARING {took:.1f} s (dialled a peer that is gone again)"
        await p.unlink(comm)


@pytest.mark.asyncio
async def test_an_attempt_that_raises_reads_failed_and_unlinks(monkeypatch, caplog):
    """An attempt that raised something other than LLMException (a device_ip given as a JSON number got
    that far) made query_register_mem_status and unlink raise it raw; the comm reads FAILED, the error is
    logged, and unlink forgets the comm."""
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p:
        await p.init(v2_options(link_port=free_port(DECODER_IP) - 1, link_total_time=1))

        async def broken(*args: Any) -> None:
            raise TypeError("str, bytes or bytearray expected, not int")

        monkeypatch.setattr(p._require_links(), "_dial_bilateral", broken)
        comm = await p.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP))
        assert await settled(p, comm, limit_s=5) is FAILED
        assert "TypeError" in caplog.text
        await p.unlink(comm)
        with pytest.raises(LLMException) as raised:
            p.query_register_mem_status(comm)
        assert raised.value.status_code == S.LLM_NOT_YET_LINK


@pytest.mark.asyncio
@pytest.mark.parametrize("end, step", [("waiting", "_share_with"), ("dialling", "_share_with"),
                                       ("dialling", "_require_transport")])  # (its last step: NIXL done too)
async def test_no_transfer_of_ours_while_the_comm_is_preparing(monkeypatch, end, step):
    """Both ends' links are in their tables while the dialler still sets its link up (its share, NIXL): our own
    transfers on it fail LLM_NOT_YET_LINK until the comm reads OK ("wait until query_register_mem_status returns
    OK", as the reference says), on both ends, then move the right bytes. Before, a pull went through while the
    comm read PREPARING, over TCP where the share was still being attached (found by the bilateral audit,
    2026-12-06). Nor does either end's ``stats()`` list the link as up until then (row 338)."""
    addresses = {PROMPT_IP: f"{PROMPT_IP}:{free_port(PROMPT_IP)}", DECODER_IP: f"{DECODER_IP}:{free_port(DECODER_IP)}"}
    config = {"rank_addresses": json.dumps(addresses), "link_total_time": 10}
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(v2_options(**config))
        await d.init(v2_options(**config))
        values = {PROMPT_ID: fill(p.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID, 0)), 3),
                  DECODER_ID: fill(d.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(DECODER_ID, 0)),
                                   4)}
        puller, owner = (d, PROMPT_ID) if end == "waiting" else (p, DECODER_ID)  # the prompt's end dials
        dst = puller.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        original = getattr(LinkTable, step)
        dialler = p._require_links()
        held = asyncio.Event()

        async def slow_set_up(self: Any, link: Any, *args: Any) -> None:
            if self is dialler:
                await held.wait()
            await original(self, link, *args)

        monkeypatch.setattr(LinkTable, step, slow_set_up)
        info, table = {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP)
        comm_d = await d.link("c", info, table)
        comm_p = await p.link("c", info, table)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while (link_to(d, PROMPT_ID) is None or link_to(p, DECODER_ID) is None) and loop.time() < deadline:
            await asyncio.sleep(0.01)
        comm = comm_d if puller is d else comm_p
        assert puller.query_register_mem_status(comm) is PREPARING
        await expect_code(S.LLM_NOT_YET_LINK, puller.cache_manager.pull_blocks(BlocksCacheKey(owner, 0), dst, [0],
                                                                                 [0]))
        # Not up either in either end's stats (found by the audit; the waiting end listed it before).
        assert not d.stats().links and not p.stats().links
        assert d.stats().links_up == p.stats().links_up == 0
        held.set()
        assert await settled(p, comm_p, 8) is OK and await settled(d, comm_d, 8) is OK
        assert list(d.stats().links) == [PROMPT_ID] and list(p.stats().links) == [DECODER_ID]
        assert d.stats().links_up == p.stats().links_up == 1
        await puller.cache_manager.pull_blocks(BlocksCacheKey(owner, 0), dst, [2], [1])
        assert all(torch.equal(t[1], v[2]) for t, v in zip(dst.tensors, values[owner], strict=True))
        await p.unlink(comm_p)
        await d.unlink(comm_d)


def _pair_options(**configs: dict[str, Any]) -> list[dict[str, Any]]:
    """The prompt's and the decoder's v2 options (``prompt=``, ``decoder=``), one deployment's rank addresses."""
    addresses = json.dumps({ip: f"{ip}:{free_port(ip)}" for ip in (PROMPT_IP, DECODER_IP)})
    return [v2_options(rank_addresses=addresses, **configs[end]) for end in ("prompt", "decoder")]


@pytest.mark.asyncio
async def test_the_waiting_end_drops_a_link_short_of_its_required_transport():
    """The end that takes the dial requires local, the dialler uses TCP only: both comms read FAILED and no
    link is left. Before, that end never checked aio.RequireTransport: its comm read OK on a TCP link, and
    every transfer on it was refused LLM_FEATURE_NOT_ENABLED (found by audit)."""
    prompt, decoder = _pair_options(prompt={"transport": "tcp", "link_total_time": 5},
                                    decoder={"transport": "auto", "require_transport": "local",
                                             "link_total_time": 5})
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(prompt)
        await d.init(decoder)
        info, table = {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP)
        comm_d = await d.link("c", info, table)
        comm_p = await p.link("c", info, table)
        assert await settled(d, comm_d, limit_s=5) is FAILED
        assert link_to(d, PROMPT_ID) is None
        # Never announced: neither counted up and down, nor listed (row 338).
        assert (d.stats().links_up, d.stats().links_down, dict(d.stats().links)) == (0, 0, {})
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while p.query_register_mem_status(comm_p) is not FAILED and loop.time() < deadline:
            await asyncio.sleep(0.02)  # OK until our unlink reaches it
        assert p.query_register_mem_status(comm_p) is FAILED
        await p.unlink(comm_p)
        await d.unlink(comm_d)


@pytest.mark.asyncio
async def test_the_waiting_end_reads_ok_once_its_transport_settled():
    """Both ends on one host share memory, the end that takes the dial requires local: when its comm reads
    OK the link is local and a pull works at once. Before, OK came in take(), ahead of the share: a pull at OK
    was refused LLM_FEATURE_NOT_ENABLED ("would take tcp"), the same pull 0.5 s later worked (found by audit)."""
    prompt, decoder = _pair_options(prompt={"transport": "auto", "link_total_time": 5},
                                    decoder={"transport": "auto", "require_transport": "local",
                                             "link_total_time": 5})
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(prompt)
        await d.init(decoder)
        fill(p.cache_manager.allocate_blocks_cache(BLOCKS_DESC, BlocksCacheKey(PROMPT_ID, 0)), 7)
        dst = d.cache_manager.allocate_blocks_cache(BLOCKS_DESC)
        info, table = {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP)
        comm_d = await d.link("c", info, table)
        comm_p = await p.link("c", info, table)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 5
        while d.query_register_mem_status(comm_d) is PREPARING and loop.time() < deadline:
            await asyncio.sleep(0)  # every loop pass: the first one that reads OK
        assert d.query_register_mem_status(comm_d) is OK
        link = link_to(d, PROMPT_ID)
        assert link is not None and link.transport == "local"
        await d.cache_manager.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), dst, [0], [0])
        assert await settled(p, comm_p, limit_s=5) is OK
        await p.unlink(comm_p)
        await d.unlink(comm_d)


@pytest.mark.asyncio
@pytest.mark.parametrize("waiter_dials", [False, True])
async def test_a_waiting_comm_fails_once_its_pair_is_linked_otherwise(waiter_dials):
    """While the decoder's comm waits for the prompt's dial, the prompt links it with link_clusters (or the
    decoder itself links the prompt: ``waiter_dials``): that comm can take no dial now, and reads FAILED at
    once; the link_clusters link stays. Before, it stayed PREPARING for the whole llm.LinkTotalTime (found by
    audit)."""
    prompt, decoder = _pair_options(prompt={"link_total_time": 30, "listen_ip_info": f"{PROMPT_IP}:0"},
                                    decoder={"link_total_time": 30})
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as p, LLMDataDist(LLMRole.DECODER, DECODER_ID) as d:
        await p.init(prompt)
        await d.init(decoder)
        comm = await d.link("c", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP))
        linker, target = (d, p) if waiter_dials else (p, d)
        host, port = target.listen_address
        cluster = LLMClusterInfo()
        cluster.remote_cluster_id = target.cluster_id
        cluster.append_local_ip_info(PROMPT_IP, 0)
        cluster.append_remote_ip_info(host, port)
        assert (await linker.link_clusters([cluster], 3000))[0] == S.LLM_SUCCESS
        assert await settled(d, comm, limit_s=1.5) is FAILED
        assert link_to(d, PROMPT_ID) is not None and link_to(d, PROMPT_ID).up
        await d.unlink(comm)
        assert (await linker.unlink_clusters([cluster], 1000))[0] == S.LLM_SUCCESS


@pytest.mark.asyncio
async def test_link_total_time_0_takes_hccl_connect_timeout(monkeypatch):
    """llm.LinkTotalTime 0 is HCCL_CONNECT_TIMEOUT (s) when that is a positive integer, else 120 s, as the
    reference says. Before, 0 was always 120 s (found by audit)."""
    monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1")
    async with LLMDataDist(LLMRole.DECODER, DECODER_ID) as dd:
        await dd.init(v2_options(link_port=free_port(DECODER_IP) - 1, link_total_time=0))
        comm = await dd.link("alone", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP))
        status = await settled(dd, comm, limit_s=1.8)  # nobody dials: the 1 s ran out
        await dd.unlink(comm)
        assert status is FAILED
    for text in ("", "0", "-3", "1.5", "abc", "\u0663"):
        monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", text)
        assert bilateral._hccl_connect_timeout_s() == 120


def test_a_rank_id_longer_than_python_converts_is_param_invalid():
    """A 5000-digit ``rank_id`` string raised a bare ValueError from int(), not LLM_PARAM_INVALID naming
    ``rank_table``."""
    from aio_datadist.ranktable import parse_rank_table

    table = json.dumps({"server_list": [{"device": [{"device_ip": PROMPT_IP, "rank_id": "9" * 5000}]}]})
    with pytest.raises(LLMException) as exc:
        parse_rank_table(table, [0, 1])
    assert exc.value.status_code == S.LLM_PARAM_INVALID and exc.value.argument == "rank_table"


@pytest.mark.asyncio
async def test_comm_ids_skip_status_values():
    """A comm id never equals an ``LLMStatusCode`` value: with the id counter set at status values
    (``CommTable._next_id``, internal), the ids handed out skip them. Ids count from 1 and the values are -1,
    0 and 507053 up, so no test's ``link()`` reached one (audit, 2026-12-07)."""
    values = {int(code) for code in LLMStatusCode}
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        await dd.init(v2_options())
        comms = dd._require_comms("link")
        seen = []
        for start in (507053, 1343270913):
            comms._next_id = start
            seen.append(comms._new_id())
        assert not set(seen) & values and len(set(seen)) == len(seen), seen


@pytest.mark.asyncio
@pytest.mark.parametrize("digits", [400, 5000])
async def test_a_hccl_connect_timeout_too_large_for_a_float_leaves_no_phantom_comm(monkeypatch, digits):
    """HCCL_CONNECT_TIMEOUT of 400 digits (over a float's range) or 5000 (over int()'s) with llm.LinkTotalTime 0:
    link() raised a bare OverflowError / ValueError after it had put its comm in the table, with no attempt, so
    the comm (whose id nobody got) read OK and every later link() of the pair was FAILED at once as already
    linked."""
    async with LLMDataDist(LLMRole.PROMPT, PROMPT_ID) as dd:
        await dd.init(v2_options(link_port=free_port(DECODER_IP) - 1, link_total_time=0))
        monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "9" * digits)
        raised, comm = None, None
        try:
            comm = await dd.link("huge", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP))
        except Exception as exc:  # noqa: BLE001 - checked below
            raised = exc
        if comm is not None:
            await dd.unlink(comm)
        monkeypatch.setenv("HCCL_CONNECT_TIMEOUT", "1")
        again = await dd.link("again", {PROMPT_ID: 0, DECODER_ID: 1}, rank_table(PROMPT_IP, DECODER_IP))
        status = dd.query_register_mem_status(again)
        await dd.unlink(again)
        assert (raised is None or isinstance(raised, LLMException), status) == (True, PREPARING), (repr(raised), status)
