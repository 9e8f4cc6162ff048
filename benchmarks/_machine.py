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


UNKNOWN_CPU = "unknown cpu"


def _cpu_model() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    return platform.processor() or UNKNOWN_CPU


def cpu_model_known(model: str) -> bool:
    """Whether ``model`` (the first field of a machine line) names a CPU model, rather than :func:`_cpu_model`'s
    fallback for a ``/proc/cpuinfo`` without one (the architecture, or nothing), which every such machine shares."""
    return model not in ("", UNKNOWN_CPU, platform.processor())


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


def _live_children_cpu_seconds() -> float:
    """user + system time of this process's children that have not been reaped yet."""
    me = os.getpid()
    tick = os.sysconf("SC_CLK_TCK")
    total = 0
    try:
        entries = os.listdir("/proc")
    except OSError:
        return 0.0
    for entry in entries:
        if not entry.isdigit():
            continue
        with contextlib.suppress(OSError, ValueError, IndexError):
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
            # after the command: state ppid ... utime (field 14) stime (15), 1-based over the whole line
            if int(fields[1]) == me:
                total += int(fields[11]) + int(fields[12])
    return total / tick


class OtherCpuLoad:
    """How busy the rest of the machine kept the CPUs while a benchmark ran.

    Created at the start of a run; :meth:`cores_busy` is the average number of
    cores used by processes other than this one and its reaped children since
    then. On the 2-core machines anything above ~0.2 makes a run's numbers
    suspect, so programs print it under their table.

    With ``live_children=True`` the CPU time of children still running (peer
    processes, read from /proc) counts as this run's own too, so the figure
    is right while they run, not only once they have been reaped.
    """

    def __init__(self, *, live_children: bool = False) -> None:
        self._live_children = live_children
        self._wall0 = time.monotonic()
        self._busy0 = _busy_cpu_seconds()
        self._own0 = self._own()

    def _own(self) -> float:
        return _own_cpu_seconds() + (_live_children_cpu_seconds() if self._live_children else 0.0)

    def cores_busy(self) -> float:
        wall = time.monotonic() - self._wall0
        if wall <= 0:
            return 0.0
        others = (_busy_cpu_seconds() - self._busy0) - (self._own() - self._own0)
        return max(0.0, others / wall)

    def describe(self) -> str:
        busy = self.cores_busy()
        verdict = "" if busy < 0.2 else ": the numbers of this run are suspect"
        return f"other processes kept {busy:.2f} of {os.cpu_count()} cores busy during the run{verdict}"


_STATUS_FIELDS = ("VmRSS", "VmHWM", "RssAnon", "RssFile", "RssShmem")


def rss_status(pid: int | str = "self") -> dict[str, int]:
    """VmRSS, VmHWM, RssAnon, RssFile and RssShmem of a process, in bytes (from /proc/PID/status)."""
    out: dict[str, int] = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in _STATUS_FIELDS:
                out[key] = int(rest.split()[0]) * KIB
    return out


class RssWatch:
    """Peak RSS of one process (this one, or a child of the same user) across resets of its high-water mark.

    :meth:`reset` records the peak so far, then clears the kernel's high-water
    mark (``echo 5 > /proc/PID/clear_refs``, Linux >= 4.0), so that
    :meth:`since_reset` gives the peak of what ran since. :meth:`peak` is the
    peak over the whole life of the watch, resets included.
    """

    def __init__(self, pid: int | str = "self") -> None:
        self.pid = pid
        self._peak = 0

    def status(self) -> dict[str, int]:
        return rss_status(self.pid)

    def reset(self) -> dict[str, int]:
        """Clear the high-water mark; returns the status right after.

        Raises:
            OSError: the kernel does not let this process reset it.
        """
        self._peak = max(self._peak, self.status()["VmHWM"])
        with open(f"/proc/{self.pid}/clear_refs", "w") as f:
            f.write("5")
        return self.status()

    def since_reset(self) -> dict[str, int]:
        """Current status; its VmHWM is the peak since the last :meth:`reset`."""
        return self.status()

    def peak(self) -> int:
        return max(self._peak, self.status()["VmHWM"])
