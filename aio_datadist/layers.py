"""The layer-range rule: layer selections and the tensor spans they cover.

Layer ``L`` of a cache covers tensor indices ``[L*N, L*N + N)`` with
``N = tensor_num_per_layer`` (2 by default: K and V), so memory is laid out
K0, V0, K1, V1, ... A range comes either as a Python ``range`` (half-open,
step 1, non-empty; the Python API) or as an inclusive ``(first, second)``
pair (``KvCacheExtParam``, the C++ API), where ``(-1, -1)`` means all layers.
None also means all layers.

This module is the one home of that rule: parsing a selection
(:func:`layer_selection`, :func:`layer_pair`, :func:`range_pair`), one
side's span (:func:`one_side_span`), both sides' spans
(:func:`resolve_tensor_span`) and their equal length (:func:`check_spans`).
The primitive checks it builds on sit one layer down, where the values
need them: ``_checks.check_range`` and ``types.check_layer_pair``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ._checks import ParamValueError, check_instance, check_int, check_range, param_invalid, shown
from .status import LLMException
from .types import ALL_LAYERS, MAX_NUM_TENSORS, KvCacheExtParam, check_layer_pair

__all__ = [
    "TensorSpan",
    "LayerRange",
    "resolve_tensor_span",
    "resolve_ext_param",
    "layer_selection",
    "layer_pair",
    "range_pair",
    "one_side_span",
    "check_spans",
]

LayerRange = range | tuple[int, int] | list[int] | None
"""A layer selection: a ``range``, an inclusive pair, or None for all."""


class TensorSpan(NamedTuple):
    """Corresponding runs of tensor indices in the source and destination.

    Source tensor ``src_first + i`` goes to destination tensor
    ``dst_first + i`` for ``i`` in ``range(count)``.
    """

    src_first: int
    dst_first: int
    count: int  # type: ignore[assignment]  # the field hides tuple.count, which no caller wants

    @property
    def src_indices(self) -> range:
        """Source tensor indices."""
        return range(self.src_first, self.src_first + self.count)

    @property
    def dst_indices(self) -> range:
        """Destination tensor indices."""
        return range(self.dst_first, self.dst_first + self.count)


def range_pair(arg_name: str, value: object) -> tuple[int, int]:
    """A Python layer ``range`` (step 1, non-empty) as an inclusive ``(first, last)`` pair.

    The wording of the manager and compat APIs: any malformed value gives
    ``"must be a non-empty range with step 1, got <value>"``.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    try:
        check_range(arg_name, value, allow_none=False)
    except ParamValueError:
        raise  # a layer past int32: a ValueError too, as LLM-DataDist's
    except LLMException:
        raise param_invalid(arg_name, f"must be a non-empty range with step 1, got {shown(value)}") from None
    assert isinstance(value, range)
    return (value.start, value.stop - 1)


def layer_pair(arg_name: str, value: Any) -> tuple[int, int]:
    """A keyword layer selection of the manager API as an inclusive pair, ``(-1, -1)`` for all.

    :param value: None (all layers), a ``range`` or an inclusive pair of ints.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    if value is None:
        return ALL_LAYERS
    if isinstance(value, range):
        return range_pair(arg_name, value)
    if isinstance(value, (tuple, list)) and len(value) == 2 and all(isinstance(v, int) for v in value):
        try:
            return check_layer_pair(arg_name, value)
        except LLMException:
            raise param_invalid(
                arg_name, f"must satisfy 0 <= first <= last (inclusive), got {shown(tuple(value))}"
            ) from None
    raise param_invalid(arg_name, f"expected a range or an inclusive (first, last) pair, got {shown(value)}")


def layer_selection(arg_name: str, value: object) -> tuple[int, int]:
    """A layer selection as an inclusive ``(first, last)`` pair, ``ALL_LAYERS`` for all.

    :param value: None, a ``range`` (checked by ``check_range``) or an
        inclusive pair (checked by ``check_layer_pair``).
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg_name``.
    """
    if value is None:
        return ALL_LAYERS
    if isinstance(value, range):
        check_range(arg_name, value)
        return (value.start, value.stop - 1)
    if isinstance(value, (tuple, list)):
        return check_layer_pair(arg_name, value)
    raise param_invalid(
        arg_name, f"expected a range, an inclusive (first, second) pair or None, got {type(value).__name__}"
    )


def _check_divides(per_layer_name: str, per_layer: int, side: str, total: int) -> None:
    if total % per_layer:
        raise param_invalid(
            per_layer_name,
            f"{per_layer} does not divide the {side} cache's {total} tensors (required with layer ranges)",
        )


def _span(name: str, layers: tuple[int, int], total: int, per_layer: int) -> tuple[int, int]:
    """``(first_tensor, count)`` of one side's selection (``ALL_LAYERS``: the whole cache)."""
    if layers == ALL_LAYERS:
        return (0, total)
    num_layers = total // per_layer
    first, last = layers
    if last >= num_layers:
        raise param_invalid(name, f"layer {last} out of range [0, {num_layers})")
    return (first * per_layer, (last - first + 1) * per_layer)


def _resolve(
    src_num_tensors: object,
    dst_num_tensors: object,
    src_range: object,
    dst_range: object,
    tensor_num_per_layer: object,
    names: tuple[str, str, str],
) -> TensorSpan:
    src_name, dst_name, per_layer_name = names
    src_total = check_int("src_num_tensors", src_num_tensors, lo=1, hi=MAX_NUM_TENSORS)
    dst_total = check_int("dst_num_tensors", dst_num_tensors, lo=1, hi=MAX_NUM_TENSORS)
    per_layer = check_int(per_layer_name, tensor_num_per_layer, lo=1, hi=255)
    src_layers = layer_selection(src_name, src_range)
    dst_layers = layer_selection(dst_name, dst_range)

    if src_layers == ALL_LAYERS and dst_layers == ALL_LAYERS:
        if src_total != dst_total:
            raise param_invalid(
                dst_name,
                f"all layers selected but the source has {src_total} tensors and the destination "
                f"{dst_total}; give layer ranges",
            )
        return TensorSpan(0, 0, src_total)

    _check_divides(per_layer_name, per_layer, "source", src_total)
    _check_divides(per_layer_name, per_layer, "destination", dst_total)
    src_first, src_count = _span(src_name, src_layers, src_total, per_layer)
    dst_first, dst_count = _span(dst_name, dst_layers, dst_total, per_layer)
    if src_count != dst_count:
        culprit = dst_name if dst_layers != ALL_LAYERS else src_name
        raise param_invalid(
            culprit,
            f"the source span has {src_count} tensors ({src_count // per_layer} layers) but the destination "
            f"span has {dst_count} ({dst_count // per_layer} layers); they must be equal",
        )
    return TensorSpan(src_first, dst_first, src_count)


def resolve_tensor_span(
    src_num_tensors: int,
    dst_num_tensors: int,
    *,
    src_layer_range: LayerRange = None,
    dst_layer_range: LayerRange = None,
    tensor_num_per_layer: int = 2,
) -> TensorSpan:
    """Turn layer ranges into the tensor indices to move.

    :param src_num_tensors: ``num_tensors`` of the source cache.
    :param dst_num_tensors: ``num_tensors`` of the destination cache.
    :param src_layer_range: source layers: a ``range`` (half-open, step 1,
        non-empty), an inclusive ``(first, second)`` pair (``(-1, -1)`` =
        all), or None (all).
    :param dst_layer_range: destination layers, same forms.
    :param tensor_num_per_layer: ``N``, tensors per layer (1 to 255).
    :returns: the matching source and destination runs.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``src_layer_range``,
        ``dst_layer_range``, ``tensor_num_per_layer`` (or the tensor counts)
        when:

        - a range is malformed or names a layer ``>= num_tensors // N``;
        - a range is given and ``N`` does not divide either cache's
          ``num_tensors``;
        - the two spans differ in length (a side with "all layers" spans its
          whole cache), in particular when no range is given and the caches
          hold different numbers of tensors.

    With no ranges ``N`` is only range-checked: every tensor moves.
    """
    return _resolve(
        src_num_tensors,
        dst_num_tensors,
        src_layer_range,
        dst_layer_range,
        tensor_num_per_layer,
        ("src_layer_range", "dst_layer_range", "tensor_num_per_layer"),
    )


def resolve_ext_param(
    src_num_tensors: int,
    dst_num_tensors: int,
    ext_param: KvCacheExtParam | None,
) -> TensorSpan:
    """``resolve_tensor_span`` for a ``KvCacheExtParam`` (C++-style inclusive ranges).

    :param src_num_tensors: ``num_tensors`` of the source cache.
    :param dst_num_tensors: ``num_tensors`` of the destination cache.
    :param ext_param: the layer selection, or None for the default (all
        layers, ``tensor_num_per_layer=2``).
    :returns: the matching source and destination runs.
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``ext_param`` (and the
        offending field, e.g. ``'ext_param.src_layer_range'``) under the rules
        of ``resolve_tensor_span``, or when ``ext_param`` is not a
        ``KvCacheExtParam``.
    """
    if ext_param is None:
        ext_param = KvCacheExtParam()
    check_instance("ext_param", ext_param, KvCacheExtParam)
    return _resolve(
        src_num_tensors,
        dst_num_tensors,
        ext_param.src_layer_range,
        ext_param.dst_layer_range,
        ext_param.tensor_num_per_layer,
        ("ext_param.src_layer_range", "ext_param.dst_layer_range", "ext_param.tensor_num_per_layer"),
    )


def one_side_span(num_tensors: int, layers: tuple[int, int], per_layer: int, arg: str) -> tuple[int, int]:
    """``(first_tensor, count)`` one endpoint moves for its own inclusive layer selection.

    :param layers: ``(first, last)``, ``(-1, -1)`` for all layers (as the
        wire carries them; not yet checked).
    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``arg``, or
        ``tensor_num_per_layer`` when that is out of range or does not divide
        ``num_tensors``.
    """
    total = check_int(arg, num_tensors, lo=1, hi=MAX_NUM_TENSORS)
    per = check_int("tensor_num_per_layer", per_layer, lo=1, hi=255)
    if layers == ALL_LAYERS:
        return (0, total)
    check_range(arg, range(layers[0], layers[1] + 1))
    _check_divides("tensor_num_per_layer", per, "source", total)
    return _span(arg, layers, total, per)


def check_spans(src: tuple[int, int], dst: tuple[int, int]) -> None:
    """Both layer selections, when given, must cover the same number of layers.

    :raises LLMException: ``LLM_PARAM_INVALID`` naming ``dst_layer_range``.
    """
    if src != ALL_LAYERS and dst != ALL_LAYERS and src[1] - src[0] != dst[1] - dst[0]:
        raise param_invalid("dst_layer_range", f"covers {dst[1] - dst[0] + 1} layers but "
                            f"src_layer_range covers {src[1] - src[0] + 1}")
