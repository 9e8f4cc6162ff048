"""Layer ranges to tensor spans (reference 4.5 and the PushKvBlocks seed)."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from aio_datadist.layers import TensorSpan, resolve_ext_param, resolve_tensor_span
from aio_datadist.status import LLMException, LLMStatusCode
from aio_datadist.types import KvCacheExtParam


@contextmanager
def param_invalid_naming(name: str) -> Iterator[None]:
    with pytest.raises(LLMException) as info:
        yield
    assert info.value.status_code == LLMStatusCode.LLM_PARAM_INVALID
    assert f"'{name}" in str(info.value), str(info.value)


@pytest.mark.parametrize(
    ("src_n", "dst_n", "kwargs", "expected"),
    [
        (8, 8, {}, (0, 0, 8)),
        (7, 7, {}, (0, 0, 7)),  # no ranges: N need not divide
        (6, 6, {"tensor_num_per_layer": 4}, (0, 0, 6)),
        (8, 4, {"src_layer_range": range(1, 3)}, (2, 0, 4)),
        (8, 8, {"src_layer_range": range(1, 3), "dst_layer_range": range(2, 4)}, (2, 4, 4)),
        (8, 8, {"src_layer_range": (1, 2), "dst_layer_range": (2, 3)}, (2, 4, 4)),
        (8, 8, {"src_layer_range": (1, 2), "dst_layer_range": range(2, 4)}, (2, 4, 4)),
        (8, 8, {"src_layer_range": (-1, -1), "dst_layer_range": [-1, -1]}, (0, 0, 8)),
        (8, 8, {"src_layer_range": None, "dst_layer_range": range(0, 4)}, (0, 0, 8)),
        (4, 8, {"dst_layer_range": range(2, 4)}, (0, 4, 4)),
        (9, 3, {"src_layer_range": range(2, 3), "tensor_num_per_layer": 3}, (6, 0, 3)),
        (8, 8, {"src_layer_range": range(7, 8), "dst_layer_range": (0, 0), "tensor_num_per_layer": 1}, (7, 0, 1)),
        (12, 12, {"src_layer_range": range(0, 1), "dst_layer_range": (2, 2), "tensor_num_per_layer": 4}, (0, 8, 4)),
    ],
)
def test_resolve_tensor_span(src_n: int, dst_n: int, kwargs: dict[str, object], expected: tuple[int, int, int]) -> None:
    span = resolve_tensor_span(src_n, dst_n, **kwargs)  # type: ignore[arg-type]
    assert span == TensorSpan(*expected)
    assert span.src_indices == range(expected[0], expected[0] + expected[2])
    assert span.dst_indices == range(expected[1], expected[1] + expected[2])


@pytest.mark.parametrize(
    ("src_n", "dst_n", "kwargs", "name"),
    [
        (8, 6, {}, "dst_layer_range"),
        (8, 8, {"tensor_num_per_layer": 0}, "tensor_num_per_layer"),
        (8, 8, {"tensor_num_per_layer": 256}, "tensor_num_per_layer"),
        (8, 8, {"tensor_num_per_layer": "2"}, "tensor_num_per_layer"),
        (8, 8, {"src_layer_range": range(0, 1), "tensor_num_per_layer": 3}, "tensor_num_per_layer"),
        (8, 6, {"src_layer_range": (0, 0), "tensor_num_per_layer": 4}, "tensor_num_per_layer"),
        (8, 8, {"src_layer_range": range(3, 5)}, "src_layer_range"),
        (8, 8, {"src_layer_range": (3, 4), "dst_layer_range": (0, 1)}, "src_layer_range"),
        (8, 8, {"dst_layer_range": (0, 4), "src_layer_range": (0, 4)}, "src_layer_range"),
        (8, 8, {"src_layer_range": range(0, 2), "dst_layer_range": range(0, 3)}, "dst_layer_range"),
        (8, 8, {"src_layer_range": range(0, 2)}, "src_layer_range"),
        (8, 8, {"dst_layer_range": (0, 0)}, "dst_layer_range"),
        (8, 8, {"src_layer_range": range(0, 4, 2)}, "src_layer_range"),
        (8, 8, {"src_layer_range": range(2, 2)}, "src_layer_range"),
        (8, 8, {"src_layer_range": range(-1, 2)}, "src_layer_range"),
        (8, 8, {"src_layer_range": (2, 1)}, "src_layer_range"),
        (8, 8, {"src_layer_range": (-1, 1)}, "src_layer_range"),
        (8, 8, {"src_layer_range": (-2, -2)}, "src_layer_range"),
        (8, 8, {"src_layer_range": (0, 1, 2)}, "src_layer_range"),
        (8, 8, {"dst_layer_range": "0:2"}, "dst_layer_range"),
        (8, 8, {"dst_layer_range": 2}, "dst_layer_range"),
        (8, 8, {"dst_layer_range": (0.0, 1)}, "dst_layer_range"),
        (0, 8, {}, "src_num_tensors"),
        (8, "8", {}, "dst_num_tensors"),
    ],
)
def test_resolve_tensor_span_rejects(src_n: object, dst_n: object, kwargs: dict[str, object], name: str) -> None:
    with param_invalid_naming(name):
        resolve_tensor_span(src_n, dst_n, **kwargs)  # type: ignore[arg-type]


def test_resolve_ext_param() -> None:
    assert resolve_ext_param(80, 80, None) == TensorSpan(0, 0, 80)
    assert resolve_ext_param(80, 80, KvCacheExtParam()) == TensorSpan(0, 0, 80)
    assert resolve_ext_param(80, 40, KvCacheExtParam((20, 39), (-1, -1))) == TensorSpan(40, 0, 40)
    assert resolve_ext_param(9, 9, KvCacheExtParam((1, 1), (2, 2), 3)) == TensorSpan(3, 6, 3)


@pytest.mark.parametrize(
    ("src_n", "dst_n", "param", "field"),
    [
        (8, 8, KvCacheExtParam((0, 4), (0, 4)), "src_layer_range"),
        (8, 8, KvCacheExtParam((0, 1), (0, 2)), "dst_layer_range"),
        (8, 8, KvCacheExtParam((0, 1), (-1, -1)), "src_layer_range"),
        (8, 8, KvCacheExtParam((0, 0), (0, 0), 3), "tensor_num_per_layer"),
        (8, 4, KvCacheExtParam(), "dst_layer_range"),
    ],
)
def test_resolve_ext_param_rejects(src_n: int, dst_n: int, param: KvCacheExtParam, field: str) -> None:
    with param_invalid_naming(f"ext_param.{field}"):
        resolve_ext_param(src_n, dst_n, param)


def test_resolve_ext_param_rejects_other_types() -> None:
    with param_invalid_naming("ext_param"):
        resolve_ext_param(8, 8, (0, 1))  # type: ignore[arg-type]


@st.composite
def layered_pair(draw: st.DrawFn) -> tuple[int, int, int, range, range]:
    per_layer = draw(st.integers(1, 4))
    src_layers = draw(st.integers(1, 24))
    dst_layers = draw(st.integers(1, 24))
    length = draw(st.integers(1, min(src_layers, dst_layers)))
    src_start = draw(st.integers(0, src_layers - length))
    dst_start = draw(st.integers(0, dst_layers - length))
    return (
        per_layer,
        src_layers * per_layer,
        dst_layers * per_layer,
        range(src_start, src_start + length),
        range(dst_start, dst_start + length),
    )


@given(layered_pair())
def test_ranges_map_to_layer_major_tensor_indices(case: tuple[int, int, int, range, range]) -> None:
    per_layer, src_n, dst_n, src, dst = case
    span = resolve_tensor_span(src_n, dst_n, src_layer_range=src, dst_layer_range=dst, tensor_num_per_layer=per_layer)
    assert span == TensorSpan(src.start * per_layer, dst.start * per_layer, len(src) * per_layer)
    covered = [i for layer in src for i in range(layer * per_layer, layer * per_layer + per_layer)]
    assert list(span.src_indices) == covered
    inclusive = KvCacheExtParam((src.start, src.stop - 1), (dst.start, dst.stop - 1), per_layer)
    assert resolve_ext_param(src_n, dst_n, inclusive) == span


@given(layered_pair(), st.integers(1, 3))
def test_unequal_range_lengths_are_rejected(case: tuple[int, int, int, range, range], extra: int) -> None:
    per_layer, src_n, dst_n, src, dst = case
    longer = range(dst.start, dst.stop + extra)
    with param_invalid_naming("dst_layer_range"):
        resolve_tensor_span(src_n, dst_n, src_layer_range=src, dst_layer_range=longer, tensor_num_per_layer=per_layer)


@given(st.integers(1, 4), st.integers(1, 24), st.integers(0, 30), st.integers(1, 30))
def test_layers_past_the_end_are_rejected(per_layer: int, layers: int, start: int, length: int) -> None:
    assume(start + length > layers)
    src = range(start, start + length)
    with param_invalid_naming("src_layer_range"):
        resolve_tensor_span(
            layers * per_layer,
            30 * per_layer,
            src_layer_range=src,
            dst_layer_range=range(0, length),
            tensor_num_per_layer=per_layer,
        )
