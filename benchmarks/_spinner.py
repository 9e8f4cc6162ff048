"""A child process that keeps one core busy, for the "under load" passes of a benchmark.

The child is a plain busy loop (``python -c``), not pinned to a core unless
asked (``cpu=N``): the scheduler places it, as it would another tenant's
process. It is started once, stopped (SIGSTOP) between the loaded passes and
resumed (SIGCONT) for them, so switching costs no process start. It cannot
outlive the benchmark: it asks the kernel to kill it when its parent dies
(``PR_SET_PDEATHSIG``, effective even while it is stopped), checks its parent
itself as a second guard, and :meth:`Spinner.close` (the context exit, also on
Ctrl-C and errors) kills and reaps it.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator

_CHILD = """
import ctypes, os, signal, sys
parent = int(sys.argv[1])
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
signal.signal(signal.SIGINT, signal.SIG_IGN)  # the benchmark stops us, also on its Ctrl-C
if os.getppid() != parent:
    os._exit(0)
os.write(1, b"r")
os.close(1)
while True:
    for _ in range(200000):
        pass
    if os.getppid() != parent:
        os._exit(0)
"""


class Spinner:
    """One busy child process, stopped until :meth:`running` resumes it.

    Must be created on the thread that lives as long as the child should (the
    kernel's parent-death signal follows the creating thread): the main thread.

    Args:
        cpu: pin the child to this CPU (``sched_setaffinity``); ``None`` lets it float.
    """

    def __init__(self, cpu: int | None = None) -> None:
        if threading.current_thread() is not threading.main_thread():
            raise RuntimeError("create the Spinner on the main thread (its death signal follows the creating thread)")
        self.cpu = cpu
        self._proc: subprocess.Popen[bytes] | None = subprocess.Popen(
            [sys.executable, "-c", _CHILD, str(os.getpid())], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE)
        self.pid = self._proc.pid
        try:
            # stopped only once its death signal is set, so a stopped child cannot be orphaned
            assert self._proc.stdout is not None
            ready = self._proc.stdout.read(1)
            self._proc.stdout.close()
            if ready != b"r":
                raise RuntimeError(f"the spinner child did not start (exit {self._proc.poll()})")
            if cpu is not None:
                os.sched_setaffinity(self.pid, {cpu})
            os.kill(self.pid, signal.SIGSTOP)
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> Spinner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def cpu_seconds(self) -> float:
        """user + system CPU time the child has used so far."""
        try:
            with open(f"/proc/{self.pid}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except FileNotFoundError:
            code = None if self._proc is None else self._proc.poll()
            raise RuntimeError(f"the busy child process {self.pid} is gone (exit status {code}): something outside "
                               "the benchmark killed it; the loaded passes cannot be measured") from None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    @contextlib.contextmanager
    def running(self) -> Iterator[None]:
        """The child spins inside the block and is stopped again on the way out."""
        if self._proc is None:
            raise RuntimeError("the spinner is closed")
        os.kill(self.pid, signal.SIGCONT)
        try:
            yield
        finally:
            if self._proc is not None and self._proc.poll() is None:
                os.kill(self.pid, signal.SIGSTOP)

    def describe(self) -> str:
        where = f"pinned to CPU {self.cpu}" if self.cpu is not None else "not pinned"
        return f"a busy-loop child process ({where})"

    def close(self) -> None:
        """Kill and reap the child (idempotent)."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
        proc.wait()
