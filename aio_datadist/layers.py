"""Layer ranges to tensor spans, for pull, push and layer-wise transfer calls.

Layer ``L`` of a cache covers tensor indices ``[L*N, L*N + N)`` with
``N = tensor_num_per_layer`` (2 by default: K and V), so memory is laid out
K0, V0, K1, V1, ... A range comes either as a Python ``range`` (half-open,
step 1, non-empty; the Python API) or as an inclusive ``(first, second)``
pair (``KvCacheExtParam``, the C++ API), where ``(-1, -1)`` means all layers.
None also means all layers.
"""

from __future__ import annotations

from typing import NamedTuple

from .status import check_instance, check_int, check_range, param_invalid
from .types import ALL_LAYERS, MAX_NUM_TENSORS, KvCacheExtParam, check_layer_pair

__all__ = ["TensorSpan", "LayerRange", "resolve_tensor_span", "resolve_ext_param"]

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


def _inclusive_layers(arg_name: str, value: object) -> tuple[int, int] | None:
    """``(first, last)`` layer indices, or None for all layers."""
    if value is None:
        return None
    if isinstance(value, range):
        check_range(arg_name, value)
        return (value.start, value.stop - 1)
    if isinstance(value, (tuple, list)):
        pair = check_layer_pair(arg_name, value)
        return None if pair == ALL_LAYERS else pair
    raise param_invalid(
        arg_name, f"expected a range, an inclusive (first, second) pair or None, got {type(value).__name__}"
    )


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
    src_layers = _inclusive_layers(src_name, src_range)
    dst_layers = _inclusive_layers(dst_name, dst_range)

    if src_layers is None and dst_layers is None:
        if src_total != dst_total:
            raise param_invalid(
                dst_name,
                f"all layers selected but the source has {src_total} tensors and the destination "
                f"{dst_total}; give layer ranges",
            )
        return TensorSpan(0, 0, src_total)

    for side, total in (("source", src_total), ("destination", dst_total)):
        if total % per_layer:
            raise param_invalid(
                per_layer_name,
                f"{per_layer} does not divide the {side} cache's {total} tensors (required with layer ranges)",
            )

    def span(name: str, layers: tuple[int, int] | None, total: int) -> tuple[int, int]:
        if layers is None:
            return (0, total)
        num_layers = total // per_layer
        first, last = layers
        if last >= num_layers:
            raise param_invalid(name, f"layer {last} out of range [0, {num_layers})")
        return (first * per_layer, (last - first + 1) * per_layer)

    src_first, src_count = span(src_name, src_layers, src_total)
    dst_first, dst_count = span(dst_name, dst_layers, dst_total)
    if src_count != dst_count:
        culprit = dst_name if dst_layers is not None else src_name
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
