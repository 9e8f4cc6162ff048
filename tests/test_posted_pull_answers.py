"""A posted pull (the stream plane's receive posted with the request) whose owner answers on the control
connection instead of the data channel: the caller's error says what the owner did. Before, a success ``DONE`` or
an accepting ``RESP`` there failed the pull ``LLM_LINK_FAILED`` with the message ``cluster 1: `` and nothing after
it (found by the hunt of the control wire)."""

from __future__ import annotations

import asyncio

import pytest

from aio_datadist import LLMException, LLMStatusCode, wire
from aio_datadist.testing import DECODER_CLUSTER_ID, links_of, open_pair
from aio_datadist.wire import Msg

ANSWERS = {
    "done": lambda rid: wire.encode(Msg.DONE, rid, status=0, text=""),
    "resp": lambda rid: wire.encode(Msg.RESP, rid, status=0, total=1, cache_id=-1, row=-1, text=""),
}


@pytest.mark.asyncio
@pytest.mark.parametrize("answer", sorted(ANSWERS))
async def test_an_answer_on_the_control_connection_says_what_it_was(answer):
    async with open_pair(prompt_config={"transport": "tcp"}, decoder_config={"transport": "tcp"}) as pair:
        owner = links_of(pair.prompt)[DECODER_CLUSTER_ID]
        asked: list[int] = []
        serve = owner.on_request

        def forge(link, msg, req_id, record):  # the owner answers on the control connection, once
            if msg is Msg.PULL_REQ and not asked:
                asked.append(req_id)
                owner.writer.write(ANSWERS[answer](req_id))
                return None
            return serve(link, msg, req_id, record)

        owner.on_request = forge
        with pytest.raises(LLMException) as failed:
            await asyncio.wait_for(pair.decoder.kv_cache_manager.pull_blocks(
                pair.blocks_key, pair.decoder_blocks, [0, 1], [2, 3], timeout=3000), 10)
        assert asked, "the pull was not posted"
        assert failed.value.status_code == LLMStatusCode.LLM_LINK_FAILED
        said = str(failed.value)
        assert f"request {asked[0]} on the control connection" in said and answer.upper() in said, said
        owner.on_request = serve
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0, 1], [2, 3],
                                                         timeout=3000)
