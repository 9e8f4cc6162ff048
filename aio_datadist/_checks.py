"""Argument checks: every bad argument becomes ``LLMException(LLM_PARAM_INVALID)``.

Each ``check_*`` returns the checked value (converted where it says so) or
raises the error :func:`param_invalid` builds, whose message names the
argument as the caller spelt it: ``"invalid argument '<name>': <why>"``.

Where llm_datadist raises ``TypeError`` (its ``check_isinstance``: a value of
the wrong type) or ``ValueError`` (its ``check_uint*``/``check_int*``: an int
outside the type's width), the error is a :class:`ParamTypeError` or
:class:`ParamValueError`: still ``LLMException(LLM_PARAM_INVALID)``, and also
the built-in exception llm_datadist callers catch (vllm-ascend reports
``except (TypeError, ValueError)`` as a bad parameter, ``except LLMException``
as a transfer failure, in that order).
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import operator
import re
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, TypeVar

from .status import LLMException, LLMStatusCode

__all__ = [
    "ParamTypeError",
    "ParamValueError",
    "param_invalid",
    "param_type_error",
    "param_value_error",
    "named_as",
    "named_by_caller",
    "check_instance",
    "check_int",
    "check_uint",
    "check_bool",
    "check_str",
    "check_index",
    "check_indices",
    "check_range",
    "check_ipv4",
    "check_json_object",
    "shown",
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


def param_invalid(arg_name: str, why: str) -> LLMException:
    """Build (not raise) the error for a bad argument.

    :param arg_name: the argument's name as the caller spelt it.
    :param why: what is wrong, e.g. ``"block index 70 out of range [0, 64)"``.
    :returns: ``LLMException(LLM_PARAM_INVALID)`` with the message
        ``"invalid argument '<arg_name>': <why>"``.
    """
    return LLMException(f"invalid argument '{arg_name}': {why}", status_code=LLMStatusCode.LLM_PARAM_INVALID,
                        argument=arg_name)


class ParamTypeError(LLMException, TypeError):
    """A wrong-typed argument: ``LLMException(LLM_PARAM_INVALID)`` and ``TypeError``, where
    llm_datadist raises ``TypeError``."""


class ParamValueError(LLMException, ValueError):
    """An int outside its type's width (uint64, uint32, ...): ``LLMException(LLM_PARAM_INVALID)``
    and ``ValueError``, where llm_datadist raises ``ValueError``."""


def param_type_error(arg_name: str, why: str) -> ParamTypeError:
    """:func:`param_invalid` for a value of the wrong type (also a ``TypeError``)."""
    return ParamTypeError(f"invalid argument '{arg_name}': {why}", status_code=LLMStatusCode.LLM_PARAM_INVALID,
                          argument=arg_name)


def param_value_error(arg_name: str, why: str) -> ParamValueError:
    """:func:`param_invalid` for an int outside its type's width (also a ``ValueError``)."""
    return ParamValueError(f"invalid argument '{arg_name}': {why}", status_code=LLMStatusCode.LLM_PARAM_INVALID,
                           argument=arg_name)


def named_as(exc: LLMException, names: Mapping[str, str]) -> LLMException:
    """``exc`` with the argument it names said in the caller's words, else ``exc`` itself.

    An owner checks a request in its own words (``'dst_cache_key.batch_index'``) and a call of ours may
    pass one argument on under another name (a v2 call through the v1 one); only the call knows what its
    caller wrote. ``names`` maps an argument, or the head of a dotted or indexed one, to the caller's name:
    ``{"dst_cache_key": "dst_cache_index_or_key"}`` turns ``'dst_cache_key.batch_index'`` into
    ``'dst_cache_index_or_key.batch_index'``. A message with no ``invalid argument '...'`` is left as it is;
    an ``LLM_PARAM_INVALID`` one that has it also gets :attr:`LLMException.argument` (an owner's refusal
    comes as text).
    """
    message = str(exc.args[0]) if exc.args else ""
    found = _NAMED.search(message)
    if found is None:
        return exc
    arg = found.group(1)
    head = _HEAD.match(arg)
    rest = arg[head.end():] if head else ""
    new = names.get(arg) or (names[head.group(0)] + rest if head and head.group(0) in names else arg)
    argument = new if exc.status_code == LLMStatusCode.LLM_PARAM_INVALID else exc.argument
    if new == arg and exc.argument == argument:
        return exc
    renamed = type(exc)(message[:found.start(1)] + new + message[found.end(1):], status_code=exc.status_code,
                        argument=argument)
    return renamed.with_traceback(exc.__traceback__)


@contextlib.contextmanager
def named_by_caller(names: Mapping[str, str]) -> Iterator[None]:
    """An :class:`LLMException` out of the block that names an argument in ``names`` (an inner call's
    name, or an owner's) names the caller's instead (:func:`named_as`), with the cause ``exc`` had."""
    try:
        yield
    except LLMException as exc:
        said = named_as(exc, names)
        if said is exc:
            raise
        raise said from exc.__cause__


_NAMED = re.compile(r"invalid argument '([^']+)'")
_HEAD = re.compile(r"[A-Za-z_][A-Za-z_0-9]*")


_INT_ONLY = {int}


def _type_name(value: object) -> str:
    return type(value).__name__


def check_instance(arg_name: str, value: Any, types: type[_T] | tuple[type, ...]) -> _T:
    """Return ``value`` if it is an instance of ``types``.

    :raises ParamTypeError: ``LLM_PARAM_INVALID`` naming ``arg_name`` otherwise.
    """
    if not isinstance(value, types):
        expected = " or ".join(t.__name__ for t in types) if isinstance(types, tuple) else types.__name__
        raise param_type_error(arg_name, f"expected {expected}, got {_type_name(value)}")
    return value  # type: ignore[return-value]  # isinstance above (typing.cast would be a call per check)


#: The dtypes of 0-d bool tensors and arrays, whose ``__index__`` reads 0 or 1 (numpy's ``bool_`` has none).
_BOOL_DTYPES = frozenset({"torch.bool", "bool"})


def check_int(arg_name: str, value: object, *, lo: int | None = None, hi: int | None = None) -> int:
    """Return ``value`` as an ``int``, checking its type and bounds.

    Anything with ``__index__`` (numpy and 0-d torch integers too) counts as
    an int; ``bool`` does not, nor does a 0-d bool tensor, nor an array of
    one element (``torch.tensor([3])``).

    :param lo: smallest allowed value (inclusive), or None.
    :param hi: largest allowed value (inclusive), or None.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name`` (a
        :class:`ParamTypeError` for a value that is not an int).
    """
    if isinstance(value, bool) or str(getattr(value, "dtype", "")) in _BOOL_DTYPES:
        raise param_type_error(arg_name, "expected an int, got bool")
    if getattr(value, "ndim", 0):  # torch takes a one-element tensor of any shape as an index
        shape = tuple(getattr(value, "shape", ()))
        raise param_type_error(arg_name, f"expected an int, got a {_type_name(value)} of shape {shape}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise param_type_error(arg_name, f"expected an int, got {_type_name(value)}") from None
    if (lo is not None and number < lo) or (hi is not None and number > hi):
        if hi is None:
            raise param_invalid(arg_name, f"must be >= {lo}, got {shown(number)}")
        if lo is None:
            raise param_invalid(arg_name, f"must be <= {hi}, got {shown(number)}")
        raise param_invalid(arg_name, f"must be in [{lo}, {hi}], got {shown(number)}")
    return number


def shown(value: object) -> str:
    """``repr(value)`` for a message; an int (or what holds one, a range) too long for ``str`` (more than
    ``sys.get_int_max_str_digits()`` digits: ValueError) is told by its size instead, so a check's refusal is its
    ``LLMException``, not that ValueError."""
    try:
        return repr(value)
    except ValueError:
        if isinstance(value, int):
            return f"an int of {value.bit_length()} bits"
        return f"a {type(value).__name__} holding an int too long to print"


def check_uint(arg_name: str, value: object, bits: int = 64) -> int:
    """Return ``value`` as an int in ``[0, 2**bits - 1]``.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``: a
        :class:`ParamTypeError` for a value that is not an int, a
        :class:`ParamValueError` for one outside the range.
    """
    number = check_int(arg_name, value)
    if not 0 <= number < (1 << bits):
        raise param_value_error(arg_name, f"must be a uint{bits} in [0, {(1 << bits) - 1}], got {shown(number)}")
    return number


def check_sint(arg_name: str, value: object, bits: int = 64) -> int:
    """Return ``value`` as an int in ``[-2**(bits-1), 2**(bits-1) - 1]`` (LLM-DataDist's ``check_int32`` and
    ``check_int64``).

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``: a
        :class:`ParamTypeError` for a value that is not an int, a
        :class:`ParamValueError` for one outside the range.
    """
    number = check_int(arg_name, value)
    if not -(1 << (bits - 1)) <= number < (1 << (bits - 1)):
        raise param_value_error(arg_name, f"must be an int{bits}, got {shown(number)}")
    return number


def check_bool(arg_name: str, value: object) -> bool:
    """Return ``value`` if it is a ``bool``.

    :raises ParamTypeError: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    if not isinstance(value, bool):
        raise param_type_error(arg_name, f"expected bool, got {_type_name(value)}")
    return value


def check_str(arg_name: str, value: object, *, allow_empty: bool = True) -> str:
    """Return ``value`` if it is a ``str`` (non-empty unless ``allow_empty``).

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name`` (a
        :class:`ParamTypeError` for a value that is not a str).
    """
    if not isinstance(value, str):
        raise param_type_error(arg_name, f"expected str, got {_type_name(value)}")
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
        raise param_invalid(arg_name, f"{what} {shown(number)} out of range [0, {size})")
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
            raise param_type_error(arg_name, f"expected a 1-D sequence of ints, got a 0-d {_type_name(values)}")
        items = tuple(listed)
    else:
        raise param_type_error(arg_name, f"expected a list of ints, got {_type_name(values)}")
    if not items:
        if allow_empty:
            return ()
        raise param_invalid(arg_name, "must not be empty")
    if set(map(type, items)) == _INT_ONLY:  # no Python frame per item
        ints: tuple[int, ...] = items  # type: ignore[assignment]
        if min(ints) >= 0 and max(ints) < size:
            return ints
    else:
        ints = tuple(check_int(f"{arg_name}[{i}]", v) for i, v in enumerate(items))
    for number in ints:
        if not 0 <= number < size:
            raise param_invalid(arg_name, f"{what} {shown(number)} out of range [0, {size})")
    return ints


def check_range(arg_name: str, value: object, *, allow_none: bool = True) -> range | None:
    """Check a Python layer range: step 1, ``0 <= start < stop <= 2**31``.

    :param allow_none: whether None (meaning "all") is acceptable.
    :returns: the range itself, or None.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    if value is None:
        if allow_none:
            return None
        raise param_invalid(arg_name, "a range is required")
    if not isinstance(value, range):
        raise param_type_error(arg_name, f"expected a range, got {_type_name(value)}")
    if value.step != 1:
        raise param_invalid(arg_name, f"step must be 1, got {shown(value.step)}")
    if value.start < 0:
        raise param_invalid(arg_name, f"start must be >= 0, got {shown(value.start)}")
    if value.stop <= value.start:
        raise param_invalid(arg_name, f"must not be empty, got {shown(value)}")
    if value.stop - 1 > INT32_MAX:  # a request carries its layers as int32 (the remote side is checked only there)
        raise param_value_error(arg_name, f"layer {shown(value.stop - 1)} is past {INT32_MAX}, got {shown(value)}")
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


def check_json_object(arg_name: str, text: str, *, unique_keys: bool = False) -> dict[str, Any]:
    """Parse ``text`` as a JSON object.

    :param unique_keys: refuse an object (at any depth) that names one key twice, which JSON parsers
        otherwise settle silently by keeping the last (for maps where a typo must not go unseen).
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name`` for text
        that is not JSON, is nested deeper than the parser's recursion limit,
        or holds something other than an object.
    """

    def once(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise param_invalid(arg_name, f"names the key {key!r} twice")
            seen.add(key)
        return dict(pairs)

    try:
        obj = json.loads(text, object_pairs_hook=once if unique_keys else None)
    except ValueError as exc:
        raise param_invalid(arg_name, f"not valid JSON: {exc}") from None
    except RecursionError:
        raise param_invalid(arg_name, "not valid JSON: nested too deeply") from None
    if not isinstance(obj, dict):
        raise param_invalid(arg_name, f"expected a JSON object, got {type(obj).__name__}")
    return obj
