"""The vLLM connector's worker machinery when its own surroundings fail: a ``stats_path`` that cannot be written,
a cancel that comes as the awaited reply lands, options given as JSON null or as another JSON type than their
own (no vLLM needed: the agents of ``_vllm_agents``). Each test failed before its fix (docs/reliability.md rows
276-278, 330)."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from _vllm_agents import agents, wait  # noqa: F401 - agents is a fixture
from test_vllm_connector_logic import _released_soon, _remote

from aio_datadist import LLMException, LLMStatusCode
from aio_datadist.integrations.vllm_agent import AgentOptions, _Peer
from aio_datadist.integrations.vllm_wire import encode_frame


def test_a_decode_with_an_unwritable_stats_path_still_says_done(agents, tmp_path) -> None:  # noqa: F811
    prefill, _ = agents(True)
    decode, _ = agents(False, stats_path=str(tmp_path / "gone" / "stats.jsonl"))
    prefill.holds.add("r1", lease_s=60)
    decode.start_pull("d1", _remote(prefill, "r1", [5]), [2])
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d1"}, set(), set())
    assert decode._peers[prefill.side_channel].result().users == {}
    _released_soon(prefill, "r1")  # the done came: not held for the claim's 35 s


@pytest.mark.parametrize("bad", ["missing_directory", "nul_byte"])
def test_a_prefill_with_an_unwritable_stats_path_keeps_the_side_channel_on_done(agents, tmp_path, bad) -> None:  # noqa: F811
    """(A path with a NUL byte makes open() raise ValueError, not OSError: found by review.)"""
    path = tmp_path / "gone" / "stats.jsonl" if bad == "missing_directory" else f"{tmp_path}/stats\0.jsonl"
    prefill, _ = agents(True, stats_path=str(path), claim_wait_s=5.0)
    decode, _ = agents(False)
    decode.start_pull("d0", _remote(prefill, "r0", [3]), [1])  # vLLM names r0 late: its claim waits aside
    wait(lambda: "r0" in prefill._naming)
    prefill.holds.add("r1", lease_s=60)
    decode.start_pull("d1", _remote(prefill, "r1", [5]), [2])  # over the same side channel
    wait(lambda: "d1" not in decode.pulls.pending())
    _released_soon(prefill, "r1")  # its done came
    prefill.holds.add("r0", lease_s=60)
    wait(lambda: not decode.pulls.pending())
    assert decode.pulls.take_finished() == ({"d0", "d1"}, set(), set())  # d0's claim was not closed by d1's done


def test_a_prefill_with_an_unwritable_stats_path_keeps_expiring_leases(agents, tmp_path, caplog) -> None:  # noqa: F811
    prefill, _ = agents(True, stats_path=str(tmp_path / "gone" / "stats.jsonl"))
    for req in ("a", "b"):  # "b" is expired by a tick after the one whose line for "a" failed
        prefill.holds.add(req, lease_s=0.01)
        wait(lambda: req not in prefill.holds.held, 1.5)
    unwritten = [r for r in caplog.records if "stats_path" in r.getMessage()]
    assert len(unwritten) == 1 and unwritten[0].levelno == logging.WARNING  # once per STATS_LOG_EVERY_S


def test_a_claim_woken_as_its_connection_closes_is_not_granted_to_it(agents) -> None:  # noqa: F811
    prefill, _ = agents(True, claim_wait_s=5.0)
    with socket.create_connection(prefill.side_channel, timeout=5) as sock:
        sock.sendall(encode_frame({"id": 1, "op": "claim", "req": "rX"}))
        wait(lambda: "rX" in prefill._naming)  # the claim waits aside for vLLM to name rX

        def close_and_name() -> None:  # in one pass of the loop: the decode's connection drops as vLLM names rX
            (writer,) = prefill._conns
            writer.transport.abort()
            prefill.holds.add("rX", lease_s=60)

        prefill.loop.loop.call_soon_threadsafe(close_and_name)
        wait(lambda: not prefill._conns)
        prefill.loop.call(asyncio.sleep(0.05))  # the claim's task has run its last step
        assert prefill.holds.held["rX"].owner is None  # free for its decode, not held 35 s for a dead connection


class _Writer:
    def write(self, data: bytes) -> None:
        pass


@pytest.mark.asyncio
async def test_a_side_channel_request_cancelled_as_its_reply_lands_is_cancelled() -> None:
    peer = _Peer(asyncio.StreamReader(), _Writer())  # type: ignore[arg-type]
    request = asyncio.ensure_future(peer.request("claim", 5.0, req="r1"))
    await asyncio.sleep(0)  # the claim is sent: its reply is awaited
    ((_, reply),) = peer.replies.values()
    reply.set_result({"ok": True, "hold_ms": 35_000})
    request.cancel()  # vLLM aborts the pull in the same pass
    with pytest.raises(asyncio.CancelledError):
        await request
    assert not peer.replies


def test_a_text_option_given_as_null_is_unset(monkeypatch) -> None:
    monkeypatch.setenv("AIO_DATADIST_SECRET", "the-real-secret")
    assert AgentOptions.from_extra({"shared_secret": None}).shared_secret == "the-real-secret"
    monkeypatch.delenv("AIO_DATADIST_SECRET")
    assert AgentOptions.from_extra({"shared_secret": None, "transport": None}).shared_secret == ""
    assert AgentOptions.from_extra({"stats_path": None}).stats_path == ""
    with pytest.raises(LLMException, match="'pull_timeout_ms'"):  # a number has no such default to fall back on
        AgentOptions.from_extra({"pull_timeout_ms": None})


@pytest.mark.parametrize("name", ["side_channel_host", "data_host"])
def test_an_empty_host_is_refused_not_taken_for_every_interface(name) -> None:
    """``side_channel_host: ""`` (a templated config whose variable is unset) is refused naming the option. Before,
    asyncio took it for every interface: the prefill's side channel listened on 0.0.0.0 and :: (two ports) and
    told decodes 0.0.0.0; ``data_host: ""`` failed only at registration, naming ``listen_ip_info`` (found while
    mending a hunt's finding, 2026-12-07)."""
    from aio_datadist.integrations.vllm_agent import Agent

    with pytest.raises(LLMException, match=f"invalid argument '{name}': must name an address") as caught:
        AgentOptions.from_extra({name: ""})
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert getattr(AgentOptions.from_extra({name: "0.0.0.0"}), name) == "0.0.0.0"
    # options made in code too, before the agent starts anything (found by review: the agent listened everywhere)
    with pytest.raises(LLMException, match=f"invalid argument '{name}': must name an address"):
        Agent(True, False, "engine-p", AgentOptions(**{name: ""}))


@pytest.mark.parametrize("made", ["config", "code"])
def test_the_no_secret_warning_says_when_an_empty_config_value_overrides_the_environment(monkeypatch, caplog, made):
    """An empty ``shared_secret`` in the config means no secret even with ``$AIO_DATADIST_SECRET`` set (the config
    key wins, docs/vllm.md); the WARNING says so instead of "no shared_secret (nor $AIO_DATADIST_SECRET)"
    (found by a hunt, 2026-12-07)."""
    import logging

    import _vllm_agents

    from aio_datadist.integrations.vllm_agent import Agent, kv_layout

    monkeypatch.setenv("AIO_DATADIST_SECRET", "the-real-secret")
    options = AgentOptions.from_extra({"shared_secret": ""}) if made == "config" else AgentOptions()
    assert options.shared_secret == ""
    agent = Agent(True, False, "engine-p", options)
    try:
        with caplog.at_level(logging.WARNING):
            tensors, layout, _ = kv_layout(_vllm_agents.kv_caches(1), _vllm_agents.BLOCKS, _vllm_agents.BLOCK_TOKENS)
            agent.register(tensors, layout)
    finally:
        agent.close()
    said = [r.getMessage() for r in caplog.records if "unauthenticated" in r.getMessage()]
    why = ("shared_secret is empty in kv_connector_extra_config, which wins over $AIO_DATADIST_SECRET"
           if made == "config" else "no shared_secret in its AgentOptions")  # (code never reads the environment)
    assert said == [f"aio_datadist connector: {why}: the side channel and the KV links are unauthenticated; any "
                    "process that reaches them can claim, release or read held blocks"], said


@pytest.mark.parametrize("where", ["extra", "env", "options", "LLMConfig", "init"])
def test_a_secret_utf8_cannot_carry_is_refused_naming_where_it_came_from_never_itself(monkeypatch, where) -> None:
    """A secret holding a lone surrogate (a JSON ``"\\udcff"`` in ``kv_connector_extra_config``; bytes that are
    not UTF-8 in ``$AIO_DATADIST_SECRET``, which ``os.environ`` turns into surrogates; an ``AgentOptions`` made in
    code; ``LLMConfig.shared_secret``; ``aio.SharedSecret`` given to ``init``) is refused ``LLM_PARAM_INVALID``
    naming the argument, and no exception chained to the error carries the secret. Before, the connector's
    ``Agent`` raised a bare ``UnicodeEncodeError`` whose ``object`` was the whole secret, and ``check_secret``
    refused it from inside the ``except``, so its ``__context__`` kept that error (found by a hunt, 2026-12-07)."""
    import asyncio

    from aio_datadist import LLMConfig, LLMDataDist, LLMRole
    from aio_datadist.integrations.vllm_agent import Agent

    secret = "top-secret-\udcff-value"
    with pytest.raises(LLMException) as caught:
        if where == "extra":
            AgentOptions.from_extra({"shared_secret": secret})
        elif where == "env":
            monkeypatch.setenv("AIO_DATADIST_SECRET", secret)
            AgentOptions.from_extra({})
        elif where == "options":
            Agent(True, False, "engine-p", AgentOptions(shared_secret=secret))
        elif where == "LLMConfig":
            LLMConfig().shared_secret = secret
        else:
            async def init() -> None:
                async with LLMDataDist(LLMRole.PROMPT, 1) as dd:
                    await dd.init({"aio.SharedSecret": secret})
            asyncio.run(init())
    error = caught.value
    assert error.status_code == LLMStatusCode.LLM_PARAM_INVALID and "must be encodable as UTF-8" in str(error)
    assert ("$AIO_DATADIST_SECRET" if where == "env" else "shared_secret" if where != "init" else
            "aio.SharedSecret") in str(error), str(error)
    chained, seen = error, []
    while chained is not None:
        seen.append(chained)
        chained = chained.__context__ or chained.__cause__
    assert not any("top-secret" in repr(e) or "top-secret" in repr(getattr(e, "object", "")) for e in seen), seen


@pytest.mark.parametrize("name, value", [("shared_secret", True), ("shared_secret", 12345678),
                                         ("shared_secret", ["s3cret"]), ("shared_secret", {"file": "/run/kv"}),
                                         ("stats_path", False), ("side_channel_host", 10), ("transport", ["tcp"])])
def test_a_text_option_of_another_json_type_is_refused_naming_it(monkeypatch, name, value) -> None:
    """Before, a text option took ``str()`` of any JSON value: ``shared_secret: true`` (a YAML ``yes``, a
    templated boolean) was the secret "True", the environment's secret ignored without the no-secret warning;
    ``stats_path: false`` wrote ./False (found by audit). A secret of another type is named by its type only,
    and no exception chained to the error carries it: its first form raised the error while handling a
    ``ValueError(<the value>)``, its ``__context__``, which error reporters that walk the chain show (found by
    review)."""
    monkeypatch.setenv("AIO_DATADIST_SECRET", "the-real-secret")
    with pytest.raises(LLMException, match=f"invalid argument '{name}': must be a string, got ") as caught:
        AgentOptions.from_extra({name: value})
    assert caught.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert (caught.value.__context__, caught.value.__cause__) == (None, None), repr(caught.value.__context__)
    if name == "shared_secret":
        assert "s3cret" not in str(caught.value) and "12345678" not in str(caught.value), str(caught.value)
        json_type = {bool: "boolean", int: "number", list: "array", dict: "object"}[type(value)]
        assert f"must be a string, got a JSON {json_type} " in str(caught.value), str(caught.value)  # its type, named
    assert AgentOptions.from_extra({name: "10.0.0.5"}).shared_secret == (
        "10.0.0.5" if name == "shared_secret" else "the-real-secret")  # a string is taken as before
