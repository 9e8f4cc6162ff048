"""How much memory this process may still populate before the kernel's OOM killer runs (best effort).

A host cache is a memfd populated at allocation (``devices/host.py``): populating more than there is gets
the process killed, not an error. What there is: the host's ``MemAvailable`` (free memory and the page cache
the kernel can drop), and, in a memory cgroup (a container, a Kubernetes pod, a systemd slice), the least
room left under its limit and its ancestors' (the limit, less the usage, plus the reclaimable page cache the
cgroup holds). cgroup v2 (``memory.max``, ``memory.current``, ``memory.stat``'s ``inactive_file``) and v1
(``memory.limit_in_bytes``, ``memory.usage_in_bytes``, ``memory.stat``'s ``total_inactive_file``), as
``/proc/self/cgroup`` names them under ``/sys/fs/cgroup``. Anything unreadable counts as no limit.
"""

from __future__ import annotations

import os

__all__ = ["memory_headroom"]

#: Where the cgroup hierarchies are mounted, and where this process's membership is listed (tests point them
#: at a tree of their own).
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
MEMINFO = "/proc/meminfo"
#: v1 reports "no limit" as a huge number (a page-rounded 2**63 - 1).
_NO_LIMIT = 2**62


def memory_headroom() -> tuple[int, str]:
    """The bytes this process may still populate, and what bounds them (for a message)."""
    room, what = _available(), "of memory available"
    for limit_room, cgroup in _cgroup_rooms():
        if limit_room < room:
            room, what = limit_room, f"left under the memory limit of cgroup {cgroup}"
    return max(room, 0), what


def _available() -> int:
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def _cgroup_rooms() -> list[tuple[int, str]]:
    """``(room, cgroup path)`` for every memory cgroup from this process's up to the root that has a limit."""
    try:
        with open(PROC_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    rooms: list[tuple[int, str]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":  # v2: one unified hierarchy
            rooms += _walk(os.path.join(CGROUP_ROOT, "unified") if _is_hybrid() else CGROUP_ROOT, path,
                           "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):
            rooms += _walk(os.path.join(CGROUP_ROOT, "memory"), path, "memory.limit_in_bytes",
                           "memory.usage_in_bytes", "total_inactive_file")
    return rooms


def _is_hybrid() -> bool:
    """v1 controllers with the v2 hierarchy beside them (``/sys/fs/cgroup/unified``)."""
    return os.path.isdir(os.path.join(CGROUP_ROOT, "unified"))


def _walk(mount: str, path: str, limit_file: str, usage_file: str, reclaimable: str) -> list[tuple[int, str]]:
    if ".." in path.split("/"):
        return []  # outside this cgroup namespace's root: its limits cannot be seen from here
    rooms = []
    parts = [p for p in path.split("/") if p]
    for depth in range(len(parts), -1, -1):
        here = os.path.join(mount, *parts[:depth])
        limit = _read_int(os.path.join(here, limit_file))
        if limit is None or limit >= _NO_LIMIT:
            continue
        usage = _read_int(os.path.join(here, usage_file))
        if usage is None:
            continue
        rooms.append((limit - usage + _stat(os.path.join(here, "memory.stat"), reclaimable),
                      "/" + "/".join(parts[:depth])))
    return rooms


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text == "max":
        return None
    try:
        return int(text)
    except ValueError:
        return None


def _stat(path: str, key: str) -> int:
    try:
        with open(path) as f:
            for line in f:
                name, _, value = line.partition(" ")
                if name == key:
                    return int(value)
    except (OSError, ValueError):
        pass
    return 0
