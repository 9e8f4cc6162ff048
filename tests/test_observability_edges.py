"""Edges of the Prometheus exporter and of the owner's counts: scrapes in a forked child and of several endpoints
on a blocked loop, exporters let go with their registry, scrapes filtered by name, and a transfer its
requester gave up counted alike on every plane."""

from __future__ import annotations

import asyncio
import gc
import os
import select
import signal
import threading
import time
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest, make_wsgi_app

from aio_datadist import (BlocksCacheKey, CacheDesc, CacheKey, DataType, LLMDataDist, LLMException, LLMRole,
                          LLMStatusCode, Placement, metrics, protocol)
from aio_datadist.metrics import instrument
from aio_datadist.stats import LinkCounters
from aio_datadist.testing import loopback_options, open_pair, usable_link

#: How long a forked child may take to scrape (it needs milliseconds; the defect waited SCRAPE_WAIT_S).
CHILD_S = 1.0


def _scrape_in_a_child(registry: CollectorRegistry) -> bytes:
    """Fork; the child scrapes ``registry`` and writes what it got. The scrape, or ``b""`` when the child did
    not answer within :data:`CHILD_S` (it is killed then; it is reaped either way)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns
        try:
            os.close(r)
            os.write(w, generate_latest(registry) or b"-")
        finally:
            os._exit(0)
    os.close(w)
    answer = b""
    try:
        if select.select([r], [], [], CHILD_S)[0]:
            answer = os.read(r, 1 << 20)
    finally:
        os.close(r)
        if not answer:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    return answer


@pytest.mark.asyncio
async def test_a_scrape_in_a_forked_child_does_not_wait_on_the_parents_loop(monkeypatch):
    """The child's copy of the endpoint's loop says it runs (it keeps the parent's thread id) though no thread
    runs it there: a scrape must not post to it (into the wake-up pipe it shares with the parent) and wait
    SCRAPE_WAIT_S for an answer that never comes. The child gets the counts, no gauges (stats() is refused).
    This process passes for a forked one itself (a forking server's worker): its own endpoint is no parent's
    (``init`` records ``forks()``; with that gone, an endpoint of a forked worker lost its gauges and every
    call: audit, 2026-12-07)."""
    from aio_datadist import _forks

    monkeypatch.setattr(_forks, "_FORKS", 3)
    registry = CollectorRegistry()
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    await dd.init(loopback_options())
    try:
        instrument(dd, registry)
        text = await asyncio.wait_for(asyncio.to_thread(_scrape_in_a_child, registry), 5 * CHILD_S)
        assert b"# TYPE aio_datadist_transfers_total counter" in text
        assert b"aio_datadist_caches{" not in text
        assert b'aio_datadist_caches{cluster_id="7"}' in generate_latest(registry)  # here: gauges as before
    finally:
        await dd.finalize()


@pytest.mark.asyncio
async def test_a_scrape_in_a_forked_child_gives_the_counts_copied_at_the_fork():
    """Row 261: the child gives a parent's endpoint its counts as copied at the fork, not none (the test above
    checks only that the scrape answers, with no gauges: an endpoint left out, or given empty counts, passed)."""
    registry = CollectorRegistry()
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    await dd.init(loopback_options())
    try:
        instrument(dd, registry)
        LinkCounters(7, 8, dd._endpoint.observers).refused("pull", "tcp", LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        text = await asyncio.wait_for(asyncio.to_thread(_scrape_in_a_child, registry), 5 * CHILD_S)
        assert (b'aio_datadist_transfer_errors_total{cluster_id="7",kind="pull",status="LLM_KV_CACHE_NOT_EXIST"} 1.0'
                in text), text
    finally:
        await dd.finalize()


def test_a_scrape_in_a_child_forked_from_a_blocking_facade_user_does_not_wait():
    from aio_datadist import compat

    registry = CollectorRegistry()
    dd = compat.LLMDataDist(LLMRole.PROMPT, 61)
    try:
        dd.init(loopback_options())
        instrument(dd, registry)
        assert b"# TYPE aio_datadist_transfers_total counter" in _scrape_in_a_child(registry)
    finally:
        dd.finalize()
        compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


@pytest.mark.asyncio
async def test_a_scrape_of_endpoints_on_one_blocked_loop_waits_once(monkeypatch):
    """A scrape from another thread waits SCRAPE_WAIT_S for the endpoints' loops in all, not that for each
    endpoint in turn (five endpoints on a busy loop took 10 s, Prometheus' default scrape_timeout)."""
    wait_s = 0.2
    monkeypatch.setattr(metrics, "SCRAPE_WAIT_S", wait_s)
    registry = CollectorRegistry()
    endpoints = [LLMDataDist(LLMRole.PROMPT, 70 + i) for i in range(3)]
    try:
        for dd in endpoints:
            await dd.init(loopback_options())
            instrument(dd, registry)
            LinkCounters(dd.cluster_id, 9, dd._endpoint.observers).refused("pull", "tcp",
                                                                          LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        took: list[float] = []
        texts: list[bytes] = []

        def scrape() -> None:
            t0 = time.monotonic()
            texts.append(generate_latest(registry))
            took.append(time.monotonic() - t0)

        scraper = threading.Thread(target=scrape)
        scraper.start()
        time.sleep(3 * wait_s + 0.1)  # the endpoints' loop is blocked past three waits
        await asyncio.to_thread(scraper.join, 5)
        assert took and took[0] < 2 * wait_s, took
        assert b"aio_datadist_caches{" not in texts[0]  # not answered in time: counts only
        for i in range(3):  # but their counts, not left out (a counter gone from a scrape reads as a reset)
            assert (f'aio_datadist_transfer_errors_total{{cluster_id="{70 + i}",kind="pull",'
                    f'status="LLM_KV_CACHE_NOT_EXIST"}} 1.0').encode() in texts[0], texts[0]
        text = await asyncio.to_thread(generate_latest, registry)  # the loop free again: every endpoint answers
        assert all(f'aio_datadist_caches{{cluster_id="{70 + i}"}}'.encode() in text for i in range(3))
    finally:
        for dd in endpoints:
            await dd.finalize()


@pytest.mark.asyncio
async def test_a_scrape_waits_for_every_loop_not_only_the_first_to_answer():
    """Row 262: the scrape waits for all the answers together (SCRAPE_WAIT_S in all), not for the first: an
    endpoint on a loop busy for less than SCRAPE_WAIT_S (here the blocking facade's) still gives its gauges when
    another loop (this one) answers at once. (The test above has every endpoint on one loop: they answer in one
    turn, so a scrape that waited for the first answer only passed it.)"""
    from aio_datadist import compat

    registry = CollectorRegistry()
    here = LLMDataDist(LLMRole.PROMPT, 80)
    there = compat.LLMDataDist(LLMRole.PROMPT, 81)
    try:
        await here.init(loopback_options())
        await asyncio.to_thread(there.init, loopback_options())
        instrument(here, registry)
        instrument(there, registry)
        there._dd._endpoint.runtime.loop.call_soon_threadsafe(time.sleep, 0.3)  # busy, well within SCRAPE_WAIT_S
        text = await asyncio.to_thread(generate_latest, registry)
        assert b'aio_datadist_caches{cluster_id="80"}' in text
        assert b'aio_datadist_caches{cluster_id="81"}' in text, "the busy loop's endpoint was not waited for"
    finally:
        await here.finalize()
        await asyncio.to_thread(there.finalize)
        compat._RUNNER.stop()  # the facade's loop thread lives for the process; end it for the leak check


def test_observers_of_registries_their_owner_dropped_are_let_go():
    """Each exporter put an observer on the endpoint that stayed there for good, called on every transfer,
    after its registry (and the exporter) was freed."""
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    kept = CollectorRegistry()
    instrument(dd, kept)
    for _ in range(5):
        instrument(dd, CollectorRegistry())
    gc.collect()
    assert len(dd._endpoint.observers) == 1  # the one of ``kept``
    LinkCounters(7, 8, dd._endpoint.observers).refused("pull", "tcp", LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    assert kept.get_sample_value("aio_datadist_transfer_errors_total",
                                 {"cluster_id": "7", "kind": "pull", "status": "LLM_KV_CACHE_NOT_EXIST"}) == 1

    async def initialised() -> None:
        """So for the observers the links tell (the runtime's list, shared with the endpoint's): exporters alive
        at ``init`` and dropped after it (the tests above never ``init``: a runtime given a copy of the list
        kept them for good, and heard no exporter made after ``init``; audit, 2026-12-07)."""
        gc.disable()
        try:
            for _ in range(5):
                instrument(dd, CollectorRegistry())
            await dd.init(loopback_options())
        finally:
            gc.enable()
        try:
            gc.collect()
            later = CollectorRegistry()
            instrument(dd, later)
            observers = dd._endpoint.runtime.observers
            assert len(observers) == 2  # the ones of ``kept`` and ``later``
            LinkCounters(7, 8, observers).refused("pull", "tcp", LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
            assert later.get_sample_value("aio_datadist_transfer_errors_total", {
                "cluster_id": "7", "kind": "pull", "status": "LLM_KV_CACHE_NOT_EXIST"}) == 1
        finally:
            await dd.finalize()

    asyncio.run(initialised())


@pytest.mark.parametrize("event", ["end", "ended_many", "link_event"])
def test_an_exporter_let_go_during_a_transfer_costs_no_other_observer_its_count(event):
    """The garbage collector may free an exporter, which takes its observer off the endpoint, while the loop
    tells the observers of a transfer (or ``unwatch`` from another thread may): the next observer in the list
    was skipped (a list iterated while an earlier entry is removed). ``ended_many`` (a peer's READ report) and
    ``link_event`` tell a copy of the list too (row 263; only ``end`` was tried before: found by audit)."""

    class Collects:
        def transfer(self, *args: Any) -> None:
            gc.collect()

        def transfers(self, *args: Any) -> None:
            gc.collect()

        def link(self, *args: Any) -> None:
            gc.collect()

    dd = LLMDataDist(LLMRole.PROMPT, 7)
    kept = CollectorRegistry()
    gc.disable()  # the dropped exporter is freed where the test says, not before
    try:
        instrument(dd, CollectorRegistry())  # dropped at once
        dd._endpoint.observers.append(Collects())
        instrument(dd, kept)
        counters = LinkCounters(7, 8, dd._endpoint.observers)
        if event == "end":
            counters.refused("pull", "tcp", LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
        elif event == "ended_many":
            counters.ended_many("pull", "tcp", 2, 4096, 0.01)
        else:
            counters.link_event(up=True)
    finally:
        gc.enable()
    if event == "end":
        assert kept.get_sample_value("aio_datadist_transfer_errors_total",
                                     {"cluster_id": "7", "kind": "pull", "status": "LLM_KV_CACHE_NOT_EXIST"}) == 1
    elif event == "ended_many":
        assert kept.get_sample_value("aio_datadist_transfers_total", {"cluster_id": "7", "kind": "pull",
                                                                      "transport": "tcp", "outcome": "ok"}) == 2
    else:
        assert kept.get_sample_value("aio_datadist_link_events_total", {"cluster_id": "7", "event": "up"}) == 1
    assert len(dd._endpoint.observers) == 2


def test_a_scrape_filtered_by_name_yields_the_series_asked_for():
    """prometheus_client's exposition (start_http_server, its WSGI and ASGI apps) honours ``?name[]=``, looking
    the names up among those the collectors described; the exporter described none, so such a scrape yielded
    nothing of aio_datadist."""
    registry = CollectorRegistry()
    dd = LLMDataDist(LLMRole.PROMPT, 7)
    instrument(dd, registry)
    LinkCounters(7, 8, dd._endpoint.observers).refused("pull", "tcp", LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)
    app = make_wsgi_app(registry)
    body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/metrics", "HTTP_ACCEPT": "",
                         "QUERY_STRING": "name[]=aio_datadist_transfers_total"}, lambda status, headers: None))
    assert b'aio_datadist_transfers_total{cluster_id="7",kind="pull",outcome="failed",transport="tcp"} 1.0' in body
    assert b"aio_datadist_transfer_errors_total" not in body  # only what was asked for
    described = {family.name for collector in registry._collector_to_names for family in collector.describe()}
    assert described == {family.name for family in registry.collect()}


#: The blocks a transfer the requester gives up moves: 8 blocks of 512 KiB in each of 4 tensors, 16 MiB, which
#: take the owner's job milliseconds, so a cancel a few loop turns after the request still catches it mid-way on
#: either loop. The fixture's 128-byte blocks went out in the owner's first send: on uvloop its pull was over
#: before any cancel landed, and no failure was ever counted.
BIG_BLOCKS = CacheDesc(4, (8, 256 * 1024), DataType.DT_FLOAT16, Placement.HOST)


def _read_aborts_late(link: Any, delay_s: float) -> None:
    """``link`` acts on each ``ABORT`` it reads ``delay_s`` late: the job the ABORT stops sees its channel's reset
    first."""
    loop = asyncio.get_running_loop()
    dispatch = link._dispatch

    def late(event: Any) -> None:
        if isinstance(event, protocol.Abort):
            loop.call_later(delay_s, dispatch, event)
        else:
            dispatch(event)

    link._dispatch = late


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["pull", "push"])
async def test_a_transfer_its_requester_gave_up_is_no_link_failure_on_the_owner(kind):
    """TCP: a transfer the requester cancels mid-way resets its data channel before the ABORT, and the owner's
    job failed with the reset (``LLM_LINK_FAILED``) on a link that stayed up, so an operator's
    transfer_errors_total{status="LLM_LINK_FAILED"} rose on healthy links. The same abort, heard first, and
    the same-host plane count ``LLM_FAILED``. (A push's owner hears the reset first; a pull's would mostly hear
    the ABORT first, the owner's send learning of the reset after the ABORT was written, so here the pull's
    owner reads every ABORT late (found by audit: without that, the pull case passed with the fix taken out).)"""
    config = {"transport": "tcp"}
    blocks = list(range(BIG_BLOCKS.shape[0]))
    async with open_pair(prompt_config=config, decoder_config=config) as pair:
        prompt_kv, decoder_kv = pair.prompt.kv_cache_manager, pair.decoder.kv_cache_manager
        if kind == "pull":
            _read_aborts_late(usable_link(pair.prompt, pair.decoder_cluster_id), 0.05)
        if kind == "push":
            requester, owner = pair.prompt, pair.decoder
            key = BlocksCacheKey(pair.decoder_cluster_id, 1)
            src, dst = prompt_kv.allocate_blocks_cache(BIG_BLOCKS), decoder_kv.allocate_blocks_cache(BIG_BLOCKS, key)

            def transfer() -> Any:
                return prompt_kv.push_blocks(key, src, blocks, blocks)
        else:
            requester, owner = pair.decoder, pair.prompt
            key = BlocksCacheKey(pair.prompt_cluster_id, 1)
            src, dst = prompt_kv.allocate_blocks_cache(BIG_BLOCKS, key), decoder_kv.allocate_blocks_cache(BIG_BLOCKS)

            def transfer() -> Any:
                return decoder_kv.pull_blocks(key, dst, blocks, blocks)

        for i, tensor in enumerate(src.tensors):
            tensor.fill_(i + 1)

        def served() -> Any:
            return owner.stats().links[requester.cluster_id].kinds[f"served_{kind}"]

        for i in range(15):  # until the owner failed twice: a cancel caught its job mid-way
            task = asyncio.ensure_future(transfer())
            for _ in range(1 + i % 3):
                await asyncio.sleep(0)
            task.cancel()
            await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
            if sum(served().failures.values()) >= 2:
                break
        for _ in range(300):  # the owner counts a job it stopped once it read the ABORT (late here): bounded wait
            if served().in_flight == 0:
                break
            await asyncio.sleep(0.01)
        assert sum(served().failures.values()) >= 2, f"no cancel caught the owner's job mid-way: {served()}"
        await transfer()  # the link still moves bytes
        assert all(bool((tensor == i + 1).all()) for i, tensor in enumerate(dst.tensors))
        for _ in range(100):  # an owner counts a pull once the requester's word arrived: wait (bounded) for it
            if served().in_flight == 0 and served().transfers:
                break
            await asyncio.sleep(0.01)
        assert owner.stats().links_down == 0  # the link never failed
        assert requester.stats().links[owner.cluster_id].kinds[kind].cancellations > 0
        assert "LLM_LINK_FAILED" not in served().failures, dict(served().failures)


@pytest.mark.asyncio
@pytest.mark.parametrize("first", ["broken", "aborted"])
async def test_a_pull_whose_link_broke_first_is_a_link_failure_on_the_owner(first):
    """The other side of the row above: a requester that dies under a pull its owner serves counts
    ``LLM_LINK_FAILED`` when the owner marks its link broken first (its heartbeat stopped, its control
    connection was lost): the link's teardown stops the job, and that is no abort of the requester's
    (found by audit, 2026-12-07). ``aborted``: the requester's ABORT stopped the job, and the link broke
    before the job's end was counted (in the same loop pass): still the abort's ``LLM_FAILED`` (the cause is
    taken when the job is stopped; found by the review)."""
    config, blocks = {"transport": "tcp"}, list(range(BIG_BLOCKS.shape[0]))
    registry = CollectorRegistry()
    async with open_pair(prompt_config=config, decoder_config=config) as pair:
        instrument(pair.prompt, registry)
        key = BlocksCacheKey(pair.prompt_cluster_id, 1)
        pair.prompt.kv_cache_manager.allocate_blocks_cache(BIG_BLOCKS, key)
        dst = pair.decoder.kv_cache_manager.allocate_blocks_cache(BIG_BLOCKS)
        owner_link = usable_link(pair.prompt, pair.decoder_cluster_id)
        task = asyncio.ensure_future(pair.decoder.kv_cache_manager.pull_blocks(key, dst, blocks, blocks))
        for _ in range(200):
            if owner_link.serving:
                break
            await asyncio.sleep(0)
        assert owner_link.serving, "the owner never served the pull"
        if first == "aborted":
            (abort,) = owner_link.serving.values()
            abort()  # as the requester's ABORT does
        owner_link.fail(LLMException("no heartbeat for 9.9 s", status_code=LLMStatusCode.LLM_LINK_FAILED))
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)
        await asyncio.sleep(0)
    errors = {status: registry.get_sample_value("aio_datadist_transfer_errors_total",
                                                {"cluster_id": "1", "kind": "served_pull", "status": status})
              for status in ("LLM_LINK_FAILED", "LLM_FAILED")}
    assert errors == ({"LLM_LINK_FAILED": 1.0, "LLM_FAILED": None} if first == "broken" else
                      {"LLM_LINK_FAILED": None, "LLM_FAILED": 1.0}), errors



#: A rows cache whose key a same-host pull asks for (a key pull is never read without asking: the owner serves it
#: in place and waits for the requester's DONE while the requester copies its 16 MiB).
BIG_ROWS = CacheDesc(4, (1, 8 * 256 * 1024), DataType.DT_FLOAT16, Placement.HOST)


async def _wait_until(what: str, done: Any) -> None:
    for _ in range(5000):
        if done():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"never: {what}")


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["pull", "push"])
@pytest.mark.parametrize("first", ["broken", "aborted"])
async def test_a_same_host_transfer_whose_link_broke_first_is_a_link_failure_on_the_owner(kind, first):
    """The row above on the same-host plane: a pull its owner serves in place (the requester copies; the owner
    waits for its DONE) and a push the owner copies itself count ``LLM_LINK_FAILED`` when the owner marks the
    link broken under them, as the stream plane's job does; before, ``LLM_FAILED`` (found by review,
    2026-12-07). ``aborted``: the requester's word stopped the request first (a failed DONE for the pull, its
    ABORT for the push), then the link broke: still ``LLM_FAILED``."""
    async with open_pair() as pair:
        prompt_kv, decoder_kv = pair.prompt.kv_cache_manager, pair.decoder.kv_cache_manager
        registry = CollectorRegistry()
        if kind == "pull":
            requester, owner = pair.decoder, pair.prompt
            key = CacheKey(pair.prompt_cluster_id, 7)
            prompt_kv.allocate_cache(BIG_ROWS, [key])
            dst = decoder_kv.allocate_cache(BIG_ROWS)
            moving = decoder_kv.pull_cache(key, dst, 0)
        else:
            requester, owner = pair.prompt, pair.decoder
            key = BlocksCacheKey(pair.decoder_cluster_id, 1)
            blocks = list(range(BIG_BLOCKS.shape[0]))
            src = prompt_kv.allocate_blocks_cache(BIG_BLOCKS)
            decoder_kv.allocate_blocks_cache(BIG_BLOCKS, key)
            moving = prompt_kv.push_blocks(key, src, blocks, blocks)
        instrument(owner, registry)
        owner_link = usable_link(owner, requester.cluster_id)
        assert owner_link.transport == "local"
        task = asyncio.ensure_future(moving)
        if kind == "pull":
            await _wait_until("the owner served the pull in place", lambda: owner_link.pull_acks)
            if first == "aborted":
                (_, on_fail), = owner_link.pull_acks.values()
                on_fail()  # as the requester's failed DONE does
        else:
            await _wait_until("the owner copied the push", lambda: owner_link.local_pushes)
            if first == "aborted":
                (abort,) = owner_link.serving.values()
                abort()  # as the requester's ABORT does
        owner_link.fail(LLMException("no heartbeat for 9.9 s", status_code=LLMStatusCode.LLM_LINK_FAILED))
        await asyncio.wait_for(asyncio.gather(task, return_exceptions=True), 5)

        def errors() -> dict[str, float | None]:
            return {status: registry.get_sample_value("aio_datadist_transfer_errors_total", {
                "cluster_id": str(owner.cluster_id), "kind": f"served_{kind}", "status": status})
                for status in ("LLM_LINK_FAILED", "LLM_FAILED")}

        await _wait_until("the owner counted the request", lambda: any(errors().values()))
        await asyncio.sleep(0.05)  # nothing more is counted
        counted = errors()
    assert counted == ({"LLM_LINK_FAILED": 1.0, "LLM_FAILED": None} if first == "broken" else
                       {"LLM_LINK_FAILED": None, "LLM_FAILED": 1.0}), counted


def test_an_endpoint_whose_loop_closed_without_finalize_gives_counts_and_no_gauges():
    """Before, a scrape after the endpoint's loop ended without ``finalize`` read its stats from the scraping
    thread and exported its link as up, its round trip and caches frozen, for good (found by audit). Its links
    carry nothing any more: counts only, as for a forked child (row 261). (A loop closed without its shutdown
    step: ``asyncio.run`` finalizes the endpoint now, row 323.)"""
    from aio_datadist import testing

    registry = CollectorRegistry()
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    instrument(decoder, registry)

    async def main() -> None:
        await prompt.init(loopback_options(listen=True))
        await decoder.init(loopback_options())
        await testing._link(decoder, prompt.listen_address)
        assert registry.get_sample_value("aio_datadist_links", {"cluster_id": "2", "transport": "local"}) == 1

    def run() -> None:  # returns without finalize, and closes the loop without shutting it down
        loop = asyncio.new_event_loop()
        loop.run_until_complete(main())
        loop.close()

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(60)
    try:
        assert decoder._endpoint.runtime.loop.is_closed()
        text = generate_latest(registry).decode()
        assert "aio_datadist_links{" not in text and "aio_datadist_caches{" not in text
        assert registry.get_sample_value("aio_datadist_link_events_total",
                                         {"cluster_id": "2", "event": "up"}) == 1  # what it counted stays
    finally:
        async def finalize() -> None:
            for dd in (decoder, prompt):
                await asyncio.wait_for(dd.finalize(), 10)

        asyncio.run(finalize())


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_an_endpoint_whose_llmdatadist_was_dropped_but_whose_manager_serves_is_still_counted():
    """Before, the exporter watched the ``LLMDataDist`` object, a thin wrapper: a caller that kept its manager and
    dropped it had the endpoint go on serving while a scrape retired its counts and dropped its gauges (its
    observer counting into nothing any scrape read; found by audit). Now the endpoint under it is watched."""
    from aio_datadist import BlocksCacheKey, testing
    from aio_datadist.testing import blocks_desc

    registry = CollectorRegistry()
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    await prompt.init(loopback_options(listen=True))
    await decoder.init(loopback_options())
    instrument(prompt, registry)
    endpoint = prompt._endpoint
    kept = prompt.kv_cache_manager
    kept.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
    dst = decoder.kv_cache_manager.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(2, 0))
    await testing._link(decoder, prompt.listen_address)

    def served() -> float | None:
        return registry.get_sample_value("aio_datadist_transfers_total", {
            "cluster_id": "1", "kind": "served_pull", "transport": "local", "outcome": "ok"})

    try:
        await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        del prompt
        gc.collect()
        for _ in range(3):
            await decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0])
        link = next(iter(endpoint.links.links.values()))
        deadline = time.monotonic() + 10
        while served() != 4 and time.monotonic() < deadline:  # reads without asking are reported a moment later
            await asyncio.sleep(0.05)
        assert served() == 4 == link.stats().kinds["served_pull"].transfers
        assert registry.get_sample_value("aio_datadist_caches", {"cluster_id": "1"}) == 1
    finally:
        await decoder.finalize()
        owner = LLMDataDist.__new__(LLMDataDist)  # the dropped LLMDataDist's finalize, on its endpoint
        owner._endpoint, owner._comms = endpoint, None
        await owner.finalize()


@pytest.mark.asyncio(loop_factories=["asyncio"])
@pytest.mark.parametrize("transport", ["tcp", "local"])
async def test_transfers_a_finalize_failed_are_counted_after_it_returned(transport):
    """Pulls in flight when their endpoint finalizes fail as their tasks end, after ``finalize`` returned: a scrape
    right after it must not stop the endpoint's counting (a first form of row 308 retired a finalized endpoint at
    the next scrape and lost 183 of 200; found by review)."""
    from aio_datadist import BlocksCacheKey, testing
    from aio_datadist.testing import blocks_desc

    registry = CollectorRegistry()
    prompt, decoder = LLMDataDist(LLMRole.PROMPT, 1), LLMDataDist(LLMRole.DECODER, 2)
    await prompt.init(loopback_options(listen=True, transport=transport))
    await decoder.init(loopback_options(transport=transport))
    instrument(decoder, registry)
    ended: list[int] = []

    class Probe:  # an observer of its own beside the exporter's: every transfer the endpoint counts
        def transfer(self, *args: Any) -> None:
            ended.append(1)

        def transfers(self, cluster_id: int, kind: str, transport: str, count: int, *args: Any) -> None:
            ended.append(count)

        def link(self, *args: Any) -> None:
            pass

    decoder._endpoint.observers.append(Probe())
    try:
        prompt.kv_cache_manager.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(1, 0))
        dst = decoder.kv_cache_manager.allocate_blocks_cache(blocks_desc(), BlocksCacheKey(2, 0))
        await testing._link(decoder, prompt.listen_address)
        pulls = [asyncio.ensure_future(decoder.kv_cache_manager.pull_blocks(BlocksCacheKey(1, 0), dst, [0], [0]))
                 for _ in range(100)]
        await asyncio.sleep(0)
        await decoder.finalize()
        generate_latest(registry)  # a scrape right after finalize returned
        await asyncio.gather(*pulls, return_exceptions=True)
        counted = sum(sample.value for family in registry.collect() if family.name == "aio_datadist_transfers"
                      for sample in family.samples if sample.name.endswith("_total"))
        assert counted == sum(ended) == 100
    finally:
        await decoder.finalize()
        await prompt.finalize()
