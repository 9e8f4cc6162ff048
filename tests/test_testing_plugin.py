"""The pytest plugin ``aio_datadist.testing``, used the way a user's test suite uses it.

Its fixtures come from the ``pytest11`` entry point (``pip install -e .``),
not from conftest.py: these tests only name them.
"""

from __future__ import annotations

import ast
import multiprocessing
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

import aio_datadist.testing
from aio_datadist import (
    CacheDesc,
    CacheKeyByIdAndIndex,
    DataType,
    LLMConfig,
    LLMDataDist,
    LLMException,
    LLMRole,
    LLMStatusCode,
    Placement,
)
from aio_datadist.testing import (
    DECODER_CLUSTER_ID,
    PROMPT_CLUSTER_ID,
    blocks_desc,
    loopback_options,
    open_pair,
    rows_desc,
    seeded_pattern,
)

S = LLMStatusCode


def test_the_plugin_is_registered_by_its_entry_point(pytestconfig):
    assert pytestconfig.pluginmanager.get_plugin("aio_datadist") is aio_datadist.testing


def test_importing_the_plugin_imports_nothing_heavy():
    """Module-level imports are the standard library and pytest only (torch and the library load on use)."""
    tree = ast.parse(Path(aio_datadist.testing.__file__).read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.If):  # `if TYPE_CHECKING:` imports nothing at run time
            continue
        if isinstance(node, ast.Try):
            node_list = node.body
        else:
            node_list = [node]
        for stmt in node_list:
            if isinstance(stmt, ast.Import):
                imported.update(alias.name.split(".")[0] for alias in stmt.names)
            elif isinstance(stmt, ast.ImportFrom) and stmt.module:
                imported.add(stmt.module.split(".")[0])
    third_party = imported - set(sys.stdlib_module_names) - {"__future__"}
    assert third_party == {"pytest", "pytest_asyncio"}


# -- the in-process pair -------------------------------------------------------------------


@pytest.mark.asyncio
async def test_datadist_pair_pulls_and_pushes(datadist_pair):
    pair = datadist_pair
    assert (pair.prompt.cluster_id, pair.decoder.cluster_id) == (PROMPT_CLUSTER_ID, DECODER_CLUSTER_ID)
    assert pair.prompt.role is LLMRole.PROMPT and pair.decoder.role is LLMRole.DECODER
    kv = pair.decoder.kv_cache_manager

    await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [0, 5, 6], [2, 3, 7])
    for got, want in zip(pair.decoder_blocks.tensors, pair.expected_blocks):
        assert torch.equal(got[[2, 3, 7]], want[[0, 5, 6]])
        assert not got[[0, 1, 4, 5, 6]].any()

    await kv.pull_cache(pair.row_key(1), pair.decoder_rows, 0)
    await kv.pull_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, pair.prompt_rows.cache_id, 0), pair.decoder_rows, 1)
    for got, want in zip(pair.decoder_rows.tensors, pair.expected_rows):
        assert torch.equal(got[0], want[1]) and torch.equal(got[1], want[0])
    with pytest.raises(LLMException) as info:  # a pull by key consumed it
        await kv.pull_cache(pair.row_key(1), pair.decoder_rows, 0)
    assert info.value.status_code == S.LLM_KV_CACHE_NOT_EXIST

    await pair.prompt.kv_cache_manager.push_blocks(pair.decoder_blocks_key, pair.prompt_blocks, [1], [0])
    assert all(torch.equal(got[0], want[1]) for got, want in zip(pair.decoder_blocks.tensors, pair.expected_blocks))
    await pair.decoder.check_link_status(PROMPT_CLUSTER_ID)
    await pair.prompt.check_link_status(DECODER_CLUSTER_ID)


@pytest.mark.asyncio
async def test_the_prompt_caches_hold_the_documented_pattern(datadist_pair):
    pair = datadist_pair
    assert pair.prompt_blocks.cache_desc == blocks_desc() == pair.decoder_blocks.cache_desc
    assert pair.prompt_rows.cache_desc == rows_desc() == pair.decoder_rows.cache_desc
    assert all(torch.equal(t, w) for t, w in zip(pair.prompt_blocks.tensors, seeded_pattern(blocks_desc(), pair.seed)))
    assert all(torch.equal(t, w) for t, w in zip(pair.prompt_rows.tensors, seeded_pattern(rows_desc(), pair.seed + 1)))
    assert not any(t.any() for t in pair.decoder_blocks.tensors + pair.decoder_rows.tensors)


@pytest.mark.asyncio
async def test_open_pair_takes_a_seed_and_options_and_finalizes():
    async with open_pair(seed=7, decoder_config={"sync_kv_timeout": 3000}, prompt_config={"data_channels": 1}) as pair:
        await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [3], [3])
        assert all(torch.equal(g[3], w[3]) for g, w in zip(pair.decoder_blocks.tensors,
                                                           seeded_pattern(blocks_desc(), 7)))
    assert not pair.prompt.kv_cache_manager.is_initialized()
    assert not pair.decoder.kv_cache_manager.is_initialized()


# -- the spawned prompt ----------------------------------------------------------------------


@pytest.mark.asyncio(loop_factories=["uvloop"])  # a spawn is slow; the asyncio loop runs in the suite below
async def test_datadist_process_pair_pulls_pushes_and_survives_a_crash(datadist_process_pair):
    pair = datadist_process_pair
    assert pair.prompt_pid in {p.pid for p in multiprocessing.active_children()}
    kv = pair.decoder.kv_cache_manager
    await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [7, 0], [0, 1])
    await kv.pull_cache(pair.row_key(0), pair.decoder_rows, 1)
    await kv.pull_cache(CacheKeyByIdAndIndex(PROMPT_CLUSTER_ID, pair.prompt_cache_ids["rows"], 1),
                        pair.decoder_rows, 0)
    await pair.prompt_push_blocks([2, 3], [5, 6])
    for got, want in zip(pair.decoder_blocks.tensors, pair.expected_blocks):
        assert torch.equal(got[[0, 1, 5, 6]], want[[7, 0, 2, 3]])
    for got, want in zip(pair.decoder_rows.tensors, pair.expected_rows):
        assert torch.equal(got[1], want[0]) and torch.equal(got[0], want[1])
    with pytest.raises(LLMException) as info:  # an error in the prompt process is raised here
        await pair.prompt_push_blocks([0], [99])
    assert info.value.status_code == S.LLM_PARAM_INVALID

    pair.kill_prompt()  # the fixture still ends cleanly (the leak check finds no child)
    start = time.monotonic()
    with pytest.raises(LLMException) as info:
        await kv.pull_blocks(pair.blocks_key, pair.decoder_blocks, [1], [1], timeout=5000)
    assert info.value.status_code == S.LLM_LINK_FAILED
    assert time.monotonic() - start < 2.0
    with pytest.raises(RuntimeError, match="prompt process"):
        await pair.prompt_push_blocks([0], [0])


def test_a_user_suite_in_strict_mode(tmp_path):
    """A project of its own (no conftest, default loop, strict mode) that uses both fixtures."""
    (tmp_path / "pytest.ini").write_text(textwrap.dedent("""\
        [pytest]
        asyncio_mode = strict
        asyncio_default_fixture_loop_scope = function
        """))
    (tmp_path / "test_user.py").write_text(textwrap.dedent("""\
        import pytest
        import torch


        @pytest.mark.asyncio
        async def test_pull(datadist_pair):
            pair = datadist_pair
            await pair.decoder.kv_cache_manager.pull_blocks(pair.blocks_key, pair.decoder_blocks, [4], [0])
            assert all(torch.equal(g[0], w[4]) for g, w in zip(pair.decoder_blocks.tensors, pair.expected_blocks))


        @pytest.mark.asyncio
        async def test_pull_from_a_process(datadist_process_pair):
            pair = datadist_process_pair
            await pair.decoder.kv_cache_manager.pull_cache(pair.row_key(0), pair.decoder_rows, 1)
            assert all(torch.equal(g[1], w[0]) for g, w in zip(pair.decoder_rows.tensors, pair.expected_rows))


        def test_untouched_by_the_plugin():
            pass
        """))
    # A user's own run: not a worker of whatever runs this suite (xdist's variables make other installed
    # plugins warn, and -W error turns that into an error that is not ours).
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-W", "error"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "3 passed" in run.stdout


# -- helpers ------------------------------------------------------------------------------------


def test_loopback_options():
    assert "llm.listenIpInfo" not in loopback_options()
    assert loopback_options(listen=True)["llm.listenIpInfo"] == "127.0.0.1:0"
    assert loopback_options(listen=26000)["llm.listenIpInfo"] == "127.0.0.1:26000"
    config = LLMConfig()
    config.device_id = 0
    config.sync_kv_timeout = 50
    config.data_channels = 1
    assert loopback_options(sync_kv_timeout=50, data_channels=1) == config.generate_options()
    assert loopback_options(device_id=3)["ge.exec.deviceId"] == "3"
    with pytest.raises(TypeError, match="sync_kv_timeuot"):
        loopback_options(sync_kv_timeuot=50)
    with pytest.raises(TypeError, match="generate_options"):
        loopback_options(generate_options=None)
    for listen in (-1, 65536, "127.0.0.1:0", None):
        with pytest.raises(TypeError, match="listen"):
            loopback_options(listen=listen)
    with pytest.raises(LLMException) as info:
        loopback_options(sync_kv_timeout=0)
    assert info.value.status_code == S.LLM_PARAM_INVALID


@pytest.mark.asyncio
async def test_loopback_options_make_endpoints():
    async with LLMDataDist(LLMRole.PROMPT, 11) as dd:
        await dd.init(loopback_options(listen=True, sync_kv_timeout=5000))
        assert dd.listen_address is not None and dd.listen_address[0] == "127.0.0.1" and dd.listen_address[1] > 0


def test_seeded_pattern_is_exact_and_reproducible():
    for dtype in (DataType.DT_FLOAT16, DataType.DT_BF16, DataType.DT_FLOAT, DataType.DT_INT8, DataType.DT_UINT8):
        desc = CacheDesc(3, (4, 5), dtype, Placement.HOST)
        first, again = seeded_pattern(desc, 9), seeded_pattern(desc, 9)
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        assert [t.dtype for t in first] == [dtype.torch_dtype] * 3
        ints = [t.to(torch.int64) for t in first]
        assert all(bool(((0 <= t) & (t < 128)).all()) for t in ints)
        assert all(torch.equal(t.to(torch.float64), i.to(torch.float64)) for t, i in zip(first, ints))
        assert not torch.equal(first[0], first[1])
    desc = CacheDesc(1, (64,), DataType.DT_FLOAT16, Placement.HOST)
    assert not torch.equal(seeded_pattern(desc, 1)[0], seeded_pattern(desc, 2)[0])
    gen = torch.Generator().manual_seed(9 * 1000 + 2)  # the documented formula
    assert torch.equal(seeded_pattern(CacheDesc(3, (4, 5), DataType.DT_INT8, Placement.HOST), 9)[2],
                       torch.randint(0, 128, (4, 5), generator=gen, dtype=torch.int16).to(torch.int8))


def test_fixture_names_do_not_collide_with_the_suite():
    conftest = Path(__file__).with_name("conftest.py").read_text() + Path(__file__).with_name("peers.py").read_text()
    for name in ("datadist_pair", "datadist_process_pair"):
        assert name not in conftest


def test_loading_the_plugin_imports_neither_torch_nor_the_library():
    """pytest loads the plugin in every run of an environment that has the package: it must be cheap."""
    code = ("import sys, aio_datadist.testing; "
            "print(sorted(m for m in ('torch', 'aio_datadist.datadist', 'aio_datadist._core') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
