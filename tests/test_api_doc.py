"""docs/api.md's call signatures match the code: names, order, keyword-only marks and defaults.

A user copies a signature from the reference; a parameter documented as
positional that the code takes by keyword only is a ``TypeError`` in their
code. Each ``name(args)`` in backticks in a class's section is compared with
``inspect.signature`` of that class's method.
"""

from __future__ import annotations

import ast
import inspect
import pathlib
import re
from typing import Any

import pytest

import aio_datadist as aio

API_MD = pathlib.Path(__file__).resolve().parents[1] / "docs" / "api.md"
CLASSES = {
    "LLMDataDist": aio.LLMDataDist,
    "KvCacheManager": aio.KvCacheManager,
    "CacheManager": aio.CacheManager,
    "CacheTask": aio.CacheTask,
    "PushWatch": aio.PushWatch,
    "EventLayerSynchronizer": aio.EventLayerSynchronizer,
}
CALL = re.compile(r"`(?:await )?([a-z_]+)\(([^`]*)\)`")


def _sections() -> dict[str, list[str]]:
    sections: dict[str, list[str]] = {}
    current = ""
    for line in API_MD.read_text().splitlines():
        heading = re.match(r"^#{2,} `?([A-Za-z_]+)", line)
        if heading:
            current = heading.group(1)
        sections.setdefault(current, []).append(line)
    return sections


def _split(args: str) -> list[str]:
    parts, depth, current = [], 0, ""
    for ch in args:
        depth += ch in "([{"
        depth -= ch in ")]}"
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    return [p for p in [*parts, current.strip()] if p]


def _documented(args: str) -> list[tuple[str, str | None, bool]]:
    out, keyword_only = [], False
    for part in _split(args):
        if part == "*":
            keyword_only = True
            continue
        name, _, default = part.partition("=")
        out.append((name.strip(), default.strip() or None, keyword_only))
    return out


def _literal(text: str) -> Any:
    try:
        value = ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return inspect.Parameter.empty  # an example value ("ms"), not a default
    return inspect.Parameter.empty if value is Ellipsis else value


def _signatures() -> list[tuple[str, str, str]]:
    found = []
    for section, lines in _sections().items():
        cls = CLASSES.get(section)
        if cls is None:
            continue
        for line in lines:
            for match in CALL.finditer(line):
                if callable(getattr(cls, match.group(1), None)):
                    found.append((section, match.group(1), match.group(2)))
    return found


def test_the_reference_documents_the_manager_calls() -> None:
    names = {(section, name) for section, name, _ in _signatures()}
    for section in ("KvCacheManager", "CacheManager"):
        for name in ("pull_cache", "pull_blocks", "push_cache", "push_blocks", "copy_blocks", "swap_blocks",
                     "transfer_cache_async", "watch_pushes"):
            assert (section, name) in names, f"docs/api.md's {section} section lacks {name}"


@pytest.mark.parametrize(("section", "name", "args"), _signatures(), ids=lambda v: str(v)[:40])
def test_a_documented_signature_is_the_code_s(section: str, name: str, args: str) -> None:
    signature = inspect.signature(getattr(CLASSES[section], name))
    code = [p for p in signature.parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    documented = _documented(args)
    assert [d[0] for d in documented] == [p.name for p in code], f"{section}.{name}{signature}"
    for (doc_name, doc_default, doc_keyword_only), param in zip(documented, code, strict=True):
        assert doc_keyword_only == (param.kind == param.KEYWORD_ONLY), (
            f"{section}.{name}: docs/api.md has {doc_name!r} {'keyword-only' if doc_keyword_only else 'positional'}"
            f", the code {signature}")
        if doc_default is not None and _literal(doc_default) is not inspect.Parameter.empty:
            assert param.default is not inspect.Parameter.empty, f"{section}.{name}: {doc_name} has no default"
            assert _literal(doc_default) == param.default, f"{section}.{name}: {doc_name}={doc_default}"
