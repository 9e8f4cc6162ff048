"""Facts about the machine a table was measured on: cpu, memory, versions, peak RSS."""

from __future__ import annotations

import contextlib
import datetime as _dt
import importlib.metadata
import os
import platform
import resource
import sys
import time
from dataclasses import dataclass
from typing import Any

from benchmarks._workload import KIB, format_bytes


def available_memory() -> int:
    """``MemAvailable`` from /proc/meminfo, in bytes (0 if unknown)."""
    return _meminfo().get("MemAvailable", 0)


def _meminfo() -> dict[str, int]:
    out: dict[str, int] = {}
    with contextlib.suppress(OSError):
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (KIB if parts[1:] == ["kB"] else 1)
    return out


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    return platform.processor() or "unknown cpu"


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


def machine_info_dict() -> dict[str, Any]:
    """Facts that make a benchmark table comparable to another run."""
    return {
        "cpu": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "mem_total": _meminfo().get("MemTotal", 0),
        "kernel": platform.release(),
        "python": platform.python_version(),
        "numpy": _version("numpy"),
        "torch": _version("torch"),
        "loadavg_1m": os.getloadavg()[0],
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def machine_info() -> str:
    """One line: cpu model, cores, memory, kernel, python, numpy, torch, load average, date.

    A 1-minute load average well above 0 at the start means something else was
    running: the numbers of that run are suspect.
    """
    d = machine_info_dict()
    return (
        f"{d['cpu']}, {d['cores_usable']}/{d['cores']} cores, {format_bytes(d['mem_total'])} RAM, "
        f"Linux {d['kernel']}, Python {d['python']}, numpy {d['numpy']}, torch {d['torch']}, "
        f"load {d['loadavg_1m']:.2f}, {d['date']}"
    )


@dataclass(frozen=True)
class PeakRss:
    """Peak resident set size in bytes: this process, and the largest waited-for child."""

    self_bytes: int
    children_bytes: int

    def __str__(self) -> str:
        return f"peak RSS: self {format_bytes(self.self_bytes)}, largest child {format_bytes(self.children_bytes)}"


def peak_rss() -> PeakRss:
    """Peak RSS from ``resource.getrusage`` (RUSAGE_SELF and RUSAGE_CHILDREN)."""
    scale = 1 if sys.platform == "darwin" else KIB  # ru_maxrss is KiB on Linux
    return PeakRss(
        self_bytes=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale,
        children_bytes=resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale,
    )


def _busy_cpu_seconds() -> float:
    """user + nice + system time of all CPUs since boot (irq/softirq left out: loopback TCP lands there)."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:4]
    return sum(int(x) for x in fields) / os.sysconf("SC_CLK_TCK")


def _own_cpu_seconds() -> float:
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


class OtherCpuLoad:
    """How busy the rest of the machine kept the CPUs while a benchmark ran.

    Created at the start of a run; :meth:`cores_busy` is the average number of
    cores used by processes other than this one and its reaped children since
    then. On the 2-core machines anything above ~0.2 makes a run's numbers
    suspect, so programs print it under their table.
    """

    def __init__(self) -> None:
        self._wall0 = time.monotonic()
        self._busy0 = _busy_cpu_seconds()
        self._own0 = _own_cpu_seconds()

    def cores_busy(self) -> float:
        wall = time.monotonic() - self._wall0
        if wall <= 0:
            return 0.0
        others = (_busy_cpu_seconds() - self._busy0) - (_own_cpu_seconds() - self._own0)
        return max(0.0, others / wall)

    def describe(self) -> str:
        busy = self.cores_busy()
        verdict = "" if busy < 0.2 else ": the numbers of this run are suspect"
        return f"other processes kept {busy:.2f} of {os.cpu_count()} cores busy during the run{verdict}"
