"""The target table of issue 19 (small requests), built from a suite run; not a program of its own.

``benchmarks.suite`` measures the cases; this module turns them into one
table with every row of the issue's targets:

- quiet: 1-block TCP pull p50 and p99 against the raw TCP round trip of the
  same 2 MiB, 4-block TCP pull throughput against raw TCP, 1-block same-host
  pull p50 against the raw round trip, 64 concurrent 1-block TCP pulls on one
  link against raw round trips one at a time;
- loaded: the same ratios measured while a busy child process of the
  benchmark's own spins (``benchmarks._spinner``), each against the raw
  baseline measured under the same load, and loaded / quiet with its mark;
- 128 MiB: the throughput ratios at 64 blocks against the same ratios in a
  saved reference run (``--reference``, a ``--format json`` output) of the
  same kind of machine: by default the newest one in ``benchmarks/results``
  whose machine line names this machine's CPU model and cores. Ratios of two
  machines are not comparable (same-host against memcpy read 1.65x on the
  Intel VMs and 1.1-1.3x on the AMD ones, with the same code), so a reference
  of another machine gives rows without a mark.

The NIXL row (8 MiB pull over ``aio.Transport=nixl`` against plain NIXL READ)
is printed by ``benchmarks.nixl``, which has the bare NIXL agent.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks._machine import cpu_model_known
from benchmarks._table import Table
from benchmarks._timing import Measurement

TITLE = "Small requests (issue 19)"
LOADED = "loaded"  # key prefix of the cases measured while the spinner runs
#: Where the saved reference runs are (``suite-*-reference.json``); ``--reference auto`` picks the newest one
#: made on this kind of machine (CPU model and cores).
REFERENCES = Path(__file__).parent / "results"
#: A loaded ratio may be this much worse than the quiet one.
LOADED_FACTOR = 1.3
UNCHANGED = ">= 0.95x"  # a 128 MiB ratio against the reference's: at most 5% worse
#: The 128 MiB rows of the throughput table compared with the reference: (benchmark, baseline).
RATIO_ROWS = (("pull_blocks TCP", "raw TCP"), ("push_blocks TCP", "raw TCP"),
              ("pull_blocks same-host", "memcpy 1 thread"), ("push_blocks same-host", "memcpy 1 thread"))
TARGET_CASE = "64 blk (128 MiB)"


@dataclass(frozen=True)
class Case:
    """One target row: how to get its value and baseline from the run's measurements."""

    name: str
    case: str
    unit: str
    baseline: str
    target: str
    value: Callable[[Callable[..., Measurement]], float]
    base: Callable[[Callable[..., Measurement]], float]
    needs: tuple[tuple[str, ...], ...]

    @property
    def lower_is_better(self) -> bool:
        return self.target.lstrip().startswith("<")

    def loaded_target(self) -> str:
        """Loaded / quiet may be at most 1.3x worse: <= 1.3x for latencies, >= 1/1.3 for rates."""
        return f"<= {LOADED_FACTOR}x" if self.lower_is_better else f">= {1 / LOADED_FACTOR:.2f}x"


def _cases(concurrent: int) -> list[Case]:
    return [
        Case("pull_blocks TCP p50", "1 blk", "us", "raw TCP round trip p50", "<= 1.15x",
             lambda m: m("pull", "tcp", "1").p50_us, lambda m: m("raw", "tcp", "1").p50_us,
             (("pull", "tcp", "1"), ("raw", "tcp", "1"))),
        Case("pull_blocks TCP p99", "1 blk", "us", "raw TCP round trip p99", "<= 1.3x",
             lambda m: m("pull", "tcp", "1").p99_us, lambda m: m("raw", "tcp", "1").p99_us,
             (("pull", "tcp", "1"), ("raw", "tcp", "1"))),
        Case("pull_blocks TCP", "4 blk (8 MiB)", "GB/s", "raw TCP", ">= 0.95x",
             lambda m: m("pull", "tcp", "4").gbps, lambda m: m("raw", "tcp", "4").gbps,
             (("pull", "tcp", "4"), ("raw", "tcp", "4"))),
        Case("pull_blocks same-host p50", "1 blk", "us", "raw TCP round trip p50", "<= 0.4x",
             lambda m: m("pull", "local", "1").p50_us, lambda m: m("raw", "tcp", "1").p50_us,
             (("pull", "local", "1"), ("raw", "tcp", "1"))),
        Case(f"pull_blocks TCP, {concurrent} concurrent on one link", f"{concurrent} x 1 blk", "1/s",
             "raw TCP round trips, one at a time", ">= 1.1x",
             lambda m: concurrent / m("concurrent", "tcp", "1").summary.median,
             lambda m: 1.0 / m("raw", "tcp", "1").summary.median,
             (("concurrent", "tcp", "1"), ("raw", "tcp", "1"))),
    ]


#: The measurement keys the loaded pass repeats, in the order of a round (rotated per round).
def loaded_keys() -> list[tuple[str, str, str]]:
    return [("raw", "tcp", "1"), ("pull", "tcp", "1"), ("pull", "local", "1"), ("raw", "tcp", "4"),
            ("pull", "tcp", "4"), ("concurrent", "tcp", "1")]


@dataclass(frozen=True)
class Reference:
    """A saved suite run's 128 MiB ratios: ``{(benchmark, case, baseline): ratio}``, and its machine line."""

    path: Path
    machine: str
    ratios: dict[tuple[str, str, str], float]

    def same_machine(self, machine: str) -> bool:
        """Whether the run was made on a machine like the one of the machine line ``machine``: the same CPU
        model (a known one) and the same usable / online cores, the line's first two fields."""
        kind = machine_kind(machine)
        return kind is not None and machine_kind(self.machine) == kind

    @property
    def date(self) -> str:
        """When the run was made (the machine line's last field, ``YYYY-MM-DD HH:MM UTC``), or ''."""
        return self.machine.rsplit(", ", 1)[-1] if self.machine.endswith(" UTC") else ""


def machine_kind(machine: str) -> tuple[str, str] | None:
    """(CPU model, cores) of a machine line (``benchmarks._machine.machine_info``); None when the CPU model is
    not known (``/proc/cpuinfo`` without a model name: every such machine would look alike)."""
    fields = machine.split(", ")
    if len(fields) < 2 or not cpu_model_known(fields[0]) or not fields[1].endswith(" cores"):
        return None
    return fields[0], fields[1]


def load_reference(path: Path) -> Reference:
    """The 128 MiB ratios of a saved suite run (``--format json``).

    Raises:
        ValueError: the file is not a suite JSON output.
    """
    try:
        tables = json.loads(path.read_text())
        out = {}
        machine = ""
        for table in tables:
            found = table.get("machine")
            machine = machine or (found if isinstance(found, str) else "")
            for row in table["rows"]:
                if row.get("ratio") is not None and row.get("baseline"):
                    out[row["benchmark"], row["case"], row["baseline"]] = float(row["ratio"])
    except (AttributeError, KeyError, TypeError, ValueError, json.JSONDecodeError) as e:
        raise ValueError(f"--reference {path}: not a benchmarks.suite --format json output ({e})") from None
    return Reference(path, machine, out)


def find_reference(machine: str, folder: Path = REFERENCES) -> tuple[Reference | None, list[str]]:
    """The newest saved reference run in ``folder`` (by the date in its machine line) made on a machine like
    the one of the machine line ``machine`` (:meth:`Reference.same_machine`), or None; and a note for each
    file that could not be read."""
    found, unreadable = [], []
    for path in sorted(folder.glob("suite-*-reference.json")):
        try:
            ref = load_reference(path)
        except (OSError, ValueError) as e:
            unreadable.append(f"{path.name} skipped: {e}")
            continue
        if ref.same_machine(machine):
            found.append(ref)
    return max(found, key=lambda r: r.date, default=None), unreadable


def build(has: Callable[..., bool], m: Callable[..., Measurement], throughput: Table | None,
          reference: Reference | None, concurrent: int, loaded: dict[str, Any] | None, machine: str, mode: str,
          no_reference: str = "") -> Table:
    """The issue's target table.

    Args:
        has, m: the run's measurement lookup (``Results.has`` / ``Results.m``).
        throughput: the run's throughput table (for the 128 MiB rows).
        reference: the saved run the 128 MiB rows compare with, or ``None`` for no such rows (``no_reference``
            says why); rows against a run of another kind of machine than ``machine`` get no mark.
        loaded: ``None`` when the loaded pass did not run, else ``{"what": str, "cores": float}``.
    """
    table = Table(f"{TITLE}: targets ({mode}; ratios of medians over alternating rounds)", machine=machine)
    missing = []
    quiet_ratio: dict[str, float] = {}
    for c in _cases(concurrent):
        if not all(has(*k) for k in c.needs):
            missing.append(c.name)
            continue
        base = c.base(m)
        row = table.add(c.name, f"{c.case}, quiet", c.value(m), c.unit, baseline=c.baseline, baseline_value=base,
                        target=c.target)
        assert row.ratio is not None
        quiet_ratio[c.name] = row.ratio
    if loaded is not None:
        def lm(*key: str) -> Measurement:
            return m(LOADED, *key)

        for c in _cases(concurrent):
            if c.name not in quiet_ratio or not all(has(LOADED, *k) for k in c.needs):
                continue
            row = table.add(c.name, f"{c.case}, one core busy", c.value(lm), c.unit,
                            baseline=f"{c.baseline}, one core busy", baseline_value=c.base(lm), target=c.target)
            assert row.ratio is not None
            table.add(f"{c.name}: loaded ratio / quiet ratio", c.case, row.ratio, "x", baseline="quiet ratio",
                      baseline_value=quiet_ratio[c.name], target=c.loaded_target())
    comparable = reference is not None and reference.same_machine(machine)
    if throughput is not None and reference is not None:
        ref = reference.ratios
        for benchmark, base in RATIO_ROWS:
            try:
                now = next(r for r in throughput.rows
                           if r.benchmark == benchmark and r.case == TARGET_CASE and r.baseline == base)
            except StopIteration:
                continue
            before = ref.get((benchmark, TARGET_CASE, base))
            if before is None or now.ratio is None:
                continue
            table.add(f"{benchmark} / {base} ratio", f"{TARGET_CASE}, against the reference", now.ratio, "x",
                      baseline="the reference's ratio", baseline_value=before,
                      target=UNCHANGED if comparable else None)
    table.note("8 MiB pull with aio.Transport=nixl against plain NIXL READ (>= 0.9x, and its loaded rows): "
               "python -m benchmarks.nixl")
    if missing:
        table.note("not measured in this run (sizes left out): " + ", ".join(missing))
    if loaded is not None:
        table.note(f"one core busy: {loaded['what']} spins while the same cases run again, in a pass after each "
                   f"quiet round (it is stopped, SIGSTOP, in between); it used {loaded['cores']:.2f} cores on "
                   "average during those passes; each loaded ratio is against the raw baseline measured under "
                   f"the same load; loaded / quiet: at most {LOADED_FACTOR}x worse (<= {LOADED_FACTOR}x where "
                   f"lower is better, >= 1/{LOADED_FACTOR} where higher is)")
    else:
        table.note("no loaded rows: run without --no-load")
    kind = machine_kind(machine)
    here = "unknown CPU" if kind is None else ", ".join(kind)
    if reference is None:
        table.note(f"no 128 MiB rows: {no_reference or 'no reference'}")
    elif comparable:
        table.note(f"128 MiB rows: this run's ratio against the same ratio in {reference.path.name} "
                   "(its machine line and date are in the file); better than the reference passes too")
    else:
        theirs = machine_kind(reference.machine)
        table.note(f"128 MiB rows: no mark, {reference.path.name} was measured on another kind of machine "
                   f"({'unknown' if theirs is None else ', '.join(theirs)}; this machine: {here}), and ratios of "
                   "two machines are not comparable")
    return table
