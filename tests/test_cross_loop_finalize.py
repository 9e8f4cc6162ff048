"""``finalize`` from another event loop than the endpoint's (row 354): handed to the endpoint's loop when that runs
in a thread of its own, refused when it is stopped but not closed; never a hang."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap


XLOOP_CHILD = textwrap.dedent('''
    import asyncio, json, socket, sys, threading, time
    from aio_datadist import LLMDataDist, LLMException, LLMRole
    from aio_datadist.testing import loopback_options

    home = asyncio.new_event_loop()
    dd = LLMDataDist(LLMRole.PROMPT, 1)
    home.run_until_complete(dd.init(loopback_options(listen=True)))
    address = dd.listen_address
    if sys.argv[1] == "running":  # the loop it was initialised on runs on, in a thread of its own
        threading.Thread(target=home.run_forever, daemon=True).start()
    out = {}

    def finalize_here():
        started = time.monotonic()
        try:
            asyncio.run(asyncio.wait_for(dd.finalize(), 2))  # a finalize on this thread's loop, bounded
            out["finalize"] = "returned"
        except LLMException as exc:
            out["finalize"] = exc.status_code.name
        except BaseException as exc:
            out["finalize"] = type(exc).__name__
        out["seconds"] = round(time.monotonic() - started, 2)

    worker = threading.Thread(target=finalize_here, daemon=True)
    worker.start()
    worker.join(4)
    out["hung"] = worker.is_alive()
    if out.get("finalize") == "returned":
        try:
            socket.create_connection(address, timeout=1).close()
            out["still_listening"] = True
        except OSError:
            out["still_listening"] = False
    print(json.dumps(out), flush=True)
''')


def run_xloop(case: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", XLOOP_CHILD, case], capture_output=True, text=True, timeout=30)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_finalize_on_another_loop_while_the_home_loop_runs_returns_and_stops_listening() -> None:
    """``finalize`` is not one of the calls refused on another loop (its docstring, ``init``'s "a finalize on
    another event loop"): from a worker thread's loop, with the endpoint's own loop running in its thread, it
    must end within its caller's bound, the listener closed. Before, it waited for ever on the accept task of
    the home loop (cancelled from the wrong thread), and ``asyncio.wait_for`` could not cut it (found by a hunt,
    2026-12-07)."""
    out = run_xloop("running")
    assert not out["hung"], out
    assert out["finalize"] == "returned" and out["still_listening"] is False, out


def test_finalize_on_another_loop_while_the_home_loop_is_stopped_does_not_hang() -> None:
    """The home loop stopped but not closed (``run_until_complete`` returned): a finalize from another loop ends
    within its caller's bound, refused (``LLM_FAILED``: its tasks cannot end from another loop), never hangs
    (found by a hunt, 2026-12-07: it hung)."""
    out = run_xloop("stopped")
    assert not out["hung"] and out["finalize"] == "LLM_FAILED", out
