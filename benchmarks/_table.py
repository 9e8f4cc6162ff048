"""Result tables: rows with ratios against same-run baselines, as text, Markdown, JSON."""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Sequence


_TARGET_RE = re.compile(r"^\s*(>=|<=|>|<)\s*([0-9]*\.?[0-9]+)\s*x?\s*$")
_TARGET_OPS: dict[str, Callable[[float, float], bool]] = {
    ">=": lambda a, b: a >= b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    "<": lambda a, b: a < b,
}


def parse_target(target: str) -> tuple[str, float]:
    """``">= 0.9x"`` -> ``(">=", 0.9)``.

    Raises:
        ValueError: ``target`` is not ``<op> <number>[x]`` with op one of >=, <=, >, <.
    """
    m = _TARGET_RE.match(target)
    if m is None:
        raise ValueError(f"target must look like '>= 0.9x', got {target!r}")
    return m.group(1), float(m.group(2))


@dataclass(frozen=True)
class Row:
    """One table row. ``ratio`` is ``value / baseline_value``; targets are on the ratio."""

    benchmark: str
    case: str
    value: float
    unit: str
    baseline: str | None = None
    baseline_value: float | None = None
    ratio: float | None = None
    target: str | None = None
    passed: bool | None = None

    @property
    def mark(self) -> str:
        return "" if self.passed is None else ("pass" if self.passed else "FAIL")


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if v == 0 or math.isnan(v):
        return f"{v:g}"
    a = abs(v)
    if a >= 100:
        return f"{v:.0f}"
    if a >= 10:
        return f"{v:.1f}"
    if a >= 1:
        return f"{v:.2f}"
    return f"{v:.3f}"


@dataclass
class Table:
    """Rows of benchmark results with ratios against baselines of the same run.

    Text (:meth:`render_text`), Markdown (:meth:`render_markdown`, for
    benchmarks/RESULTS.md) and JSON (:meth:`to_json`) come from the same rows.
    A target marks a row pass/FAIL; it is information, never an assertion.
    """

    title: str
    machine: str = ""
    rows: list[Row] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    COLUMNS = ("benchmark", "case", "value", "unit", "baseline", "baseline value", "ratio", "target", "mark")

    def add(
        self,
        benchmark: str,
        case: str,
        value: float,
        unit: str,
        *,
        baseline: str | None = None,
        baseline_value: float | None = None,
        target: str | None = None,
    ) -> Row:
        """Append a row; computes ``ratio = value / baseline_value`` and the target mark.

        Raises:
            ValueError: ``target`` is malformed, or given without ``baseline_value``.
        """
        ratio = None
        if baseline_value is not None and baseline_value > 0:
            ratio = value / baseline_value
        passed = None
        if target is not None:
            op, bound = parse_target(target)
            if baseline_value is None:
                raise ValueError(f"target {target!r} needs a baseline_value for row {benchmark!r}/{case!r}")
            passed = ratio is not None and _TARGET_OPS[op](ratio, bound)
        row = Row(benchmark, case, value, unit, baseline, baseline_value, ratio, target, passed)
        self.rows.append(row)
        return row

    def note(self, text: str) -> None:
        """A line printed under the table."""
        self.notes.append(text)

    def find(self, benchmark: str, case: str) -> Row:
        """The row with this benchmark name and case label.

        Raises:
            KeyError: no such row.
        """
        for row in self.rows:
            if row.benchmark == benchmark and row.case == case:
                return row
        raise KeyError((benchmark, case))

    def _cells(self) -> list[list[str]]:
        out = []
        for r in self.rows:
            out.append(
                [
                    r.benchmark,
                    r.case,
                    _fmt(r.value),
                    r.unit,
                    r.baseline or "-",
                    _fmt(r.baseline_value),
                    "-" if r.ratio is None else f"{r.ratio:.2f}x",
                    r.target or "",
                    r.mark,
                ]
            )
        return out

    def render_text(self) -> str:
        cells = self._cells()
        widths = [max([len(h)] + [len(c[i]) for c in cells]) for i, h in enumerate(self.COLUMNS)]
        numeric = {2, 5, 6}

        def line(values: Sequence[str]) -> str:
            parts = [v.rjust(w) if i in numeric else v.ljust(w) for i, (v, w) in enumerate(zip(values, widths))]
            return "  ".join(parts).rstrip()

        lines = [self.title]
        if self.machine:
            lines.append(self.machine)
        lines.append("")
        lines.append(line(self.COLUMNS))
        lines.append(line(["-" * w for w in widths]))
        lines.extend(line(c) for c in cells)
        if self.notes:
            lines.append("")
            lines.extend(f"* {n}" for n in self.notes)
        return "\n".join(lines)

    def render_markdown(self, heading_level: int = 2) -> str:
        lines = [f"{'#' * heading_level} {self.title}", ""]
        if self.machine:
            lines += [f"Machine: {self.machine}", ""]
        lines.append("| " + " | ".join(self.COLUMNS) + " |")
        lines.append("|" + "|".join("---:" if i in (2, 5, 6) else "---" for i in range(len(self.COLUMNS))) + "|")
        for c in self._cells():
            lines.append("| " + " | ".join(v.replace("|", "\\|") for v in c) + " |")
        if self.notes:
            lines.append("")
            lines.extend(f"- {n}" for n in self.notes)
        return "\n".join(lines) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "machine": self.machine,
            "rows": [dict(asdict(r), mark=r.mark) for r in self.rows],
            "notes": list(self.notes),
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def __str__(self) -> str:
        return self.render_text()

    def print(self, file: Any = None) -> None:
        print(self.render_text(), file=file or sys.stdout, flush=True)
