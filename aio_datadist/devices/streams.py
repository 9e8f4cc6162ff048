"""Stream completions: the core's StreamNotifier, opened for one device.

A :class:`~aio_datadist._core.StreamNotifier` turns "everything enqueued on
this stream so far is done" into a record on the endpoint's
``CompletionQueue`` (``cuLaunchHostFunc`` on CUDA, ``aclrtLaunchCallback`` on
Ascend), so device work resumes its coroutine like every other engine's
without a thread waiting on it. The backend (``devices/backend.py``) opens
one for its copy stream.

On CUDA the driver runs a host function on its callback thread a while after
the stream got there (250-350 us after a kernel on a VM, benchmarks/RESULTS.md
"GPU"); the notifier also polls an event recorded just before it, for
``CUDA_POLL_US`` microseconds (env ``AIO_DATADIST_CUDA_POLL_US``, default
2000; 0: host functions only), and posts the record as the event completes.
The host function stays the guarantee for anything longer.
"""

from __future__ import annotations

import errno

from aio_datadist import _core
from aio_datadist._env import env_int
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["CUDA_POLL_US", "open_notifier"]

#: The watcher's window in microseconds (the core takes a C int: at most 2**31 - 1, 35 minutes).
CUDA_POLL_US = env_int("AIO_DATADIST_CUDA_POLL_US", 2000, high=2 ** 31, unit="microseconds")


def open_notifier(queue: _core.CompletionQueue, kind: str, index: int,
                  library: str | None = None, poll_us: int | None = None) -> _core.StreamNotifier:
    """A core StreamNotifier; a missing driver or device is ``LLM_FEATURE_NOT_ENABLED``.

    ``poll_us``: the CUDA event watcher's window (default ``CUDA_POLL_US``); other kinds ignore it.
    """
    poll = (CUDA_POLL_US if poll_us is None else poll_us) if kind == "cuda" else 0
    try:
        return _core.StreamNotifier(queue, kind, index, library, poll)
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            raise LLMException(f"option 'aio.DeviceType': {kind} device caches need stream "
                               f"completions, which are unavailable: {exc.strerror}",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED) from exc
        raise LLMException(f"{kind} stream completions failed to start: {exc.strerror}",
                           status_code=LLMStatusCode.LLM_FAILED) from exc
