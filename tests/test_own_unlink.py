"""Our own unlink is an unlink, not a failure: what it cuts reads ``LLM_NOT_YET_LINK`` (row 275).

The peer answers our ``UNLINK`` and closes its end; our reader can hear that close before the unlink gets to
``Link.close()``. It used to take it for a lost connection: the link was marked broken and a transfer the
unlink cut failed ``LLM_LINK_FAILED`` ("connection lost"), its data channels reset, where one cut by the
peer's unlink reads ``LLM_NOT_YET_LINK`` ("was unlinked").
"""

from __future__ import annotations

import asyncio

import pytest
from peers import DECODER_ID, PROMPT_ID, cluster_info, port_of
from test_layerwise import DST_BLOCKS, LAYERS, SRC_BLOCKS, Gate, blocks_config, setup

from aio_datadist import LLMException, LLMStatusCode
from aio_datadist.testing import link_to

pytestmark = pytest.mark.asyncio


async def test_a_transfer_our_own_unlink_cuts_reads_unlinked_and_the_link_is_not_broken() -> None:
    async with setup() as s:
        for _ in range(3):
            assert (await s.decoders[0].link_clusters([cluster_info(PROMPT_ID, port_of(s.prompt))]))[0] in (
                LLMStatusCode.LLM_SUCCESS, LLMStatusCode.LLM_ALREADY_LINK)
            gate = Gate()
            gate.open(0)
            task = s.pm.transfer_cache_async(s.blocks_src(), gate, [blocks_config()], SRC_BLOCKS, DST_BLOCKS)
            await task.layer(0)
            link = link_to(s.prompt, DECODER_ID)
            assert link is not None
            status = await s.prompt.unlink_clusters([cluster_info(DECODER_ID, ("127.0.0.1", 1))])
            assert status == (LLMStatusCode.LLM_SUCCESS, [LLMStatusCode.LLM_SUCCESS])
            gate.open(*range(1, LAYERS))
            with pytest.raises(LLMException) as info:
                async with asyncio.timeout(5):
                    await task
            assert info.value.status_code == LLMStatusCode.LLM_NOT_YET_LINK, info.value
            assert link.broken is None and link.closed, link.broken
            async with asyncio.timeout(5):  # the decoder forgets its end (it answered our UNLINK)
                while link_to(s.decoders[0], PROMPT_ID) is not None:
                    await asyncio.sleep(0.01)
