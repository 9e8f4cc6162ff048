"""Soak the reliability suite: many more kill trials, fuzz cases, storms and load than CI runs.

Usage::

    python tools/soak.py --minutes 30 --scale 5
    python tools/soak.py --rounds 3 --scale 20 --only faults,wire_fuzz

Each round runs ``tests/reliability`` (or the chosen modules) in a fresh
``pytest`` process with ``AIO_RELIABILITY_SCALE`` (trials, examples, waves
and load seconds multiplied) and ``AIO_RELIABILITY_SEED`` set to the round
number, so every round kills at other random points and draws other fuzz
cases. Rounds go on until the time or round budget is spent or one fails; a
failure prints its output and the seed that reproduces it::

    AIO_RELIABILITY_SEED=<seed> AIO_RELIABILITY_SCALE=<scale> python -m pytest -q tests/reliability

At the end it prints the counts summed over the rounds. A program, not a
test: CI runs the suite itself at scale 1 (see docs/reliability.md).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUITE = ROOT / "tests" / "reliability"
COUNT_LINE = re.compile(r"^([a-z][a-z ()-]+): (\d+)$")


def run_round(seed: int, scale: int, modules: list[str], timeout_s: float) -> tuple[bool, str]:
    env = dict(os.environ, AIO_RELIABILITY_SEED=str(seed), AIO_RELIABILITY_SCALE=str(scale))
    targets = [str(SUITE / f"test_{m}.py") for m in modules] if modules else [str(SUITE)]
    try:
        done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *targets],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired as exc:
        out = (exc.stdout or b"").decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        return False, out + f"\n(round timed out after {timeout_s:.0f} s)"
    return done.returncode == 0, done.stdout + done.stderr


def summary_of(output: str) -> tuple[collections.Counter[str], list[str]]:
    counts: collections.Counter[str] = collections.Counter()
    notes = []
    in_summary = False
    for line in output.splitlines():
        if "reliability" in line and line.startswith("="):
            in_summary = True
            continue
        if in_summary and line.startswith("="):
            in_summary = False
        if in_summary:
            match = COUNT_LINE.match(line.strip())
            if re.match(r"^\d+ (passed|failed)", line.strip()):
                continue
            if match:
                counts[match.group(1)] += int(match.group(2))
            elif line.strip():
                notes.append(line.strip())
    return counts, notes


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="stop starting rounds after this long")
    parser.add_argument("--rounds", type=int, default=0, help="at most this many rounds (0: no limit)")
    parser.add_argument("--scale", type=int, default=5, help="multiplier for trials, examples, waves, seconds")
    parser.add_argument("--first-seed", type=int, default=1, help="seed of the first round (0 is CI's)")
    parser.add_argument("--only", default="", help="comma-separated modules, e.g. faults,wire_fuzz,cancel_storm")
    args = parser.parse_args()
    modules = [m.strip().removeprefix("test_").removesuffix(".py") for m in args.only.split(",") if m.strip()]
    deadline = time.monotonic() + args.minutes * 60
    totals: collections.Counter[str] = collections.Counter()
    seed = args.first_seed
    rounds = 0
    started = time.monotonic()
    while time.monotonic() < deadline and (not args.rounds or rounds < args.rounds):
        t0 = time.monotonic()
        ok, output = run_round(seed, args.scale, modules, timeout_s=max(600.0, 240.0 * args.scale))
        counts, notes = summary_of(output)
        totals.update(counts)
        rounds += 1
        took = time.monotonic() - t0
        print(f"round {rounds} (seed {seed}, scale {args.scale}): {'ok' if ok else 'FAILED'} in {took:.0f} s; "
              + ", ".join(f"{k} {v}" for k, v in counts.items()), flush=True)
        for line in notes:
            print(f"    {line}", flush=True)
        if not ok:
            print(output)
            print(f"reproduce: AIO_RELIABILITY_SEED={seed} AIO_RELIABILITY_SCALE={args.scale} "
                  f"python -m pytest -q tests/reliability", flush=True)
            break
        seed += 1
    print(f"\n{rounds} round(s) in {(time.monotonic() - started) / 60:.1f} min")
    for what, n in sorted(totals.items()):
        print(f"  {what}: {n}")
    return 0 if rounds and ok else 1


if __name__ == "__main__":
    sys.exit(main())
