"""Status codes and the exception that carries them.

``LLMStatusCode`` has LLM-DataDist's numeric values (``0x5010B000 + n`` for
the LLM codes, the ACL runtime values for the two memory-error codes), so
codes read the same in logs and across languages. Every validation failure in
aio_datadist is ``LLMException(LLM_PARAM_INVALID)`` with a message that names
the offending argument; the ``check_*`` helpers of :mod:`aio_datadist._checks`
produce those.
"""

from __future__ import annotations

import operator
from enum import IntEnum
from typing import Any

__all__ = [
    "LLMStatusCode",
    "LLMException",
    "Status",
    "code_to_status",
    "code_2_status",
]


class LLMStatusCode(IntEnum):
    """Result codes of LLM-DataDist, with its numeric values.

    ``str(code)`` gives ``"LLMStatusCode.NAME"``; ``int(code)`` the native
    value. ``LLM_SEQ_LENOVERLIMIT`` keeps the original's spelling.
    """

    LLM_SUCCESS = 0
    LLM_FAILED = 0xFFFFFFFF
    LLM_WAIT_PROCESS_TIMEOUT = 0x5010B001
    LLM_KV_CACHE_NOT_EXIST = 0x5010B002
    LLM_REPEAT_REQUEST = 0x5010B003
    LLM_REQUEST_ALREADY_COMPLETED = 0x5010B004
    LLM_PARAM_INVALID = 0x5010B005
    LLM_ENGINE_FINALIZED = 0x5010B006
    LLM_NOT_YET_LINK = 0x5010B007
    LLM_ALREADY_LINK = 0x5010B008
    LLM_LINK_FAILED = 0x5010B009
    LLM_UNLINK_FAILED = 0x5010B00A
    LLM_NOTIFY_PROMPT_UNLINK_FAILED = 0x5010B00B
    LLM_CLUSTER_NUM_EXCEED_LIMIT = 0x5010B00C
    LLM_PROCESSING_LINK = 0x5010B00D
    LLM_DEVICE_OUT_OF_MEMORY = 0x5010B00E
    LLM_PREFIX_ALREADY_EXIST = 0x5010B00F
    LLM_PREFIX_NOT_EXIST = 0x5010B010
    LLM_SEQ_LENOVERLIMIT = 0x5010B011
    LLM_NO_FREE_BLOCK = 0x5010B012
    LLM_BLOCKS_OUT_OF_MEMORY = 0x5010B013
    LLM_EXIST_LINK = 0x5010B018
    LLM_FEATURE_NOT_ENABLED = 0x5010B019
    LLM_TIMEOUT = 0x5010B01A
    LLM_LINK_BUSY = 0x5010B01B
    LLM_OUT_OF_MEMORY = 0x5010B01C
    LLM_DEVICE_MEM_ERROR = 507053
    LLM_SUSPECT_REMOTE_ERROR = 507057
    LLM_UNKNOWN_ERROR = -1

    def __str__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


def code_to_status(code: int) -> LLMStatusCode:
    """Map a native status value to its ``LLMStatusCode``.

    :param code: an integer status, e.g. from the wire or a native call.
    :returns: the matching member; any value that is not a member maps to
        ``LLM_FAILED``, as LLM-DataDist's ``code_2_status`` does.
    :raises LLMException: ``LLM_PARAM_INVALID`` if ``code`` is not an int.
    """
    # The one argument check status makes itself: _checks sits above this module.
    try:
        # a bool is no int, nor (as _checks.check_int has it) a bool tensor or an array of one element, which
        # torch's and numpy's __index__ would read as one
        given: Any = code
        if isinstance(given, bool):
            raise TypeError
        if not isinstance(given, int):  # (an int, IntEnum members too, has no dtype to ask: one may name a member so)
            try:
                dtype, ndim = str(getattr(given, "dtype", "")), getattr(given, "ndim", 0)
            except Exception:  # an attribute that raises: no int
                raise TypeError from None
            if dtype in ("bool", "torch.bool") or ndim != 0:
                raise TypeError
        value = operator.index(code)
    except TypeError:
        got = "bool" if isinstance(code, bool) else type(code).__name__
        raise LLMException(f"invalid argument 'code': expected an int, got {got}",
                           status_code=LLMStatusCode.LLM_PARAM_INVALID, argument="code") from None
    try:
        return LLMStatusCode(value)
    except ValueError:
        return LLMStatusCode.LLM_FAILED


#: LLM-DataDist's name of :func:`code_to_status`.
code_2_status = code_to_status


def _as_status(code: LLMStatusCode | int) -> LLMStatusCode:
    if isinstance(code, LLMStatusCode):
        return code
    return code_to_status(code)


class LLMException(RuntimeError):
    """An error with an ``LLMStatusCode``.

    :param args: the message (and any further arguments, as for
        ``RuntimeError``).
    :param status_code: the code; a plain int is mapped with
        ``code_to_status``. Defaults to ``LLM_FAILED``.

    ``str(exc)`` ends with the code's name, e.g.
    ``"invalid argument 'size': must be -1 [LLM_PARAM_INVALID]"``, while
    ``exc.args[0]`` is the bare message.
    """

    def __init__(self, *args: object, status_code: LLMStatusCode | int = LLMStatusCode.LLM_FAILED,
                 argument: str | None = None) -> None:
        super().__init__(*args)
        self._status_code = _as_status(status_code)
        #: The argument a ``LLM_PARAM_INVALID`` error names (as ``_checks.param_invalid`` built it), else None.
        self.argument = argument

    @property
    def status_code(self) -> LLMStatusCode:
        """The status code this exception carries (read-only)."""
        return self._status_code

    def __str__(self) -> str:
        message = super().__str__()
        name = self._status_code.name
        if not message:
            return name
        if name in message:
            return message
        return f"{message} [{name}]"

    def __repr__(self) -> str:
        args = ", ".join(repr(a) for a in self.args)
        sep = ", " if args else ""
        return f"{type(self).__name__}({args}{sep}status_code={self._status_code!s})"


class Status:
    """A status value, as returned by LLM-DataDist's lower layers.

    :param status_code: an ``LLMStatusCode`` or a native int (mapped with
        ``code_to_status``). Defaults to ``LLM_SUCCESS``.
    """

    __slots__ = ("_status_code",)

    def __init__(self, status_code: LLMStatusCode | int = LLMStatusCode.LLM_SUCCESS) -> None:
        self._status_code = _as_status(status_code)

    @property
    def status_code(self) -> LLMStatusCode:
        """The code of this status."""
        return self._status_code

    def is_ok(self) -> bool:
        """True when the code is ``LLM_SUCCESS``."""
        return self._status_code is LLMStatusCode.LLM_SUCCESS

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Status):
            return self._status_code is other._status_code
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._status_code)

    def __repr__(self) -> str:
        return f"Status({self._status_code!s})"
