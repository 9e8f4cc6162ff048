"""The testing plugin at its edges: a prompt push given up on, helpers given the wrong object, an owner's settling."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
import torch

import aio_datadist.testing as testing
from aio_datadist import LLMException, LLMRole, LLMStatusCode, compat
from aio_datadist.testing import engine_state, open_pair, open_process_pair

S = LLMStatusCode
HELPERS = (testing.runtime_of, testing.registry_of, testing.engine_state, testing.link_table_of, testing.links_of,
           testing.link_count, testing.handshakes_in_progress, testing.admission_of, testing.share_listener_of,
           testing.nixl_agent_of, lambda dd: testing.link_to(dd, 1), lambda dd: testing.usable_link(dd, 1))


@pytest.mark.asyncio(loop_factories=["asyncio"])  # a spawn is slow; test_testing_plugin.py's runs on uvloop
async def test_prompt_push_blocks_waits_for_its_own_answer(monkeypatch):
    """A push's answer is awaited as long as the push may take, and one given up on (cancelled) does not answer
    the next: a push the prompt refuses raises, one it does is in place."""
    async with asyncio.timeout(60):
        async with open_process_pair() as pair:
            with monkeypatch.context() as patched:
                patched.setattr(testing, "COMMAND_TIMEOUT_S", 0.0)
                await pair.prompt_push_blocks([1], [1], timeout=2000)  # awaited for 2 s + 5 s, not 0 s

            abandoned = asyncio.ensure_future(pair.prompt_push_blocks([0], [0]))
            await asyncio.sleep(0)  # sent; its answer is awaited
            abandoned.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await abandoned
            # the cancel was raised once the prompt answered: nothing of the push lands after it (found by review)
            assert all(torch.equal(got[0], want[0])
                       for got, want in zip(pair.decoder_blocks.tensors, pair.expected_blocks, strict=True))
            # cancelled again while it waits for the answer (an outer timeout, a task group): the same, and no
            # reader of the pipe is left to take the next call's (before: it returned at once, its push landed
            # later, and its answer's reader removed a later call's, which waited out its time; found by a hunt)
            pair.decoder_blocks.tensors[0][6].zero_()
            twice = asyncio.ensure_future(pair.prompt_push_blocks([6], [6]))
            await asyncio.sleep(0)
            twice.cancel()
            await asyncio.sleep(0)
            twice.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await twice
            assert torch.equal(pair.decoder_blocks.tensors[0][6], pair.expected_blocks[0][6])
            assert not [t for t in asyncio.all_tasks() if t.get_coro().__qualname__.endswith("._answer")]
            await pair.prompt_push_blocks([3], [3], timeout=None)  # the endpoint's default, as push_blocks takes
            with pytest.raises(LLMException) as info:
                await pair.prompt_push_blocks([99], [0])  # 8 blocks: the prompt's push_blocks refuses it
            assert info.value.status_code == S.LLM_PARAM_INVALID
            await pair.prompt_push_blocks([2], [2])
            for got, want in zip(pair.decoder_blocks.tensors, pair.expected_blocks, strict=True):
                assert torch.equal(got[[0, 1, 2, 3]], want[[0, 1, 2, 3]])


@pytest.mark.asyncio(loop_factories=["asyncio"])
async def test_prompt_push_blocks_drops_the_answer_of_a_call_that_ran_out_of_time(monkeypatch):
    """A call that gave up waiting (its answer awaited 0 s) leaves its answer in the pipe: the next call drops it
    and reads its own (a push the prompt refuses raises, not the late ``ok`` of the one before)."""
    async with asyncio.timeout(60):
        async with open_process_pair() as pair:
            with monkeypatch.context() as patched:
                patched.setattr(testing, "COMMAND_TIMEOUT_S", 0.0)
                with pytest.raises(RuntimeError, match="did not answer"):
                    await pair.prompt_push_blocks([4], [4], timeout=None)  # awaited COMMAND_TIMEOUT_S: 0 s
            with pytest.raises(LLMException) as info:
                await pair.prompt_push_blocks([99], [0])  # the prompt refuses it; the late "ok" above is dropped
            assert info.value.status_code == S.LLM_PARAM_INVALID
            await pair.prompt_push_blocks([5], [5])
            for got, want in zip(pair.decoder_blocks.tensors, pair.expected_blocks, strict=True):
                assert torch.equal(got[[4, 5]], want[[4, 5]])
    # used after its pair closed (the prompt reaped): RuntimeError saying so, as for a prompt that is gone (before,
    # ValueError "process object is closed" from multiprocessing; found by a hunt)
    with pytest.raises(RuntimeError, match="pair is closed"):
        await pair.prompt_push_blocks([6], [6])
    for late in (lambda: pair.prompt_pid, pair.kill_prompt):
        with pytest.raises(RuntimeError, match="pair is closed"):
            late()


def test_the_helpers_take_the_blocking_endpoint_and_refuse_anything_else():
    """The blocking ``compat.LLMDataDist`` is the endpoint it wraps (here not initialized: ``LLM_FAILED``);
    what is no endpoint is ``LLM_PARAM_INVALID`` naming what it got."""
    facade = compat.LLMDataDist(LLMRole.DECODER, 9)
    for helper in HELPERS:
        with pytest.raises(LLMException) as info:
            helper(facade)
        assert info.value.status_code == S.LLM_FAILED
        for wrong in (None, object(), type("Wrapper", (), {"_dd": object()})()):  # wraps no endpoint: itself named
            with pytest.raises(LLMException, match=f"expected an LLMDataDist, got {type(wrong).__name__}") as info:
                helper(wrong)
            assert info.value.status_code == S.LLM_PARAM_INVALID


@pytest.mark.asyncio
async def test_settled_engine_state_waits_for_the_owner_to_give_back_a_pulled_key():
    """After a pull by a key it consumes the owner holds the key's claim until the requester's DONE arrives
    (rows 110, 125): ``settled_engine_state`` gives the state once it is back where it was."""
    async with asyncio.timeout(30):
        async with open_pair() as pair:
            before = engine_state(pair.prompt)
            await pair.decoder.kv_cache_manager.pull_cache(pair.row_key(0), pair.decoder_rows, batch_index=1)
            assert await testing.settled_engine_state(pair.prompt, before) == before
            never = {**before, "caches": before["caches"] + 1}
            assert await testing.settled_engine_state(pair.prompt, never, timeout=0.02) == before


@pytest.mark.asyncio
async def test_settled_engine_state_gives_up_after_its_own_timeout():
    """A state that never comes is given as it is once ``timeout`` is out: that timeout, not the default 2 s."""
    async with asyncio.timeout(30):
        async with open_pair() as pair:
            before = engine_state(pair.prompt)
            never = {**before, "caches": before["caches"] + 1}
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await testing.settled_engine_state(pair.prompt, never, timeout=0.05) == before
            assert 0.05 <= loop.time() - started < 1.0  # waited for the whole state, not one of its counts


@pytest.mark.asyncio
@pytest.mark.loops_take_turns  # argument checks, not the loop's
async def test_the_link_helpers_and_settled_engine_state_refuse_bad_arguments():
    """Before, ``usable_link(dd, "1")`` said cluster 1 (linked) was not linked, ``link_to(dd, 1.5)`` returned None,
    and ``settled_engine_state`` raised bare ``TypeError`` for a missing mapping or timeout (found by a hunt)."""
    async with open_pair() as pair:
        dd = pair.decoder
        assert testing.usable_link(dd, pair.prompt_cluster_id) is testing.link_to(dd, pair.prompt_cluster_id)
        for helper in (testing.link_to, testing.usable_link):
            for wrong in (str(pair.prompt_cluster_id), 1.5, [1], -1, True):
                with pytest.raises(LLMException, match="cluster_id") as info:
                    helper(dd, wrong)
                assert info.value.status_code == S.LLM_PARAM_INVALID, (helper, wrong)
        for expected, timeout, named in ((None, 1.0, "expected"), ({}, None, "timeout"), ({}, -1, "timeout"),
                                         ({}, True, "timeout"), ({}, float("nan"), "timeout")):
            with pytest.raises(LLMException, match=named) as info:
                await testing.settled_engine_state(dd, expected, timeout=timeout)
            assert info.value.status_code == S.LLM_PARAM_INVALID
