"""What an operator sees: ``LLMDataDist.stats()``, the Prometheus exporter, and the link logs.

Each test moves real bytes between two endpoints (in this process, or a
prompt in a process of its own that can be stopped mid-transfer), then
checks the numbers both ends report and what a scrape of the registry says.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import os
import re
import signal
import sys
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from peers import stop_process
from prometheus_client import CollectorRegistry, generate_latest

import aio_datadist as aio
from aio_datadist import LLMClusterInfo, LLMDataDist, LLMException, LLMRole, LLMStatusCode
from aio_datadist.metrics import instrument
from aio_datadist.testing import (
    DECODER_CLUSTER_ID,
    PROMPT_CLUSTER_ID,
    blocks_desc,
    loopback_options,
    open_pair,
    open_process_pair,
)



def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    """A sample's value in the registry, 0 when the series does not exist (yet)."""
    value = registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


async def eventually(check, what: str, limit_s: float = 2.0) -> None:
    """Wait (bounded) until ``check()`` holds: an owner counts a pull once the requester's DONE arrived."""
    for _ in range(int(limit_s / 0.02)):
        if check():
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"not within {limit_s} s: {what}")


def cluster(remote_id: int, address: tuple[str, int]) -> LLMClusterInfo:
    info = LLMClusterInfo()
    info.remote_cluster_id = remote_id
    info.append_local_ip_info("127.0.0.1", 0)
    info.append_remote_ip_info(*address)
    return info


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "auto"])
async def test_stats_count_pulls_pushes_and_refusals_on_both_ends(transport):
    moved_by = "tcp" if transport == "tcp" else "local"
    config = {"transport": transport, "heartbeat_interval": 50}
    registry = CollectorRegistry()
    async with open_pair(prompt_config=config, decoder_config=config) as pair:
        instrument(pair.decoder, registry)
        instrument(pair.prompt, registry)
        kv = pair.decoder.kv_cache_manager
        block = pair.decoder_blocks.layout.row_bytes * pair.decoder_blocks.cache_desc.num_tensors
        for _ in range(3):
            await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0, 1], [2, 3])
        await pair.prompt.kv_cache_manager.push_blocks(pair.decoder_blocks_key, pair.prompt_blocks, [1], [0])
        with pytest.raises(LLMException) as refused:
            await kv.pull_cache(aio.CacheKey(PROMPT_CLUSTER_ID, 987654), pair.decoder_rows)
        assert refused.value.status_code == LLMStatusCode.LLM_KV_CACHE_NOT_EXIST
        await asyncio.sleep(0.3)  # a few heartbeats: their round trips are measured

        mine, theirs = pair.decoder.stats(), pair.prompt.stats()
        link = mine.links[PROMPT_CLUSTER_ID]
        assert (mine.cluster_id, mine.role, link.remote_role) == (DECODER_CLUSTER_ID, LLMRole.DECODER, LLMRole.PROMPT)
        assert link.transport == moved_by
        assert link.kinds["pull"].transfers == 4 - 1 and link.kinds["pull"].bytes == 3 * 2 * block
        assert dict(link.kinds["pull"].failures) == {"LLM_KV_CACHE_NOT_EXIST": 1}
        assert link.kinds["served_push"].transfers == 1 and link.kinds["served_push"].bytes == block
        assert link.transports == {"pull": moved_by, "served_push": moved_by}
        assert (link.bytes_in, link.bytes_out) == (7 * block, 0)
        assert all(s.in_flight == 0 and s.timeouts == 0 and s.cancellations == 0 for s in link.kinds.values())
        assert link.heartbeat_rtt_ms is not None and 0 < link.heartbeat_rtt_ms < 1000
        assert mine.caches == 2 and mine.registered_bytes > 0 and mine.links_up == 1 and mine.links_down == 0

        back = theirs.links[DECODER_CLUSTER_ID]
        assert back.kinds["served_pull"].transfers == 3 and back.kinds["served_pull"].bytes == 6 * block
        assert dict(back.kinds["served_pull"].failures) == {"LLM_KV_CACHE_NOT_EXIST": 1}
        assert back.kinds["push"].transfers == 1 and (back.bytes_in, back.bytes_out) == (0, 7 * block)
        assert theirs.keys >= 2  # the blocks key and the rows keys

        # The exporter counted the same transfers.
        assert sample(registry, "aio_datadist_transfers_total", cluster_id="2", kind="pull", transport=moved_by,
                      outcome="ok") == 3
        assert sample(registry, "aio_datadist_transfer_bytes_total", cluster_id="2", kind="pull",
                      transport=moved_by) == 6 * block
        assert sample(registry, "aio_datadist_transfer_errors_total", cluster_id="2", kind="pull",
                      status="LLM_KV_CACHE_NOT_EXIST") == 1
        assert sample(registry, "aio_datadist_transfer_errors_total", cluster_id="1", kind="served_pull",
                      status="LLM_KV_CACHE_NOT_EXIST") == 1
        assert sample(registry, "aio_datadist_transfer_duration_seconds_count", cluster_id="1", kind="push",
                      transport=moved_by, size_class="64KiB") == 1
        assert sample(registry, "aio_datadist_links", cluster_id="2", transport=moved_by) == 1
        assert sample(registry, "aio_datadist_registered_bytes", cluster_id="1") == theirs.registered_bytes
        assert sample(registry, "aio_datadist_heartbeat_rtt_seconds", cluster_id="2", remote_cluster_id="1") > 0


@pytest.mark.asyncio
@pytest.mark.loops_take_turns  # the counters, not the loop's I/O: one loop is enough
async def test_timeouts_and_cancellations_are_counted_and_nothing_lands_later():
    """A prompt stopped (SIGSTOP) mid-pull: the pull times out, a second one is cancelled; both are counted
    as such, neither is in flight afterwards, and once the prompt runs again no byte of either lands."""
    registry = CollectorRegistry()
    async with open_process_pair(prompt_config={"transport": "tcp"}, decoder_config={"transport": "tcp"}) as pair:
        instrument(pair.decoder, registry)
        kv = pair.decoder.kv_cache_manager
        stop_process(pair.prompt_pid)
        try:
            with pytest.raises(LLMException) as timed_out:
                await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0, 1], [0, 1], timeout=300)
            assert timed_out.value.status_code == LLMStatusCode.LLM_TIMEOUT
            pulling = asyncio.ensure_future(kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [2], [2],
                                                           timeout=5000))
            await asyncio.sleep(0.2)
            assert pair.decoder.stats().links[PROMPT_CLUSTER_ID].kinds["pull"].in_flight == 1
            pulling.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pulling
        finally:
            os.kill(pair.prompt_pid, signal.SIGCONT)
        await asyncio.sleep(0.5)  # the stopped prompt wakes: whatever it still sends must not land
        assert all(int(t[:3].abs().sum()) == 0 for t in pair.decoder_blocks.tensors)
        pull = pair.decoder.stats().links[PROMPT_CLUSTER_ID].kinds["pull"]
        assert (pull.transfers, pull.timeouts, pull.cancellations, pull.in_flight) == (0, 1, 1, 0)
        assert dict(pull.failures) == {"LLM_TIMEOUT": 1}
        await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        assert pair.decoder.stats().links[PROMPT_CLUSTER_ID].kinds["pull"].transfers == 1
        for outcome, count in (("timeout", 1), ("cancelled", 1), ("ok", 1)):
            assert sample(registry, "aio_datadist_transfers_total", cluster_id="2", kind="pull", transport="tcp",
                          outcome=outcome) == count
        errors = {(s.labels["kind"], s.labels["status"]): s.value for m in registry.collect() for s in m.samples
                  if s.name == "aio_datadist_transfer_errors_total" and s.labels["cluster_id"] == "2"}
        assert errors == {("pull", "LLM_TIMEOUT"): 1}  # a cancellation is no error


@pytest.mark.asyncio
@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_links_up_and_down_are_counted_logged_once_and_transfers_log_nothing_at_info(caplog, transport):
    registry = CollectorRegistry()
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 11), LLMDataDist(LLMRole.DECODER, 12)
    instrument(prompt, registry)
    instrument(decoder, registry)
    caplog.set_level(logging.INFO, logger="aio_datadist")
    async with prompt, decoder:
        await prompt.init(loopback_options(listen=True, transport=transport))
        await decoder.init(loopback_options(transport=transport))
        cache = prompt.kv_cache_manager.allocate_blocks_cache(blocks_desc(), aio.BlocksCacheKey(11, 0))
        dst = decoder.kv_cache_manager.allocate_blocks_cache(blocks_desc())
        assert prompt.listen_address is not None
        for attempt in range(2):  # link, unlink, link again
            status, _ = await decoder.link_clusters([cluster(11, prompt.listen_address)], timeout=3000)
            assert status == LLMStatusCode.LLM_SUCCESS
            if attempt == 0:
                await decoder.unlink_clusters([cluster(11, prompt.listen_address)])
        up = [r for r in caplog.records if r.levelno == logging.INFO and " up, " in r.getMessage()]
        assert len(up) == 4  # two links, each logged once by each end
        dialled = [r for r in up if r.cluster_id == 12]
        assert [r.remote_cluster_id for r in dialled] == [11, 11]
        assert f"transport {transport}" in dialled[0].getMessage() and dialled[0].link_id != dialled[1].link_id
        assert decoder.stats().links[11].link_id == dialled[1].link_id
        before = len([r for r in caplog.records if r.levelno >= logging.INFO])
        for _ in range(20):
            await decoder.kv_cache_manager.pull_blocks(aio.BlocksCacheKey(11, 0), dst, [0], [1])
        assert len([r for r in caplog.records if r.levelno >= logging.INFO]) == before
        for dd, cid in ((decoder, "12"), (prompt, "11")):
            stats = dd.stats()
            assert (stats.links_up, stats.links_down) == (2, 1)
            assert sample(registry, "aio_datadist_link_events_total", cluster_id=cid, event="up") == 2
            assert sample(registry, "aio_datadist_link_events_total", cluster_id=cid, event="down") == 1
        del cache, dst
    downs = [r.getMessage() for r in caplog.records if " down: " in r.getMessage()]
    assert len(downs) == 4 and all(m.endswith(" down: unlinked") for m in downs), downs
    # an unlink is no fall-back: the same-host share goes with its link, unannounced
    assert not [r.getMessage() for r in caplog.records if "sharing stopped" in r.getMessage()]


@pytest.mark.asyncio
async def test_stats_before_init_and_after_finalize_say_so():
    dd = LLMDataDist(LLMRole.DECODER, 5)
    with pytest.raises(LLMException) as early:
        dd.stats()
    assert early.value.status_code == LLMStatusCode.LLM_FAILED
    await dd.init(loopback_options())
    assert dd.stats().links == {}
    await dd.finalize()
    with pytest.raises(LLMException) as late:
        dd.stats()
    assert late.value.status_code == LLMStatusCode.LLM_ENGINE_FINALIZED


@pytest.mark.asyncio
async def test_a_scrape_from_another_thread_reads_the_endpoint_on_its_own_loop():
    registry = CollectorRegistry()
    async with open_pair() as pair:
        instrument(pair.decoder, registry)
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        text = (await asyncio.to_thread(generate_latest, registry)).decode()
        assert 'aio_datadist_links{cluster_id="2",transport="local"} 1.0' in text
        assert 'aio_datadist_caches{cluster_id="2"} 2.0' in text
    text = (await asyncio.to_thread(generate_latest, registry)).decode()
    assert "aio_datadist_caches{" not in text  # finalized: no gauges, counters stay


@pytest.mark.asyncio
async def test_a_scrape_from_another_thread_takes_the_snapshot_on_the_endpoints_loop_thread(monkeypatch):
    """The scraper's thread does not read the endpoint itself: it asks the endpoint's loop, which alone changes
    links and caches, for the snapshot."""
    import threading

    from aio_datadist import datadist

    taken_on: list[int] = []
    real = datadist.endpoint_stats

    def recording(endpoint):
        taken_on.append(threading.get_ident())
        return real(endpoint)

    monkeypatch.setattr(datadist, "endpoint_stats", recording)
    registry = CollectorRegistry()
    async with open_pair() as pair:
        instrument(pair.decoder, registry)
        text = (await asyncio.to_thread(generate_latest, registry)).decode()
        assert 'aio_datadist_links{cluster_id="2",transport="local"} 1.0' in text
        assert taken_on and set(taken_on) == {threading.get_ident()}, "a snapshot was taken off the loop's thread"


def test_instrument_refuses_what_is_not_an_endpoint_and_says_which_extra_is_missing(monkeypatch):
    with pytest.raises(LLMException) as bad:
        instrument(object(), CollectorRegistry())  # type: ignore[arg-type]
    assert bad.value.status_code == LLMStatusCode.LLM_PARAM_INVALID and "'dd'" in str(bad.value)
    monkeypatch.setitem(sys.modules, "prometheus_client", None)
    with pytest.raises(LLMException) as missing:
        instrument(LLMDataDist(LLMRole.PROMPT, 1), CollectorRegistry())
    assert missing.value.status_code == LLMStatusCode.LLM_FEATURE_NOT_ENABLED
    assert "aio_datadist[metrics]" in str(missing.value)


@pytest.mark.asyncio
async def test_two_endpoints_share_one_registry_by_cluster_id():
    registry = CollectorRegistry()
    async with open_pair() as pair:
        first = instrument(pair.decoder, registry)
        assert instrument(pair.prompt, registry) is first
        instrument(pair.prompt, registry)  # again: nothing doubles
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        await eventually(lambda: sample(registry, "aio_datadist_transfers_total", cluster_id="1", kind="served_pull",
                                        transport="local", outcome="ok") == 1, "the prompt counted its served pull")
        first.unwatch(pair.prompt)
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        await asyncio.sleep(0.1)  # the DONE that would have counted it, had it still been watched
        assert sample(registry, "aio_datadist_transfers_total", cluster_id="1", kind="served_pull",
                      transport="local", outcome="ok") == 1
        assert sample(registry, "aio_datadist_transfers_total", cluster_id="2", kind="pull",
                      transport="local", outcome="ok") == 2


def duplicated_series(registry: CollectorRegistry) -> list[str]:
    """The samples a scrape of ``registry`` yields more than once (a Prometheus server rejects such a scrape)."""
    from prometheus_client.parser import text_string_to_metric_families

    seen: dict[tuple, int] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for s in family.samples:
            key = (s.name, tuple(sorted(s.labels.items())))
            seen[key] = seen.get(key, 0) + 1
    return [f"{n} x {key}" for key, n in seen.items() if n > 1]


@pytest.mark.asyncio
async def test_an_endpoint_watched_again_or_made_anew_adds_to_one_series_per_cluster():
    """Unwatched then instrumented again, or finalized and replaced by a new endpoint with the same cluster_id
    (an in-process restart): each series once, its counters going on from what was counted before."""
    registry = CollectorRegistry()
    pulls = {"cluster_id": "2", "kind": "pull", "transport": "local", "outcome": "ok"}
    async with open_pair() as pair:
        metrics = instrument(pair.decoder, registry)
        observers = list(pair.decoder._endpoint.observers)
        kv = pair.decoder.kv_cache_manager
        await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        for _ in range(3):
            metrics.unwatch(pair.decoder)
            instrument(pair.decoder, registry)
            instrument(pair.decoder, registry)  # watched already: a no-op, no second observer left on it
        assert len(pair.decoder._endpoint.observers) == len(observers)
        await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        assert duplicated_series(registry) == []
        assert sample(registry, "aio_datadist_transfers_total", **pulls) == 2
        assert sample(registry, "aio_datadist_caches", cluster_id="2") == 2
    async with open_pair() as pair:  # the same cluster ids, new endpoints, the same registry
        instrument(pair.decoder, registry)
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        assert duplicated_series(registry) == []
        assert sample(registry, "aio_datadist_transfers_total", **pulls) == 3
        assert sample(registry, "aio_datadist_link_events_total", cluster_id="2", event="down") == 1  # the first
        assert sample(registry, "aio_datadist_caches", cluster_id="2") == 2  # the live endpoint's gauges
        assert len(metrics._watched) == 2  # the finalized first, which kv holds, stays watched past a scrape
    del pair, kv  # (the manager holds its endpoint, which stays watched while it lives)
    gc.collect()
    assert sample(registry, "aio_datadist_transfers_total", **pulls) == 3
    assert sample(registry, "aio_datadist_link_events_total", cluster_id="2", event="down") == 2
    assert (len(metrics._watched), list(metrics._retired)) == (0, ["2"])  # gone endpoints: one sum per cluster


@pytest.mark.asyncio
async def test_an_endpoint_watched_again_adds_to_its_histogram_and_its_failures():
    """Watched again, an endpoint's series go on from what it counted before: the duration histogram (its
    buckets and count) and the failed transfers too, not only the completed ones."""
    registry = CollectorRegistry()

    def pulls_timed() -> float:
        return sum(s.value for family in registry.collect() if family.name == "aio_datadist_transfer_duration_seconds"
                   for s in family.samples if s.name.endswith("_count")
                   and s.labels["cluster_id"] == "2" and s.labels["kind"] == "pull")

    async with open_pair() as pair:
        metrics = instrument(pair.decoder, registry)
        kv = pair.decoder.kv_cache_manager
        for watched_again in (False, True):
            if watched_again:
                metrics.unwatch(pair.decoder)
                instrument(pair.decoder, registry)
            await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
            with pytest.raises(LLMException):
                await kv.pull_cache(aio.CacheKey(PROMPT_CLUSTER_ID, 987654), pair.decoder_rows)
        assert duplicated_series(registry) == []
        assert pulls_timed() == 2
        assert sample(registry, "aio_datadist_transfer_errors_total", cluster_id="2", kind="pull",
                      status="LLM_KV_CACHE_NOT_EXIST") == 2


@contextlib.contextmanager
def linked_facades(before_decoder_init: Callable[[Any], Any] = lambda decoder: None) -> Iterator[tuple[Any, Any, Any]]:
    """A blocking-facade PROMPT 31 (listening, with a blocks cache under ``BlocksCacheKey(31, 0)``) and DECODER 32
    linked to it; yields them and the decoder's blocks cache. ``before_decoder_init(decoder)`` runs between the
    two inits."""
    from aio_datadist import compat

    prompt, decoder = compat.LLMDataDist(LLMRole.PROMPT, 31), compat.LLMDataDist(LLMRole.DECODER, 32)
    try:
        prompt.init(loopback_options(listen=True))
        before_decoder_init(decoder)
        decoder.init(loopback_options())
        prompt.kv_cache_manager.allocate_blocks_cache(blocks_desc(), aio.BlocksCacheKey(31, 0))
        assert prompt.listen_address is not None
        status, _ = decoder.link_clusters([cluster(31, prompt.listen_address)])
        assert status == LLMStatusCode.LLM_SUCCESS
        yield prompt, decoder, decoder.kv_cache_manager.allocate_blocks_cache(blocks_desc())
    finally:
        decoder.finalize()
        prompt.finalize()
        compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


def test_the_blocking_facade_can_be_unwatched():
    registry = CollectorRegistry()
    pulls = {"cluster_id": "32", "kind": "pull", "transport": "local", "outcome": "ok"}
    with linked_facades() as (_, decoder, dst):
        metrics = instrument(decoder, registry)
        decoder.kv_cache_manager.pull_blocks(aio.BlocksCacheKey(31, 0), dst, [0], [0])
        assert sample(registry, "aio_datadist_transfers_total", **pulls) == 1
        metrics.unwatch(decoder)
        decoder.kv_cache_manager.pull_blocks(aio.BlocksCacheKey(31, 0), dst, [0], [0])
        assert sample(registry, "aio_datadist_transfers_total", **pulls) == 1  # not counted: unwatched
        assert registry.get_sample_value("aio_datadist_caches", {"cluster_id": "32"}) is None
        metrics.watch(decoder)  # the facade again: counting goes on from what was counted
        decoder.kv_cache_manager.pull_blocks(aio.BlocksCacheKey(31, 0), dst, [0], [0])
        assert sample(registry, "aio_datadist_transfers_total", **pulls) == 2
        del dst


def test_the_blocking_facade_unwatched_is_no_longer_observed():
    """Unwatched, the endpoint under the facade stops telling the exporter's observer of its transfers (not
    merely unread: an observer left on it would be called on every transfer for as long as it lives)."""
    registry = CollectorRegistry()
    with linked_facades() as (_, decoder, dst):
        observers = decoder._dd._endpoint.observers
        before = list(observers)
        metrics = instrument(decoder, registry)
        assert len(observers) == len(before) + 1
        metrics.unwatch(decoder)
        assert observers == before
        metrics.watch(decoder)
        metrics.unwatch(decoder)
        assert observers == before
        del dst


def test_metrics_cost_nothing_to_import_without_being_used():
    """``import aio_datadist`` and its stats never import prometheus_client (an optional extra)."""
    import subprocess

    code = ("import sys, aio_datadist, aio_datadist.stats, aio_datadist.datadist; "
            "print('prometheus_client' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"


def test_the_blocking_facade_has_stats_and_can_be_instrumented():
    registry = CollectorRegistry()
    with linked_facades(lambda decoder: instrument(decoder, registry)) as (_, decoder, dst):
        decoder.kv_cache_manager.pull_blocks(aio.BlocksCacheKey(31, 0), dst, [0], [0])
        assert decoder.stats().links[31].kinds["pull"].transfers == 1
        text = generate_latest(registry).decode()  # from this thread, while the facade's loop runs
        assert 'aio_datadist_caches{cluster_id="32"} 1.0' in text
        assert sample(registry, "aio_datadist_link_events_total", cluster_id="32", event="up") == 1
        del dst


@pytest.mark.asyncio
async def test_an_observer_that_fails_does_not_fail_the_transfer(caplog):
    class Broken:
        def transfer(self, *args):
            raise RuntimeError("observer bug")

        def link(self, *args):
            raise RuntimeError("observer bug")

    async with open_pair() as pair:
        pair.decoder._endpoint.observers.append(Broken())
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0], [0])
        assert pair.decoder.stats().links[PROMPT_CLUSTER_ID].kinds["pull"].transfers == 1
    failed = [r for r in caplog.records if "observer failed" in r.getMessage()]
    assert failed and all("RuntimeError: observer bug" in r.getMessage() for r in failed)
    # The traceback goes as text: a kept record holding it kept the transfer's frames and the caches with them
    # (on Python 3.12 this test then left the cache's memfd open at its leak check).
    assert all(r.exc_info is None for r in failed)


@pytest.mark.asyncio
async def test_one_format_with_the_link_fields_serves_every_record():
    import io

    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.addFilter(aio.LinkLogFields())
    handler.setFormatter(logging.Formatter("%(name)s [%(cluster_id)s->%(remote_cluster_id)s #%(link_id)s] "
                                           "%(message)s"))
    logger = logging.getLogger("aio_datadist")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        async with open_pair(prompt_config={"transport": "tcp"}, decoder_config={"transport": "tcp"}) as pair:
            logging.getLogger("aio_datadist.links").info("a record of no link")
            assert pair.decoder.stats().links
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = stream.getvalue().splitlines()
    assert any(re.fullmatch(r"aio_datadist\.links \[2->1 #\d+\] link \d+ to cluster 1 \(PROMPT\) up, dialled: "
                            r"transport tcp", line) for line in lines), lines
    assert "aio_datadist.links [-->- #-] a record of no link" in lines


def test_a_failure_with_llm_timeout_counts_as_a_timeout_for_the_stats_and_the_observers():
    """A served transfer the owner gave up at its deadline ends ``FAILED`` with ``LLM_TIMEOUT`` (a stream job's
    own timeout, an in-place request whose DONE never came): it counts as a timeout, as a requester's own does
    (``timeouts`` stayed 0 beside ``failures["LLM_TIMEOUT"]``)."""
    from aio_datadist.stats import LinkCounters, Outcome

    heard: list[Outcome] = []

    class Ear:
        def transfer(self, *args: Any) -> None:
            heard.append(args[5])

    counters = LinkCounters(1, 2, [Ear()])
    for status in (LLMStatusCode.LLM_TIMEOUT, LLMStatusCode.LLM_FAILED):
        counters.end("served_pull", "tcp", 64, counters.begin("served_pull"), Outcome.FAILED, status)
    kind = counters.snapshot(LLMRole.DECODER, 1, "tcp").kinds["served_pull"]
    assert (dict(kind.failures), kind.timeouts, kind.in_flight) == ({"LLM_TIMEOUT": 1, "LLM_FAILED": 1}, 1, 0)
    assert heard == [Outcome.TIMEOUT, Outcome.FAILED]


def test_transfers_reported_at_once_count_as_each_one_would():
    """A READ report's ``count`` reads reach the metrics observer in one call, counted exactly as ``count``
    calls of ``transfer`` would be: per size class, bytes, seconds and duration bucket."""
    from aio_datadist.metrics import _Observer
    from aio_datadist.stats import Outcome

    for count, nbytes, seconds in ((1, 2 << 20, 0.0003), (256, 256 * 4096 + 255, 0.5), (7, 4096 * 7 - 3, 7e-6),
                                   (5, 0, 0.0)):
        batched, single = _Observer("x"), _Observer("x")
        batched.transfers(1, "served_pull", "local", count, nbytes, seconds)
        for i in range(count):
            share = nbytes // count + (i < nbytes % count)
            single.transfer(1, "served_pull", "local", share, seconds / count, Outcome.OK, LLMStatusCode.LLM_SUCCESS)
        assert batched.done.keys() == single.done.keys()
        for key, done in single.done.items():
            other = batched.done[key]
            assert (other.count, other.bytes, other.buckets) == (done.count, done.bytes, done.buckets)
            assert other.seconds == pytest.approx(done.seconds)


@pytest.mark.asyncio
@pytest.mark.parametrize("said_as", ["protocol error", "acting on a control message failed"])
async def test_a_protocol_error_is_logged_with_the_link_fields(caplog, said_as):
    """The WARNING that says why a link died carries the fields of the other records about it, as does the
    ERROR of a well-formed message that acting on failed. (DEBUG too: a protocol error within 30 s of another in
    this process is said at DEBUG, paced, row 202; the fields are the same.)"""
    from aio_datadist.testing import link_to

    caplog.set_level(logging.DEBUG, logger="aio_datadist")
    async with open_pair(prompt_config={"transport": "tcp"}, decoder_config={"transport": "tcp"}) as pair:
        link = link_to(pair.decoder, PROMPT_CLUSTER_ID)
        if said_as == "protocol error":
            link_to(pair.prompt, DECODER_CLUSTER_ID).writer.write(b"\xff" * 64)  # a frame with a bad magic
        else:
            def fails(event: object) -> None:
                raise RuntimeError("a bug acting on it")

            link._dispatch = fails
            link_to(pair.prompt, DECODER_CLUSTER_ID)._probe()  # a well-formed PROBE
        for _ in range(250):
            if link.broken is not None:
                break
            await asyncio.sleep(0.02)
        assert link.broken is not None
    said = [r for r in caplog.records if said_as in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    assert all((getattr(r, "cluster_id", None), getattr(r, "remote_cluster_id", None), getattr(r, "link_id", None))
               == (DECODER_CLUSTER_ID, PROMPT_CLUSTER_ID, link.link_id) for r in said)


@pytest.mark.asyncio
async def test_the_same_host_sharing_records_carry_the_link_fields(caplog):
    """The INFO records a same-host link logs as its share attaches carry the link fields, on both ends."""
    from aio_datadist.testing import link_to

    caplog.set_level(logging.INFO, logger="aio_datadist")
    async with open_pair(prompt_config={"transport": "auto"}, decoder_config={"transport": "auto"}) as pair:
        ends = {DECODER_CLUSTER_ID: link_to(pair.decoder, PROMPT_CLUSTER_ID),
                PROMPT_CLUSTER_ID: link_to(pair.prompt, DECODER_CLUSTER_ID)}
        assert {link.transport for link in ends.values()} == {"local"}
    said = [r for r in caplog.records if "same-host share" in r.getMessage()]
    assert said, [r.getMessage() for r in caplog.records]
    for r in said:
        mine = ends.get(getattr(r, "cluster_id", None))
        assert mine is not None and (r.remote_cluster_id, r.link_id) == (mine.remote_cluster_id, mine.link_id), \
            r.getMessage()


@pytest.mark.asyncio
async def test_a_link_is_listed_and_exported_only_once_it_is_up():
    """While ``link_clusters`` still sets a link up (its same-host share attaching), neither ``stats().links``
    nor ``aio_datadist_links`` shows it: it would read ``tcp`` for a link that comes up ``local``."""
    registry = CollectorRegistry()
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 41), LLMDataDist(LLMRole.DECODER, 42)
    instrument(decoder, registry)
    async with prompt, decoder:
        await prompt.init(loopback_options(listen=True, transport="auto"))
        await decoder.init(loopback_options(transport="auto"))
        info = LLMClusterInfo()
        info.remote_cluster_id = 41
        info.append_remote_ip_info(*prompt.listen_address)
        linking = asyncio.ensure_future(decoder.link_clusters([info], timeout=5000))
        seen = []
        for _ in range(20000):
            if linking.done():
                break
            s = decoder.stats()
            seen.append((s.links_up, {c: link.transport for c, link in s.links.items()},
                         sample(registry, "aio_datadist_links", cluster_id="42", transport="tcp")))
            await asyncio.sleep(0)
        assert (await linking)[1] == [LLMStatusCode.LLM_SUCCESS]
        assert len(seen) > 1  # the link took loop passes to set up: there was a window to look into
        assert decoder.stats().links[41].transport == "local"
        early = [x for x in seen if (x[1] and (x[0] == 0 or x[1] != {41: "local"})) or x[2]]
        assert not early, early[:3]


def test_a_registry_its_owner_dropped_is_freed():
    import weakref

    refs = []
    for i in range(8):
        registry = CollectorRegistry()
        instrument(LLMDataDist(LLMRole.PROMPT, 100 + i), registry)
        refs.append(weakref.ref(registry))
        del registry
    gc.collect()
    assert [r for r in refs if r() is not None] == []
