"""aio_datadist's KV connector inside real vLLM engines (marked ``vllm``; run by tools/check_vllm.sh).

One vLLM alone gives the reference tokens; then a prefill and a decode vLLM
with ``AioDatadistConnector`` serve the same prompts through the example's
proxy. The decode's data channels to the prefill go through a relay in this
process (``advertise_data``), which the abort and kill tests slow down so a
pull is still moving when they strike.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm is not installed here (tools/check_vllm.sh builds an environment with it)")

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import vllm_disaggregated as vd
from peers import free_port
from relay import Relay

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

MAX_TOKENS = 12
SECRET = "check-vllm-side-channel-secret"  # the authenticated path: side channel and KV links


@pytest.fixture(autouse=True)
def no_leaks():
    """The engines live across this module's tests (module fixtures); the default leak check does not apply."""
    yield


class SlowRelay(Relay):
    """Forwards a link's bytes; while ``rate`` is set, the prefill-to-decode direction is paced to it."""

    rate: float | None = None

    async def downstream(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(16384):
            if self.rate:
                await asyncio.sleep(len(data) / self.rate)
            writer.write(data)
            await writer.drain()
        writer.close()


class RelayThread:
    def __init__(self, target: tuple[str, int]) -> None:
        self.loop = asyncio.new_event_loop()
        self.relay = SlowRelay(target)
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.relay.__aenter__(), self.loop).result(10)

    def close(self) -> None:
        asyncio.run_coroutine_threadsafe(self.relay.__aexit__(None, None, None), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    work = tmp_path_factory.mktemp("vllm")
    model = vd.make_model(str(work / "model"))
    batch = {f"ref-{i}": p for i, p in enumerate(vd.prompts(5, seed=1, lengths=(129, 900)))}
    batch["ref-long"] = vd.prompts(1, seed=2, lengths=(1500, 1501))[0]
    single = vd.Node("single", model)
    try:
        reference = vd.alone(single, batch, MAX_TOKENS)
    finally:
        single.close()
    data_port = free_port("127.0.0.1")  # handed to the prefill before it listens
    relay = RelayThread(("127.0.0.1", data_port))
    stats = str(work / "stats.jsonl")
    host, rport = relay.relay.address
    prefill = vd.Node("prefill", model, vd.connector_config("kv_producer", {
        "stats_path": stats, "data_port": data_port, "advertise_data": f"{host}:{rport}", "lease_s": 60,
        "shared_secret": SECRET}))
    nodes = [prefill]
    try:
        decode = vd.Node("decode", model, vd.connector_config("kv_consumer", {
            "stats_path": stats, "shared_secret": SECRET, "pull_timeout_ms": 20_000}))
        nodes.append(decode)
        yield {"model": model, "batch": batch, "reference": reference, "prefill": prefill, "decode": decode,
               "relay": relay.relay, "stats": stats, "nodes": nodes}
    finally:
        for node in nodes:
            node.close()
        relay.close()


def _events(stats: str, kind: str) -> list[dict]:
    return [e for e in vd.read_stats(stats) if e["event"] == kind]


def _released(stats: str, req: str, timeout_s: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for event in _events(stats, "release"):
            if event["req"] == req:
                return event
        time.sleep(0.1)
    raise AssertionError(f"the prefill never released {req}")


def test_tokens_equal_one_instance_for_several_prompts_and_lengths(cluster) -> None:
    out = vd.disaggregate(cluster["prefill"], cluster["decode"], cluster["batch"], MAX_TOKENS)
    for req, ref in cluster["reference"].items():
        assert out[req]["tokens"] == ref["tokens"], req
        assert len(ref["tokens"]) == MAX_TOKENS
    pulls = {e["req"]: e for e in _events(cluster["stats"], "pull")}
    for req, prompt in cluster["batch"].items():
        assert pulls[req]["ok"] and pulls[req]["blocks"] == -(-len(prompt) // vd.BLOCK_TOKENS), req
        assert pulls[req]["authenticated"], req  # the decode ran with SECRET: handshake and aio.SharedSecret
        assert _released(cluster["stats"], req)["why"] == "done"
    assert len({tuple(r["tokens"]) for r in cluster["reference"].values()}) > 1  # prompts give different outputs


def _slow_pull_started(cluster, req: str, prompt: list[int]) -> None:
    cluster["relay"].rate = 256 * 1024  # bytes/s: the long prompt's ~3 MiB take seconds
    cluster["prefill"].generate(req, prompt, 1, {"do_remote_decode": True})
    params = cluster["prefill"].wait({req})[req]["kv_transfer_params"]
    cluster["decode"].generate(req, prompt, MAX_TOKENS, params)
    time.sleep(1.0)  # the pull is on its way through the slowed relay
    assert not any(e["req"] == req for e in _events(cluster["stats"], "pull")), "the pull ended too soon"


def test_a_request_aborted_mid_transfer_frees_its_blocks_and_nothing_lands_late(cluster) -> None:
    prompt = cluster["batch"]["ref-long"]
    _slow_pull_started(cluster, "abort-1", prompt)
    cluster["decode"].send(op="abort", id="abort-1")
    pull = None
    deadline = time.monotonic() + 15
    while pull is None and time.monotonic() < deadline:
        pull = next((e for e in _events(cluster["stats"], "pull") if e["req"] == "abort-1"), None)
        time.sleep(0.05)
    assert pull is not None and not pull["ok"] and pull["error"] == "aborted"
    assert _released(cluster["stats"], "abort-1")["why"] == "done"  # the prefill freed its blocks at once
    cluster["relay"].rate = None
    # the freed decode blocks are reused at once; a late byte of the aborted pull would change these tokens
    again = {f"after-abort-{r}": p for r, p in cluster["batch"].items()}
    out = vd.disaggregate(cluster["prefill"], cluster["decode"], again, MAX_TOKENS)
    for req in cluster["batch"]:
        assert out[f"after-abort-{req}"]["tokens"] == cluster["reference"][req]["tokens"], req


def test_a_decode_killed_while_pulling_lets_the_prefill_free_its_blocks(cluster) -> None:
    prompt = cluster["batch"]["ref-long"]
    _slow_pull_started(cluster, "kill-1", prompt)
    decode = cluster["decode"]
    for child in decode.descendants():
        os.kill(child, signal.SIGKILL)
    decode.process.kill()
    started = time.monotonic()
    event = _released(cluster["stats"], "kill-1", timeout_s=20)
    assert event["why"] == "closed" and time.monotonic() - started < 20  # well before the 60 s lease
    cluster["relay"].rate = None
    # the prefill serves on: a new request is prefilled and held as before
    cluster["prefill"].generate("after-kill", prompt, 1, {"do_remote_decode": True})
    params = cluster["prefill"].wait({"after-kill"})["after-kill"]["kv_transfer_params"]
    assert params["remote_block_ids"]

