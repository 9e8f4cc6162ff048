"""Refused connections logged at a pace: a door a process can knock on again and again must not flood the log."""

from __future__ import annotations

import logging
import time

__all__ = ["REFUSAL_LOG_EVERY_S", "RefusalLog"]

#: At most one WARNING per this many seconds about each kind of refusal (as for the vLLM side channel).
REFUSAL_LOG_EVERY_S = 30.0


class RefusalLog:
    """Logs one kind of refusal on ``logger``: one WARNING per :data:`REFUSAL_LOG_EVERY_S` with how many were
    refused since the last, DEBUG for the rest, so that a process opening connection after connection cannot
    flood the log."""

    __slots__ = ("_log", "_logged", "_unsaid", "_counted")

    def __init__(self, logger: logging.Logger | None = None, counted: str = "refused") -> None:
        """``counted``: what the count in the WARNING says of the events (``"refused"``: "3 refused since the
        last such warning")."""
        self._log = logger if logger is not None else logging.getLogger("aio_datadist.links")
        self._logged = -REFUSAL_LOG_EVERY_S
        self._unsaid = 0
        self._counted = counted

    def note(self, fmt: str, *args: object, logger: logging.Logger | logging.LoggerAdapter | None = None) -> None:
        """Log one event; ``logger``: this event's own (a link's, with its fields), else the one given at
        construction. The pace is this object's, whichever logger says it."""
        say = self._log if logger is None else logger
        self._unsaid += 1
        now = time.monotonic()
        if now - self._logged >= REFUSAL_LOG_EVERY_S:
            say.warning(fmt + f" (%d {self._counted} since the last such warning)", *args, self._unsaid)
            self._logged, self._unsaid = now, 0
        else:
            say.debug(fmt, *args)
