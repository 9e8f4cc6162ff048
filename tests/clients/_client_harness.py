"""What every client port in this directory shares: two spawned processes on loopback.

A port keeps its client's llm_datadist calls as they are and replaces the
serving framework around them with what is here:

- :func:`run_pair` starts the prefill and the decode side in two processes of
  the ``spawn`` context, hands each a :class:`Peer` and collects what each
  recorded. It always ends: a side that fails aborts the barrier, so the other
  side's next wait fails at once; past ``limit_s`` both are killed.
- :class:`Peer` stands in for the clients' side channels: ``barrier()`` for
  ``torch.distributed.barrier()`` / sleeps that wait for the peer, ``send`` /
  ``recv`` for ZMQ sockets, ``check`` records what was verified.
- :func:`pattern`, :func:`aligned`, :func:`tensors_at` stand in for NPU
  tensors (``torch.ones(...).npu()``, ``torchair.llm_datadist.create_npu_tensors``).
- :func:`extra_options` is the one place a run adds option keys (for example
  ``aio.Transport``) to a port's ``init`` options.

A failure is reported, not raised: the side's entry says the exception, its
status code and ``stopped_at``, the line of the port where it was raised.

Run one port by hand with ``PYTHONPATH=. python tests/clients/client_x.py``
from the repository root; a test imports it (this directory on ``sys.path``)
and asserts on ``run(tmp_path)``. The ports are not named ``test_*`` so that
pytest does not collect them before the v2 API exists.
"""

from __future__ import annotations

import ctypes
import faulthandler
import math
import multiprocessing as mp
import os
import random
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

CTX = mp.get_context("spawn")
LOCALHOST = "127.0.0.1"
OTHER_LOCALHOST = "127.0.0.2"  # also loopback on Linux: a second "device ip" on this host

_EXTRA_OPTIONS: dict[str, Any] = {}


class PeerFailed(RuntimeError):
    """The other side failed (its barrier was aborted or its pipe closed)."""


class Peer:
    """One side's view of the run: barrier, side channel and recorded checks.

    The barrier runs over its own pipe (a ``multiprocessing.Barrier`` would leave
    a shared-memory arena open in the parent): each ``barrier()`` sends a token
    and waits for the other side's; a failing side sends ``abort``.
    """

    def __init__(self, name: str, side: Any, bar: Any, limit_s: float) -> None:
        self.name = name
        self.result: dict[str, Any] = {"checks": {}}
        self._side = side
        self._bar = bar
        self._limit_s = limit_s
        self._send_lock = threading.Lock()
        self._bar_lock = threading.Lock()
        self._tokens = 0  # barrier tokens received ahead of our own barrier() calls
        self._aborted = False

    def _take(self, timeout_s: float) -> bool:
        """Read one barrier message if any arrives in time; False on timeout."""
        if not self._bar.poll(timeout_s):
            return False
        try:
            msg = self._bar.recv()
        except (EOFError, OSError):
            self._aborted = True
            return True
        if msg == "abort":
            self._aborted = True
        else:
            self._tokens += 1
        return True

    def barrier(self) -> None:
        """Wait until the other side reaches its matching barrier."""
        with self._bar_lock:
            self._bar.send("token")
            deadline = time.monotonic() + self._limit_s
            while not self._tokens and not self._aborted:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._aborted = True
                    break
                self._take(min(0.2, remaining))  # short slices: a thread of ours may abort meanwhile
            if self._tokens:
                self._tokens -= 1
                return
        raise PeerFailed("the other side failed or timed out (barrier broken)")

    def send(self, obj: Any) -> None:
        with self._send_lock:
            self._side.send(obj)

    def recv(self, timeout_s: float | None = None) -> Any:
        if not self._side.poll(self._limit_s if timeout_s is None else timeout_s):
            raise TimeoutError(f"{self.name}: nothing from the other side")
        try:
            return self._side.recv()
        except EOFError:
            raise PeerFailed("the other side closed its channel") from None

    def poll(self, timeout_s: float) -> bool:
        return self._side.poll(timeout_s)

    def check(self, name: str, ok: bool) -> bool:
        """Record one verification (``bytes equal`` etc.)."""
        self.result["checks"][name] = bool(ok)
        return bool(ok)

    def note(self, name: str, value: Any) -> None:
        self.result[name] = value

    def abort(self) -> None:
        """Tell the other side this one failed; this side's own waits end too."""
        self._aborted = True
        try:
            self._bar.send("abort")
        except OSError:
            pass

    def other_failed(self) -> bool:
        """True once the other side failed (for waits that are not barriers)."""
        with self._bar_lock:
            while not self._aborted and self._take(0):
                pass
            return self._aborted


def extra_options() -> dict[str, Any]:
    """Option keys the run adds to the port's ``init`` options (empty by default)."""
    return dict(_EXTRA_OPTIONS)


def _stopped_at(exc: BaseException) -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    where = ""
    for frame, lineno in traceback.walk_tb(exc.__traceback__):
        path = os.path.abspath(frame.f_code.co_filename)
        if os.path.dirname(path) == here and not path.endswith("_client_harness.py"):
            where = f"{os.path.basename(path)}:{lineno} in {frame.f_code.co_name}"
    return where


def _child(name: str, fn: Callable[..., None], args: tuple, side: Any, bar: Any, out: Any,
           options: dict[str, Any], limit_s: float) -> None:
    faulthandler.dump_traceback_later(limit_s + 1, exit=False)  # where it hangs, if it does
    _EXTRA_OPTIONS.update(options)
    peer = Peer(name, side, bar, limit_s)

    def thread_failed(args: threading.ExceptHookArgs) -> None:
        # a client's own threads (listeners, executors) die quietly; keep what killed them
        peer.result.setdefault("thread_errors", []).append(
            f"{args.thread.name if args.thread else '?'}: {args.exc_type.__name__}: {args.exc_value} "
            f"at {_stopped_at(args.exc_value) if args.exc_value else ''}")
        peer.abort()

    threading.excepthook = thread_failed
    try:
        fn(peer, *args)
        peer.result["ok"] = True
    except BaseException as exc:
        peer.abort()
        peer.result.update({
            "ok": False,
            "error": f"{type(exc).__name__}: {exc}",
            "status_code": _code(exc),
            "stopped_at": _stopped_at(exc),
            "peer_failed": isinstance(exc, PeerFailed),
            "traceback": traceback.format_exc(limit=-8),
        })
    finally:
        faulthandler.cancel_dump_traceback_later()
    out.send(peer.result)
    out.close()


def _code(exc: BaseException) -> Any:
    code = getattr(exc, "status_code", None)
    if code is None:
        return None
    try:
        return f"{getattr(code, 'name', code)} ({int(code)})"
    except (TypeError, ValueError):
        return repr(code)


def run_pair(prefill: Callable[..., None], decode: Callable[..., None], *, prefill_args: tuple = (),
             decode_args: tuple = (), options: dict[str, Any] | None = None, limit_s: float = 60.0,
             ctx: Any = None) -> dict:
    """Run ``prefill(peer, *prefill_args)`` and ``decode(peer, *decode_args)`` in two processes.

    :param ctx: the multiprocessing context to start them from (default ``spawn``;
        a ``forkserver`` with torch preloaded starts them in milliseconds).
    :returns: ``{"ok", "checks", "first_failure", "prefill": {...}, "decode": {...}, "exitcodes"}``;
        ``checks`` holds both sides' checks (prefixed by side), ``first_failure``
        the failing side's error and ``stopped_at`` (the side that failed for its
        own reason, not because its peer did), or None.
    """
    ctx = ctx or CTX
    side_p, side_d = ctx.Pipe()
    bar_p, bar_d = ctx.Pipe()
    out_p_r, out_p_w = ctx.Pipe(duplex=False)
    out_d_r, out_d_w = ctx.Pipe(duplex=False)
    opts = dict(options or {})
    procs = [
        ctx.Process(target=_child, name="client-prefill",
                    args=("prefill", prefill, prefill_args, side_p, bar_p, out_p_w, opts, limit_s)),
        ctx.Process(target=_child, name="client-decode",
                    args=("decode", decode, decode_args, side_d, bar_d, out_d_w, opts, limit_s)),
    ]
    results: dict[str, dict] = {}
    try:
        for proc in procs:
            proc.start()
        for conn in (side_p, side_d, bar_p, bar_d, out_p_w, out_d_w):
            conn.close()
        deadline = time.monotonic() + limit_s + 5
        for name, conn in (("prefill", out_p_r), ("decode", out_d_r)):
            remaining = max(0.0, deadline - time.monotonic())
            try:
                got = conn.poll(remaining)
                results[name] = conn.recv() if got else {"ok": False, "error": f"no result within {limit_s} s"}
            except EOFError:
                results[name] = {"ok": False, "error": "the process died without a result"}
        for proc in procs:
            proc.join(max(1.0, deadline - time.monotonic()))
    finally:
        for proc in procs:
            if proc.pid is not None and proc.is_alive():
                proc.kill()
            if proc.pid is not None:
                proc.join(10)
        for conn in (side_p, side_d, bar_p, bar_d, out_p_r, out_p_w, out_d_r, out_d_w):
            conn.close()
    return _summary(results, [p.exitcode for p in procs])


def _summary(results: dict[str, dict], exitcodes: list) -> dict:
    checks = {f"{side}.{k}": v for side in ("prefill", "decode")
              for k, v in results.get(side, {}).get("checks", {}).items()}
    failures = [(side, r) for side, r in results.items() if not r.get("ok") or r.get("thread_errors")]
    own = [f for f in failures if not f[1].get("peer_failed") or f[1].get("thread_errors")] or failures
    first = None
    if own:
        side, r = own[0]
        if r.get("thread_errors"):
            first = f"{side} (in a thread): {r['thread_errors'][0]}"
        else:
            first = f"{side}: {r.get('error')} [status {r.get('status_code')}] at {r.get('stopped_at')}"
    ok = not failures and all(checks.values()) and bool(checks)
    return {"ok": ok, "checks": checks, "first_failure": first, "exitcodes": exitcodes, **results}


def main(run: Callable[..., dict]) -> None:
    """``python tests/clients/client_x.py``: run once in a temporary directory and print the outcome."""
    import pprint
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        outcome = run(Path(tmp))
    pprint.pprint(outcome, width=120)
    sys.exit(0 if outcome.get("ok") else 1)


# -- NPU tensors -> CPU tensors ----------------------------------------------

def pattern(shape: Any, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Seeded contents that are exactly representable in ``dtype`` (fp16 included)."""
    n = math.prod(shape)
    values = (torch.arange(n, dtype=torch.int64) * 7 + seed * 131) % 1021 + 1
    return values.to(dtype).view(*shape)


def aligned(shape: Any, dtype: torch.dtype, alignment: int = 2 << 20) -> torch.Tensor:
    """A zeroed tensor whose address is a multiple of ``alignment`` (vllm-ascend asserts 2 MiB)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    raw = torch.zeros(nbytes + alignment, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % alignment
    return raw[offset:offset + nbytes].view(dtype).view(*shape)


def tensors_at(shape: Any, dtype: torch.dtype, addrs: list[int]) -> list[torch.Tensor]:
    """Tensors over memory at raw addresses (for ``torchair.llm_datadist.create_npu_tensors``)."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * itemsize
    out = []
    for addr in addrs:
        buf = (ctypes.c_char * nbytes).from_address(int(addr))
        out.append(torch.frombuffer(buf, dtype=dtype).view(*shape))
    return out


def free_port_pair() -> int:
    """A port ``p`` such that ``p`` and ``p + 1`` are free on both loopback addresses (see :func:`free_ports`):
    the ports a rank table's ranks 0 and 1 take with ``aio.LinkPort`` = ``p``, instead of the samples'
    26000/26001, which two runs of one sample on the two test workers would both listen on."""
    for _ in range(100):
        port = free_ports(1)[0]
        try:
            for address in (LOCALHOST, OTHER_LOCALHOST):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((address, port + 1))
        except OSError:
            continue
        return port
    raise RuntimeError("no two consecutive free loopback ports")


def free_ports(count: int) -> list[int]:
    """``count`` distinct loopback ports free right now on both loopback addresses (for the samples' fixed
    26000/26001), taken below the kernel's ephemeral range: a port ``bind(0)`` gave comes from that range, and
    an outgoing connection of the other test worker's could take it before the sample listened on it ("cannot
    listen on 127.0.0.2:...", seen in parallel runs)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        low = 32768
    chooser = random.SystemRandom()
    ports: list[int] = []
    for _ in range(1000):
        if len(ports) == count:
            return ports
        port = chooser.randrange(10000, max(10001, low))
        if port in ports or port in (26000, 26001):  # (the samples' own, which a real run may hold)
            continue
        try:
            for address in (LOCALHOST, OTHER_LOCALHOST):
                with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                    s.bind((address, port))
        except OSError:
            continue
        ports.append(port)
    raise RuntimeError(f"no {count} free loopback ports below {low}")
