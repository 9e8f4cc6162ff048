"""The stage marks of ``benchmarks.breakdown`` (``aio_datadist._trace``): wall clock, or the thread's CPU time."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import aio_datadist

TRACE = Path(aio_datadist.__file__).with_name("_trace.py")
#: Loads ``_trace.py`` alone (the package would import torch), marks around a 0.2 s sleep and 0.1 s of spinning,
#: and prints the two differences in ms.
CHILD = """
import importlib.util, sys, time
spec = importlib.util.spec_from_file_location("trace", sys.argv[1])
trace = importlib.util.module_from_spec(spec)
spec.loader.exec_module(trace)
assert trace.ON
trace.mark("a")
time.sleep(0.2)
trace.mark("b")
end = time.thread_time() + 0.1
while time.thread_time() < end:
    pass
trace.mark("c")
(a, _), (b, _), (c, _) = trace.take()
print(trace.CLOCK, (b - a) / 1e6, (c - b) / 1e6)
"""


@pytest.mark.parametrize("clock", ["wall", "cpu"])
def test_marks_read_the_wall_clock_or_the_threads_cpu_time(clock):
    env = {**os.environ, "AIO_DATADIST_TRACE": "1", "AIO_DATADIST_TRACE_CLOCK": clock}
    out = subprocess.run([sys.executable, "-c", CHILD, str(TRACE)], env=env, capture_output=True, text=True,
                         timeout=30, check=True).stdout.split()
    said, slept_ms, spun_ms = out[0], float(out[1]), float(out[2])
    assert said == clock
    assert spun_ms >= 99  # CPU time spun, in either clock
    if clock == "cpu":
        assert slept_ms < 20, "a sleep costs no CPU"
    else:
        assert slept_ms >= 199
