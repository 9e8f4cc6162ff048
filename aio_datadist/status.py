"""Status codes, the exception that carries them, and argument validation.

``LLMStatusCode`` has LLM-DataDist's numeric values (``0x5010B000 + n`` for
the LLM codes, the ACL runtime values for the two memory-error codes), so
codes read the same in logs and across languages. Every validation failure in
aio_datadist is ``LLMException(LLM_PARAM_INVALID)`` with a message that names
the offending argument; the ``check_*`` helpers below produce those.
"""

from __future__ import annotations

import ipaddress
import operator
from collections.abc import Iterable
from enum import IntEnum
from typing import Any, TypeVar, cast

__all__ = [
    "LLMStatusCode",
    "LLMException",
    "Status",
    "code_to_status",
    "param_invalid",
    "check_instance",
    "check_int",
    "check_uint",
    "check_bool",
    "check_str",
    "check_index",
    "check_indices",
    "check_range",
    "check_ipv4",
    "UINT16_MAX",
    "UINT32_MAX",
    "UINT64_MAX",
    "INT32_MAX",
    "INT64_MAX",
]

UINT16_MAX = 2**16 - 1
UINT32_MAX = 2**32 - 1
UINT64_MAX = 2**64 - 1
INT32_MAX = 2**31 - 1
INT64_MAX = 2**63 - 1

_T = TypeVar("_T")


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
    value = check_int("code", code)
    try:
        return LLMStatusCode(value)
    except ValueError:
        return LLMStatusCode.LLM_FAILED


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
        #: The argument a ``LLM_PARAM_INVALID`` error names (as :func:`param_invalid` built it), else None.
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


def param_invalid(arg_name: str, why: str) -> LLMException:
    """Build (not raise) the error for a bad argument.

    :param arg_name: the argument's name as the caller spelt it.
    :param why: what is wrong, e.g. ``"block index 70 out of range [0, 64)"``.
    :returns: ``LLMException(LLM_PARAM_INVALID)`` with the message
        ``"invalid argument '<arg_name>': <why>"``.
    """
    return LLMException(f"invalid argument '{arg_name}': {why}", status_code=LLMStatusCode.LLM_PARAM_INVALID,
                        argument=arg_name)


def _type_name(value: object) -> str:
    return type(value).__name__


def check_instance(arg_name: str, value: Any, types: type[_T] | tuple[type, ...]) -> _T:
    """Return ``value`` if it is an instance of ``types``.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name`` otherwise.
    """
    if not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types) if isinstance(types, tuple) else types.__name__
        raise param_invalid(arg_name, f"expected {expected}, got {_type_name(value)}")
    return cast(_T, value)


def check_int(arg_name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as an ``int``, checking its type and bounds.

    Anything with ``__index__`` (numpy and 0-d torch integers too) counts as
    an int; ``bool`` does not.

    :param lo: smallest allowed value (inclusive), or None.
    :param hi: largest allowed value (inclusive), or None.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    if isinstance(value, bool):
        raise param_invalid(arg_name, "expected an int, got bool")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise param_invalid(arg_name, f"expected an int, got {_type_name(value)}") from None
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        if hi is None:
            raise param_invalid(arg_name, f"must be >= {lo}, got {number}")
        if lo is None:
            raise param_invalid(arg_name, f"must be <= {hi}, got {number}")
        raise param_invalid(arg_name, f"must be in [{lo}, {hi}], got {number}")
    return number


def check_uint(arg_name: str, value: object, bits: int = 64) -> int:
    """Return ``value`` as an int in ``[0, 2**bits - 1]``.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    number = check_int(arg_name, value)
    if not 0 <= number < (1 << bits):
        raise param_invalid(arg_name, f"must be a uint{bits} in [0, {(1 << bits) - 1}], got {number}")
    return number


def check_bool(arg_name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    if not isinstance(value, bool):
        raise param_invalid(arg_name, f"expected bool, got {_type_name(value)}")
    return value


def check_str(arg_name: str, value: object, *, allow_empty: bool = True) -> str:
    """Return ``value`` if it is a ``str`` (non-empty unless ``allow_empty``).

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    if not isinstance(value, str):
        raise param_invalid(arg_name, f"expected str, got {_type_name(value)}")
    if not allow_empty and not value:
        raise param_invalid(arg_name, "must not be empty")
    return value


def check_index(arg_name: str, value: object, size: int, *, what: str = "index") -> int:
    """Return ``value`` as an int in ``[0, size)``.

    :param what: how the message calls the value, e.g. ``"block index"``.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``, e.g.
        ``"invalid argument 'batch_index': index 4 out of range [0, 4)"``.
    """
    number = check_int(arg_name, value)
    if not 0 <= number < size:
        raise param_invalid(arg_name, f"{what} {number} out of range [0, {size})")
    return number


def check_indices(
    arg_name: str,
    values: Iterable[object],
    size: int,
    *,
    what: str = "index",
    allow_empty: bool = True,
) -> tuple[int, ...]:
    """Return a list of indices as a tuple of ints, each in ``[0, size)``.

    :param values: a list, tuple or range of ints, or a 1-D numpy array or
        torch tensor (anything with ``tolist()``).
    :param what: how the message calls one value, e.g. ``"block index"``.
    :param allow_empty: whether an empty list is acceptable.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``, e.g.
        ``"invalid argument 'src_blocks': block index 70 out of range [0, 64)"``.
    """
    if isinstance(values, (list, tuple, range)):
        items: tuple[object, ...] = tuple(values)
    elif hasattr(values, "tolist") and not isinstance(values, (str, bytes)):
        listed = values.tolist()
        if not isinstance(listed, list):
            raise param_invalid(arg_name, f"expected a 1-D sequence of ints, got a 0-d {_type_name(values)}")
        items = tuple(listed)
    else:
        raise param_invalid(arg_name, f"expected a list of ints, got {_type_name(values)}")
    if not items:
        if allow_empty:
            return ()
        raise param_invalid(arg_name, "must not be empty")
    if all(type(v) is int for v in items):
        ints: tuple[int, ...] = items  # type: ignore[assignment]
        if min(ints) >= 0 and max(ints) < size:
            return ints
    else:
        ints = tuple(check_int(f"{arg_name}[{i}]", v) for i, v in enumerate(items))
    for number in ints:
        if not 0 <= number < size:
            raise param_invalid(arg_name, f"{what} {number} out of range [0, {size})")
    return ints


def check_range(arg_name: str, value: object, *, allow_none: bool = True) -> range | None:
    """Check a Python layer range: step 1, ``0 <= start < stop``.

    :param allow_none: whether None (meaning "all") is acceptable.
    :returns: the range itself, or None.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    if value is None:
        if allow_none:
            return None
        raise param_invalid(arg_name, "a range is required")
    if not isinstance(value, range):
        raise param_invalid(arg_name, f"expected a range, got {_type_name(value)}")
    if value.step != 1:
        raise param_invalid(arg_name, f"step must be 1, got {value.step}")
    if value.start < 0:
        raise param_invalid(arg_name, f"start must be >= 0, got {value.start}")
    if value.stop <= value.start:
        raise param_invalid(arg_name, f"must not be empty, got {value!r}")
    return value


def check_ipv4(arg_name: str, value: object) -> str:
    """Return ``value`` if it is a dotted-quad IPv4 address string.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    check_str(arg_name, value)
    try:
        ipaddress.IPv4Address(value)
    except ValueError:
        raise param_invalid(arg_name, f"not an IPv4 address: {value!r}") from None
    return value  # type: ignore[return-value]
