"""Stream completions: the core's StreamNotifier, opened for one device.

A :class:`~aio_datadist._core.StreamNotifier` turns "everything enqueued on
this stream so far is done" into a record on the endpoint's
``CompletionQueue`` (``cuLaunchHostFunc`` on CUDA, ``aclrtLaunchCallback`` on
Ascend), so device work resumes its coroutine like every other engine's
without a thread waiting on it. The backend (``devices/backend.py``) opens
one for its copy stream.
"""

from __future__ import annotations

import errno

from aio_datadist import _core
from aio_datadist.status import LLMException, LLMStatusCode

__all__ = ["open_notifier"]


def open_notifier(queue: _core.CompletionQueue, kind: str, index: int,
                  library: str | None = None) -> _core.StreamNotifier:
    """A core StreamNotifier; a missing driver or device is ``LLM_FEATURE_NOT_ENABLED``."""
    try:
        return _core.StreamNotifier(queue, kind, index, library)
    except OSError as exc:
        if exc.errno == errno.ENODEV:
            raise LLMException(f"option 'aio.DeviceType': {kind} device caches need stream "
                               f"completions, which are unavailable: {exc.strerror}",
                               status_code=LLMStatusCode.LLM_FEATURE_NOT_ENABLED) from exc
        raise LLMException(f"{kind} stream completions failed to start: {exc.strerror}",
                           status_code=LLMStatusCode.LLM_FAILED) from exc
