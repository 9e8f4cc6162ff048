"""The real llm_datadist clients' flows, unchanged but for the import, over TCP and over same-host memory.

Each port in ``tests/clients/`` keeps its client's llm_datadist calls as the
upstream repository has them (the port's docstring names the repository,
path and commit) and replaces only the serving framework around them. Here
each runs in two spawned processes with ``aio.Transport`` forced to ``tcp``
and to ``local``, and must end with every check it records passing: the
bytes the flow moved were compared on the receiving side.
"""

from __future__ import annotations

import importlib
import multiprocessing
import multiprocessing.forkserver
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

CLIENTS = Path(__file__).resolve().parent / "clients"
#: The two processes of a run are forked from a server that imported torch and the library once
#: (a spawned process spends about 2 s importing them); each still runs the port's code from its start.
FORK = multiprocessing.get_context("forkserver")
TWO_PROCESS_PORTS = sorted(p.stem for p in CLIENTS.glob("client_*.py") if p.stem != "client_public_names")
#: Variants of one client's flow worth their run: vllm-ascend's MLA and sparse layouts, MindIE's flex role.
VARIANTS: list[tuple[str, dict[str, Any]]] = [
    ("client_vllm_ascend_cmgr", {"layout": "mla"}),
    ("client_vllm_ascend_cmgr", {"layout": "sparse", "same_server": False}),
    ("client_mindie", {"decode_role": "flex"}),
]


def _port(name: str) -> Any:
    if str(CLIENTS) not in sys.path:
        sys.path.insert(0, str(CLIENTS))
    return importlib.import_module(name)


@pytest.fixture(scope="module", autouse=True)
def fork_server() -> Iterator[None]:
    """Start the fork server before a test's leak check snapshots the fds, and run the ports from it."""
    harness = _port("_client_harness")
    FORK.set_forkserver_preload(["torch", "uvloop", "aio_datadist", "aio_datadist.compat", "_client_harness"])
    multiprocessing.forkserver.ensure_running()
    spawn, harness.CTX = harness.CTX, FORK
    yield
    harness.CTX = spawn


def _assert_ran(result: dict) -> None:
    assert result["ok"], {k: result.get(k) for k in ("first_failure", "prefill", "decode", "exitcodes")}
    assert result["checks"], "the flow recorded no check of the bytes it moved"
    failed = [name for name, ok in result["checks"].items() if not ok]
    assert not failed, failed


def link_port() -> dict[str, str]:
    """The rank-table ports of this run (``aio.LinkPort``): free ones, not the samples' 26000/26001, which the
    same sample run on the other test worker (its other transport) listened on at the same time."""
    return {"aio.LinkPort": str(_port("_client_harness").free_port_pair())}


def test_every_port_is_run_here():
    assert len(TWO_PROCESS_PORTS) == 14, TWO_PROCESS_PORTS


@pytest.mark.parametrize("transport", ["tcp", "local"])
@pytest.mark.parametrize("name", TWO_PROCESS_PORTS)
def test_a_real_client_flow_runs_unchanged(name: str, transport: str, tmp_path: Path) -> None:
    _assert_ran(_port(name).run(tmp_path, options={"aio.Transport": transport, **link_port()}))


@pytest.mark.parametrize(("name", "variant"), VARIANTS, ids=[f"{n[7:]}-{'-'.join(map(str, v.values()))}"
                                                          for n, v in VARIANTS])
def test_a_real_client_flow_variant_runs_unchanged(name: str, variant: dict, tmp_path: Path) -> None:
    _assert_ran(_port(name).run(tmp_path, options={"aio.Transport": "tcp", **link_port()}, **variant))


def test_every_name_the_clients_import_exists():
    result = _port("client_public_names").run()
    assert result["ok"] and not result["missing"], result

