"""The arguments of ``LLMDataDist.link``: the HCCL-style rank table, ``cluster_rank_info``, and the address rule.

LLM-DataDist's bilateral ``link(comm_name, cluster_rank_info, rank_table)``
builds an HCCL communication domain from a rank table. There is no HCCL here:
each rank of the table is mapped to the address of an LLMDataDist endpoint
instead, and the pair makes one of our links (``link_table.py``).

**What is read of the rank table.** The JSON object's ``server_list``; in each
server its ``device`` list; in each device ``rank_id`` (a decimal string or
an int) and ``device_ip`` (an IPv4 address string). Everything else (``server_count``,
``version``, ``status``, ``server_id``, ``host_ip``, ``device_id``,
``super_device_id``, ``super_pod_list``) may be there and is not read. Every
rank named by ``cluster_rank_info`` must appear in the table, once.

**The address rule.** Rank ``r`` with device ip ``D`` is the endpoint at
``D:(aio.LinkPort + r)`` (``aio.LinkPort`` defaults to 26000, so ranks 0 and
1 are ``:26000`` and ``:26001``, the ports of the HIXL samples).
``aio.RankAddresses``, a JSON object, overrides it per rank: a key is a rank
id (``"1"``) or a device ip (``"10.0.0.2"``), a value ``"ipv4:port"`` (an
IPv4 address, not a host name); a rank id key wins over a device ip key. A
rank with an override needs no ``device_ip`` in the table.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
from collections.abc import Mapping
from typing import Any

from ._checks import (
    UINT32_MAX,
    UINT64_MAX,
    check_json_object,
    check_str,
    param_invalid,
    param_type_error,
    param_value_error,
    shown,
)

__all__ = ["MAX_COMM_NAME", "MAX_NODES", "RankEntry", "check_cluster_rank_info",
           "check_comm_name", "parse_rank_table", "rank_address"]

#: ``comm_name`` must be shorter than this (as in LLM-DataDist).
MAX_COMM_NAME = 128
#: At most this many clusters in one ``cluster_rank_info`` (as in LLM-DataDist).
MAX_NODES = 4


@dataclasses.dataclass(frozen=True, slots=True)
class RankEntry:
    """One device of the rank table: its rank id and device ip (None when the entry has none)."""

    rank_id: int
    device_ip: str | None


def check_comm_name(comm_name: object) -> str:
    """``comm_name`` if it is a non-empty str shorter than :data:`MAX_COMM_NAME` characters.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``comm_name``.
    """
    name = check_str("comm_name", comm_name, allow_empty=False)
    if len(name) >= MAX_COMM_NAME:
        raise param_invalid("comm_name", f"must be shorter than {MAX_COMM_NAME} characters, got {len(name)}")
    return name


def check_cluster_rank_info(cluster_rank_info: object, own_cluster_id: int) -> dict[int, int]:
    """``cluster_rank_info`` as a dict of cluster id -> rank id, checked as LLM-DataDist checks it.

    2 to 4 entries, cluster ids uint64, rank ids uint32 in strictly
    ascending order, and this endpoint's own cluster id among the keys.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``cluster_rank_info``.
    """
    arg = "cluster_rank_info"
    if not isinstance(cluster_rank_info, Mapping):
        raise param_type_error(arg, f"expected a dict of cluster id to rank id, got {type(cluster_rank_info).__name__}")
    if not 2 <= len(cluster_rank_info) <= MAX_NODES:
        raise param_invalid(arg, f"needs 2 to {MAX_NODES} clusters, got {len(cluster_rank_info)}")
    info: dict[int, int] = {}
    for key, value in cluster_rank_info.items():
        if not _is_int(key) or not _is_int(value):  # TypeError and ValueError as LLM-DataDist's checks raise
            raise param_type_error(arg, f"cluster id {shown(key)} and rank id {shown(value)} must both be ints")
        if not 0 <= key <= UINT64_MAX:
            raise param_value_error(arg, f"cluster id {shown(key)} is not a uint64")
        if not 0 <= value <= UINT32_MAX:
            raise param_value_error(arg, f"rank id {shown(value)} of cluster {key} is not a uint32")
        info[int(key)] = int(value)
    ranks = list(info.values())
    if any(a >= b for a, b in itertools.pairwise(ranks)):
        raise param_invalid(arg, f"rank ids must be in strictly ascending order, got {ranks}")
    if own_cluster_id not in info:
        raise param_invalid(arg, f"does not name this endpoint's cluster id {own_cluster_id}")
    return info


def parse_rank_table(rank_table: object, ranks: Any) -> dict[int, RankEntry]:
    """The entries of ``rank_table`` (a JSON str) for the rank ids ``ranks``.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``rank_table`` for text
        that is not a JSON object, a ``server_list`` or ``device`` that is not
        a list of objects, a bad ``rank_id`` or ``device_ip``, a rank id twice
        (or any object naming one key twice),
        or a rank of ``ranks`` that the table lacks.
    """
    arg = "rank_table"
    table = check_json_object(arg, check_str(arg, rank_table), unique_keys=True)
    servers = table.get("server_list")
    if not isinstance(servers, list) or not servers:
        raise param_invalid(arg, "'server_list' must be a non-empty list of servers")
    entries: dict[int, RankEntry] = {}
    for s, server in enumerate(servers):
        where = f"server_list[{s}]"
        devices = server.get("device") if isinstance(server, dict) else None
        if not isinstance(devices, list):
            raise param_invalid(arg, f"{where}: expected an object with a 'device' list")
        for d, device in enumerate(devices):
            entry = _entry(arg, f"{where}.device[{d}]", device)
            if entry.rank_id in entries:
                raise param_invalid(arg, f"{where}.device[{d}]: rank_id {entry.rank_id} appears twice")
            entries[entry.rank_id] = entry
    missing = [rank for rank in ranks if rank not in entries]
    if missing:
        raise param_invalid(arg, f"has no device with rank_id {', '.join(map(str, missing))} "
                            "(named by cluster_rank_info)")
    return {rank: entries[rank] for rank in ranks}


def _entry(arg: str, where: str, device: object) -> RankEntry:
    if not isinstance(device, dict):
        raise param_invalid(arg, f"{where}: expected an object, got {type(device).__name__}")
    raw = device.get("rank_id")
    if isinstance(raw, str) and raw.isascii() and raw.isdigit():
        digits = raw.lstrip("0") or "0"
        if len(digits) > len(str(UINT32_MAX)):  # not a uint32 (and int() refuses over 4300 digits)
            raise param_invalid(arg, f"{where}: 'rank_id' of {len(digits)} digits is not a uint32")
        rank = int(digits)
    elif isinstance(raw, int) and not isinstance(raw, bool):
        rank = raw
    else:
        raise param_invalid(arg, f"{where}: 'rank_id' must be a decimal string or an int, got {raw!r}")
    if not 0 <= rank <= UINT32_MAX:
        raise param_invalid(arg, f"{where}: 'rank_id' {rank} is not a uint32")
    ip = device.get("device_ip")
    if ip is not None:
        if not isinstance(ip, str):  # ipaddress takes an int (or a bool) as an address
            raise param_invalid(arg, f"{where}: 'device_ip' must be an IPv4 address string, got {ip!r}")
        try:
            ipaddress.IPv4Address(ip)
        except ValueError:
            raise param_invalid(arg, f"{where}: 'device_ip' {ip!r} is not an IPv4 address") from None
    return RankEntry(rank, ip)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def rank_address(entry: RankEntry, link_port: int,
                 overrides: Mapping[str, tuple[str, int]]) -> tuple[str, int]:
    """The endpoint address of the rank ``entry`` (see the module docstring for the rule).

    :param link_port: ``aio.LinkPort``.
    :param overrides: ``aio.RankAddresses`` as parsed: key (rank id or
        device ip) -> ``(host, port)``.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``rank_table`` when the
        rank has no override and no ``device_ip``, or ``aio.LinkPort`` + rank
        is not a port.
    """
    by_rank = overrides.get(str(entry.rank_id))
    if by_rank is not None:
        return by_rank
    if entry.device_ip is None:
        raise param_invalid("rank_table", f"rank {entry.rank_id} has no 'device_ip' and aio.RankAddresses "
                            "does not name it")
    by_ip = overrides.get(entry.device_ip)
    if by_ip is not None:
        return by_ip
    port = link_port + entry.rank_id
    if port > 65535:
        raise param_invalid("rank_table", f"rank {entry.rank_id}: aio.LinkPort {link_port} + rank id is "
                            f"{port}, not a port; map the rank in aio.RankAddresses")
    return entry.device_ip, port
