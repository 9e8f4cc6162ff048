"""Text that reaches the vLLM connector's decode from outside (a side-channel peer's ``error``, the request id in a
request's ``kv_transfer_params``) is shown escaped in its exceptions and log lines: no forged log line, no terminal
escape (docs/security.md, row 182). Agents on real loopback sockets; no vLLM needed."""

from __future__ import annotations

import contextlib
import json
import logging
import socket
import threading
from collections.abc import Iterator

import _vllm_agents
import pytest
from _vllm_agents import BLOCK_TOKENS, wait

from aio_datadist.integrations.vllm_wire import HEADER, encode_frame, parse_transfer_params, transfer_params

agents = _vllm_agents.agents  # the fixture

FORGED = "nope\n2026-12-07 23:59:59 CRITICAL aio_datadist: FORGED LINE \x1b[2J\x1b[31m"


@contextlib.contextmanager
def _refusing_peer(closing: bool) -> Iterator[tuple[str, int]]:
    """A process at a side-channel address that answers every frame ``ok: false`` with ``FORGED`` for its
    ``error`` (``closing``: as a prefill closing the side channel, id 0)."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(10)
    stop = threading.Event()

    def serve() -> None:
        with contextlib.suppress(OSError):
            conn, _ = server.accept()
            with conn:
                conn.settimeout(10)
                while not stop.is_set():
                    head = conn.recv(HEADER.size, socket.MSG_WAITALL)
                    if len(head) < HEADER.size:
                        return
                    body = conn.recv(HEADER.unpack(head)[0], socket.MSG_WAITALL)
                    rid = 0 if closing else json.loads(body)["id"]
                    conn.sendall(encode_frame({"id": rid, "ok": False, "error": FORGED}))

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield server.getsockname()
    finally:
        stop.set()
        server.close()
        thread.join(15)


def _raw(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "\n" in r.getMessage() or "\x1b" in r.getMessage()]


@pytest.mark.parametrize("closing", [False, True], ids=["refused", "closed"])
def test_a_side_channel_peers_error_text_reaches_the_decodes_log_escaped(agents, caplog, closing) -> None:
    """The process at a request's side-channel address refuses the decode's ``hello`` (or closes the side channel,
    id 0) with an error holding a newline and terminal escapes: the pull fails and the decode's warning shows
    them escaped. Before, the text went into the warning raw: a forged log line (found by a hunt, 2026-12-07)."""
    decode, _ = agents(False, link_timeout_ms=1000)
    with caplog.at_level(logging.DEBUG), _refusing_peer(closing) as (host, port):
        remote = parse_transfer_params(transfer_params(engine_id="engine-p", request_id="r1", host=host, port=port,
                                                       block_ids=[1], num_tokens=BLOCK_TOKENS))
        decode.start_pull("d1", remote, [2])
        wait(lambda: not decode.pulls.pending(), 5)
    assert decode.pulls.take_finished() == ({"d1"}, {"d1"}, {2})
    failed = [r.getMessage() for r in caplog.records if "pull from" in r.getMessage()]
    assert failed and all("FORGED LINE" in m and "\\n" in m and "\\x1b" in m for m in failed), failed
    assert not _raw(caplog), _raw(caplog)


def test_a_request_id_in_kv_transfer_params_reaches_the_decodes_log_escaped(agents, caplog) -> None:
    """``kv_transfer_params`` are request data: their ``remote_request_id`` holds a newline and a terminal escape.
    The prefill refuses the claim naming the id, and the decode's warning shows it escaped. Before, it came back
    raw in the prefill's refusal and went raw into the decode's log (found by a hunt, 2026-12-07)."""
    prefill, _ = agents(True, shared_secret="s3cret", claim_wait_s=0.0, link_timeout_ms=3000)
    decode, _ = agents(False, shared_secret="s3cret", claim_wait_s=0.0, link_timeout_ms=3000)
    host, port = prefill.side_channel
    with caplog.at_level(logging.DEBUG):
        remote = parse_transfer_params(transfer_params(
            engine_id="engine-p", request_id="r9\n2026-12-07 23:59:59 CRITICAL vllm: FORGED \x1b[2J", host=host,
            port=port, block_ids=[1], num_tokens=BLOCK_TOKENS))
        decode.start_pull("d1", remote, [2])
        wait(lambda: not decode.pulls.pending(), 10)
    assert decode.pulls.take_finished() == ({"d1"}, {"d1"}, {2})
    assert any("FORGED" in r.getMessage() for r in caplog.records)
    assert not _raw(caplog), _raw(caplog)


def test_a_remote_host_in_kv_transfer_params_reaches_the_decodes_log_escaped(agents, caplog) -> None:
    """``remote_host`` of ``kv_transfer_params`` is request data too: a host holding a newline and a terminal escape
    is shown escaped in the decode's pull-failure warning (found by review, 2026-12-07: it went in raw)."""
    decode, _ = agents(False, link_timeout_ms=1000)
    with caplog.at_level(logging.DEBUG):
        remote = parse_transfer_params(transfer_params(engine_id="engine-p", request_id="r1",
                                                       host="127.0.0.1" + FORGED[4:], port=9, block_ids=[1],
                                                       num_tokens=BLOCK_TOKENS))
        decode.start_pull("d1", remote, [2])
        wait(lambda: not decode.pulls.pending(), 10)
    assert any("FORGED" in r.getMessage() for r in caplog.records)
    assert not _raw(caplog), _raw(caplog)


def test_a_field_name_in_a_decodes_frame_reaches_the_prefills_log_escaped(agents, caplog) -> None:
    """A side-channel peer (without a secret: any process) sends a frame with an unknown field whose name holds a
    newline and a terminal escape: the prefill drops the connection and its warning shows the name escaped
    (found by review, 2026-12-07: it went in raw)."""
    prefill, _ = agents(True, link_timeout_ms=2000)
    body = json.dumps({"id": 1, "op": "hello", "x" + FORGED[4:]: 1}).encode()
    with caplog.at_level(logging.DEBUG):
        with socket.create_connection(prefill.side_channel, timeout=5) as conn:
            conn.sendall(HEADER.pack(len(body)) + body)
            with contextlib.suppress(OSError):
                conn.recv(4096)
        wait(lambda: any("FORGED" in r.getMessage() for r in caplog.records), 5)
    assert not _raw(caplog), _raw(caplog)


def test_a_flood_of_bad_frames_writes_one_warning_of_bounded_size(agents, caplog) -> None:
    """Any process (no secret set) sends bad frames, one per connection, 40 times, one with a 60 KB field name:
    the prefill writes one WARNING with the count (and DEBUG for the rest), its text cut. Before, every bad frame
    wrote a WARNING (6,300 a second from one attacker) and a long field name went in whole (126 KB lines; found by
    a hunt, 2026-12-07)."""
    prefill, _ = agents(True, link_timeout_ms=2000)
    bodies = [json.dumps({"id": 1, "op": "hello", "x" * 60_000 if i == 0 else f"x{i}": 1}).encode()
              for i in range(40)]
    with caplog.at_level(logging.DEBUG):
        for body in bodies:
            with socket.create_connection(prefill.side_channel, timeout=5) as conn:
                conn.sendall(HEADER.pack(len(body)) + body)
                with contextlib.suppress(OSError):
                    conn.recv(4096)
        wait(lambda: sum("side channel from" in r.getMessage() for r in caplog.records) >= 40, 10)
    said = [r for r in caplog.records if "side channel from" in r.getMessage()]
    warned = [r for r in said if r.levelno >= logging.WARNING]
    assert len(warned) <= 1 and len(said) == 40, [r.getMessage()[:120] for r in warned]
    assert max(len(r.getMessage()) for r in said) < 1000
