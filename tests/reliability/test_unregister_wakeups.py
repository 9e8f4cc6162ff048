"""No byte after return, our own pull into a registered device cache cut between a wake-up and its task's turn.

``unregister_cache`` / ``deallocate_cache`` of a registered cache cuts our own
transfer into it before it returns (row 168). The cut used to reset the
channel and wait for the device copies queued so far, but not stop the
transfer's task: when the cut ran in the loop pass that woke the task (a chunk
received, the owner's answer read) but before the task's turn, the task then
queued its next copy into memory the caller had back already. Here the cut is
made by a done-callback on that wake-up, as any application callback of that
pass could, and the caller repaints its memory at once: no byte may change it
afterwards, and the pull fails with ``LLM_KV_CACHE_NOT_EXIST``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
import torch
from peers import DECODER_ID, PROMPT_ID, linked_pair

from aio_datadist import BlocksCacheKey, CacheDesc, DataType, LLMException, LLMStatusCode, Placement
from aio_datadist.devices.staging import DeviceStaging
from aio_datadist.links import Link
from aio_datadist.testing import runtime_of, usable_link

pytestmark = pytest.mark.asyncio

DESC = CacheDesc(2, (8, 4096), DataType.DT_INT8, Placement.DEVICE)  # 8 blocks of 4 KiB, 2 tensors
ALL = list(range(8))


def on_first(monkeypatch: pytest.MonkeyPatch, name: str, runtime: Any, when: Callable[..., bool],
             then: Callable[[], None]) -> list[int]:
    """Wrap ``Link.<name>`` so that the first future it returns on ``runtime``'s links for which ``when(*args)``
    holds runs ``then`` in the loop pass it completes in (a success only): the list of times it did."""
    original = getattr(Link, name)
    ran: list[int] = []
    hooked: list[bool] = []

    def wrapped(self: Link, *args: Any, **kw: Any) -> asyncio.Future:
        fut = original(self, *args, **kw)
        if self.runtime is runtime and not hooked and not fut.done() and when(*args, **kw):
            hooked.append(True)

            def user(f: asyncio.Future) -> None:
                if not f.cancelled() and f.exception() is None:
                    then()
                    ran.append(1)

            fut.add_done_callback(user)
        return fut

    monkeypatch.setattr(Link, name, wrapped)
    return ran


def source_and_own(pair: Any, fill: int | None = None) -> tuple[Any, list[torch.Tensor], Any]:
    """The prompt's device blocks cache (filled with ``fill``), and the decoder's registered device cache over
    zeroed memory of its own: ``(src, mine, own)``."""
    src = pair.pm.allocate_blocks_cache(DESC, BlocksCacheKey(PROMPT_ID, 0))
    if fill is not None:
        for t in src.tensors:
            t.fill_(fill)
    mine = [torch.zeros(DESC.shape, dtype=torch.int8) for _ in range(DESC.num_tensors)]
    own = pair.dm.register_blocks_cache(DESC, mine)
    assert own.on_device
    return src, mine, own


def releaser(pair: Any, own: Any, mine: list[torch.Tensor]) -> Callable[[], None]:
    """What a framework does when it takes its memory back: unregister (v1: at once) and reuse it at once."""
    def release() -> None:
        pair.dm.deallocate_cache(own)
        for t in mine:
            t.fill_(-1)

    return release


async def pull_outcome(pull: Any) -> object:
    """The pull's status, run in this task (bounded by its own timeout): the cut cancels the task it runs in,
    and takes its cancel back, so this task is not left cancelling (a later ``asyncio.timeout`` would misread
    it)."""
    task = asyncio.current_task()
    assert task is not None and task.cancelling() == 0
    try:
        await pull
        status: object = LLMStatusCode.LLM_SUCCESS
    except LLMException as exc:
        status = exc.status_code
    assert task.cancelling() == 0
    return status


async def pull_lands_nothing(pair: Any, own: Any, mine: list[torch.Tensor], ran: list[int]) -> None:
    """Pull all of the prompt's blocks into ``own`` (whose memory is ``mine``): the hook ran once, the pull
    failed ``LLM_KV_CACHE_NOT_EXIST``, and nothing changed the repainted memory, 0.3 s on."""
    outcome = await pull_outcome(pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), own, ALL, ALL, timeout=5000))
    await asyncio.sleep(0.3)
    assert ran == [1]
    changed = sum(int((t != -1).sum()) for t in mine)
    assert (changed, outcome) == (0, LLMStatusCode.LLM_KV_CACHE_NOT_EXIST)


async def test_a_staged_pull_cut_as_a_chunk_came_in_scatters_nothing_more(monkeypatch):
    host = {"device_type": "host", "transport": "tcp"}
    async with linked_pair(prompt_config=host, decoder_config=host) as pair:
        for dd in (pair.prompt, pair.decoder):  # 4 KiB chunks: the pull is 16 chunks, one buffer filling at a time
            rt = runtime_of(dd)
            rt._staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=4096, buffers=2)
        _, mine, own = source_and_own(pair, 7)
        ran = on_first(monkeypatch, "move", runtime_of(pair.decoder), lambda *a, send, **kw: not send,
                       releaser(pair, own, mine))
        await pull_lands_nothing(pair, own, mine, ran)


async def test_a_device_ipc_pull_cut_as_its_answer_came_in_copies_nothing(monkeypatch):
    host = {"device_type": "host", "transport": "local"}
    async with linked_pair(prompt_config=host, decoder_config=host) as pair:
        src, mine, own = source_and_own(pair, 3)
        share = usable_link(pair.prompt, DECODER_ID).local
        for _ in range(200):  # the decoder mapped the export: device IPC carries the pull
            share.catch_up()
            if src.cache_id in share.peer_mapped:
                break
            await asyncio.sleep(0.01)
        assert src.cache_id in share.peer_mapped
        ran = on_first(monkeypatch, "expect", runtime_of(pair.decoder), lambda *a, **kw: True,
                       releaser(pair, own, mine))
        await pull_lands_nothing(pair, own, mine, ran)


async def test_a_caller_that_cancels_as_the_cut_lands_gets_its_cancel(monkeypatch):
    """The cut takes back only its own cancel: the caller's own, in the same pass, still ends the pull."""
    host = {"device_type": "host", "transport": "tcp"}
    async with linked_pair(prompt_config=host, decoder_config=host) as pair:
        for dd in (pair.prompt, pair.decoder):
            rt = runtime_of(dd)
            rt._staging = DeviceStaging(rt.completions, rt.devices, chunk_bytes=4096, buffers=2)
        _, mine, own = source_and_own(pair)
        pulling: list[asyncio.Task] = []
        release = releaser(pair, own, mine)

        def release_and_cancel() -> None:
            release()
            pulling[0].cancel()

        ran = on_first(monkeypatch, "move", runtime_of(pair.decoder), lambda *a, send, **kw: not send,
                       release_and_cancel)
        pulling.append(asyncio.ensure_future(
            pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), own, ALL, ALL, timeout=5000)))
        await asyncio.wait(pulling, timeout=10)
        await asyncio.sleep(0.3)
        assert ran == [1] and pulling[0].cancelled()
        assert sum(int((t != -1).sum()) for t in mine) == 0


async def test_a_callers_cancel_in_the_cuts_pass_is_not_taken_back_with_the_cuts():
    """The caller's own deadline, someone's cancel of the caller and the cut, all in one pass: the caller ends
    cancelled (its ``asyncio.timeout`` sees a cancel that is not its own), not with a ``TimeoutError``."""
    async with linked_pair() as pair:
        desc = CacheDesc(2, (8, 4096), DataType.DT_INT8, Placement.HOST)
        pair.pm.allocate_blocks_cache(desc, BlocksCacheKey(PROMPT_ID, 0))
        own = pair.dm.register_blocks_cache(desc, [torch.zeros(desc.shape, dtype=torch.int8) for _ in range(2)])
        rt = runtime_of(pair.decoder)
        serving = rt.registry.serving
        held: dict[str, Any] = {}
        seen: dict[str, Any] = {}

        def all_at_once() -> None:
            held["deadline"].reschedule(asyncio.get_running_loop().time())
            held["task"].cancel()
            pair.dm.deallocate_cache(own)

        def watched(caches: Any, cut: Any) -> Any:  # once the pull runs: the three in the next pass
            asyncio.get_running_loop().call_soon(all_at_once)
            return serving(caches, cut)

        rt.registry.serving = watched

        async def caller() -> None:
            try:
                async with asyncio.timeout(30) as deadline:
                    held["deadline"] = deadline
                    await pair.dm.pull_blocks(BlocksCacheKey(PROMPT_ID, 0), own, ALL, ALL, timeout=5000)
            except BaseException as exc:
                seen["raised"] = type(exc).__name__
                raise

        held["task"] = task = asyncio.ensure_future(caller())
        await asyncio.wait([task], timeout=10)
        rt.registry.serving = serving
        assert task.cancelled() and seen == {"raised": "CancelledError"}, seen
