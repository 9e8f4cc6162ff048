"""The tuning knobs read from the environment at import (``aio_datadist._env``): a value that is not one is
named in a warning and the default kept; the library still imports (a bad value raised at import before)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys

import pytest

from aio_datadist._env import env_int

#: Every knob, its module and attribute, its default, and a value of the right kind.
KNOBS = [
    ("AIO_DATADIST_LOOP_IO_MAX", "aio_datadist.links", "LOOP_IO_MAX", 16 << 20, "0"),
    ("AIO_DATADIST_LOOP_LOWAT_MAX", "aio_datadist.links", "LOOP_LOWAT_MAX", 1 << 20, "65536"),
    ("AIO_DATADIST_INLINE_COPY_MAX", "aio_datadist.transport.same_host", "INLINE_COPY_MAX", 2 << 20, "4096"),
    ("AIO_DATADIST_STREAM_COPY_MIN", "aio_datadist.transport.same_host", "STREAM_COPY_MIN", 2 << 20, "1048576"),
    ("AIO_DATADIST_NIXL_INLINE_MAX", "aio_datadist.transport.nixl_engine", "INLINE_MAX", 16 << 20, "0"),
    ("AIO_DATADIST_NIXL_CHUNK", "aio_datadist.transport.nixl_engine", "CHUNK_BYTES", 64 << 20, "1048576"),
    ("AIO_DATADIST_CUDA_POLL_US", "aio_datadist.devices.streams", "CUDA_POLL_US", 2000, "0"),
]


@pytest.mark.parametrize(("text", "value", "warned"), [
    (None, 123, False), ("", 123, False), ("  ", 123, False), ("0", 0, False), ("4096", 4096, False),
    (" 18446744073709551615 ", 2 ** 64 - 1, False), ("-1", 123, True), ("18446744073709551616", 123, True),
    ("abc", 123, True), ("2M", 123, True), ("1e6", 123, True), ("+5", 123, True), ("1_000", 123, True),
    ("\uff12\uff10", 123, True), ("0x10", 123, True)])
def test_a_size_from_the_environment_names_the_variable_when_it_is_not_one(monkeypatch, caplog, text, value,
                                                                             warned):
    if text is None:
        monkeypatch.delenv("AIO_DATADIST_TEST_BYTES", raising=False)
    else:
        monkeypatch.setenv("AIO_DATADIST_TEST_BYTES", text)
    with caplog.at_level(logging.WARNING, logger="aio_datadist.env"):
        assert env_int("AIO_DATADIST_TEST_BYTES", 123) == value
    assert ("$AIO_DATADIST_TEST_BYTES" in caplog.text) == warned


def test_a_knob_with_a_range_of_its_own_refuses_past_it(monkeypatch, caplog):
    monkeypatch.setenv("AIO_DATADIST_TEST_US", str(2 ** 31))
    with caplog.at_level(logging.WARNING, logger="aio_datadist.env"):
        assert env_int("AIO_DATADIST_TEST_US", 7, high=2 ** 31, unit="microseconds") == 7
    assert "$AIO_DATADIST_TEST_US='2147483648' is not microseconds" in caplog.text
    monkeypatch.setenv("AIO_DATADIST_TEST_US", str(2 ** 31 - 1))
    assert env_int("AIO_DATADIST_TEST_US", 7, high=2 ** 31, unit="microseconds") == 2 ** 31 - 1


def _import_knobs(values: dict[str, str]) -> subprocess.CompletedProcess:
    """Import every knob's module in a fresh interpreter with ``values`` in its environment; print each knob."""
    code = "import importlib\n" + "".join(
        f"print({name!r}, importlib.import_module({module!r}).{attr})\n" for name, module, attr, _, _ in KNOBS)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AIO_DATADIST_")} | values
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)


def test_bad_knobs_are_named_and_the_library_imports_with_the_defaults():
    bad = {"AIO_DATADIST_LOOP_IO_MAX": "16M", "AIO_DATADIST_LOOP_LOWAT_MAX": "-1",
           "AIO_DATADIST_INLINE_COPY_MAX": "2.5", "AIO_DATADIST_STREAM_COPY_MIN": "off",
           "AIO_DATADIST_NIXL_INLINE_MAX": "1e6", "AIO_DATADIST_NIXL_CHUNK": "-1",
           "AIO_DATADIST_CUDA_POLL_US": "2147483648"}
    done = _import_knobs(bad)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [f"{name} {default}" for name, _, _, default, _ in KNOBS]
    for name, text in bad.items():
        assert f"${name}={text!r} is not" in done.stderr, name


def test_good_knobs_are_taken():
    done = _import_knobs({name: good for name, _, _, _, good in KNOBS})
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[:-1] == [f"{name} {int(good)}" for name, _, _, _, good in KNOBS]
    assert "is not" not in done.stderr


def test_a_knobs_own_meaning_of_its_edges_is_kept():
    """0 NIXL piece bytes: no pieces (the largest piece); a low-water mark past 1 GiB: 1 GiB (a C int below)."""
    done = _import_knobs({"AIO_DATADIST_NIXL_CHUNK": "0", "AIO_DATADIST_LOOP_LOWAT_MAX": str(1 << 32),
                          "AIO_DATADIST_LOOP_IO_MAX": "0", "AIO_DATADIST_CUDA_POLL_US": str(2 ** 31 - 1)})
    assert done.returncode == 0, done.stderr
    values = dict(line.split(" ") for line in done.stdout.split("\n")[:-1])
    assert values["AIO_DATADIST_NIXL_CHUNK"] == str(1 << 62)
    assert values["AIO_DATADIST_LOOP_LOWAT_MAX"] == str(1 << 30)
    assert values["AIO_DATADIST_LOOP_IO_MAX"] == "0"
    assert values["AIO_DATADIST_CUDA_POLL_US"] == str(2 ** 31 - 1)
    assert "is not" not in done.stderr


def test_a_knob_of_more_digits_than_int_converts_is_named_and_the_library_imports(monkeypatch, caplog):
    """A value of more than 4300 digits (sys.get_int_max_str_digits()) is a bad knob like any other: a warning and
    the default, never a ValueError at import."""
    huge = "1" * 5000
    monkeypatch.setenv("AIO_DATADIST_TEST_BYTES", huge)
    with caplog.at_level(logging.WARNING, logger="aio_datadist.env"):
        assert env_int("AIO_DATADIST_TEST_BYTES", 123) == 123
    assert "$AIO_DATADIST_TEST_BYTES" in caplog.text
    done = _import_knobs({"AIO_DATADIST_LOOP_IO_MAX": huge})
    assert done.returncode == 0, done.stderr[-300:]
    assert done.stdout.split("\n")[0] == f"AIO_DATADIST_LOOP_IO_MAX {16 << 20}"
