"""The package's import structure: no import cycle, and imports only go down the layers.

Every import counts: module-level, inside functions, and under ``if
TYPE_CHECKING:`` (a lower layer naming an upper layer's type still depends on
it); so do ``importlib.import_module("aio_datadist....")`` calls with a literal
name. A callback that must go up is injected instead (docs/architecture.md).
Importing ``a.b.c`` also runs the package ``a/b/__init__.py``; that implicit
import is not counted (package ``__init__`` files are kept light for it).
"""

from __future__ import annotations

import ast
import fnmatch
import re
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = "aio_datadist"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

# Lowest first. A module may import modules of its own layer or of lower ones.
# Every module of the package must be listed: a new module is placed deliberately.
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("native core", ("_core",)),
    ("status, values, config, wire and leaf helpers", (
        "status", "_checks", "_forks", "types", "option_checks", "options", "config",
        "wire", "protocol", "_settle", "fd_budget", "refusal_log", "mapped",
        "tensors", "ranktable", "stats", "_trace", "_env", "logfields", "control_reader", "own_dials",
        "devices.unmapping", "devices.headroom", "views", "spans",
    )),
    ("completions, layer rule, caches and registries", (
        "_completion", "loop_io", "layers", "cache", "arrivals", "plans", "devices.host",
    )),
    ("devices and runtime", (
        "devices", "devices.backend", "devices.streams", "devices.cuda", "devices.npu", "devices.kernels",
        "devices.copies", "devices.ops", "devices.staging", "devices.ipc", "devices.peer_cache", "devices.host_backend",
        "devices.cuda_vmm", "runtime",
    )),
    ("transport planes", (
        "transport", "transport.base", "transport.fit", "transport.ledger", "transport.local", "transport.nixl",
        "transport.nixl_agent", "transport.nixl_engine", "transport.nixl_grants", "transport.nixl_offers",
        "transport.tls", "transport.stream", "transport.staging", "transport.same_host", "transport.device_ipc",
        "transport.nixl_plane",
    )),
    ("handshake, links, listener and link table", (
        "handshake", "link_control", "link_channels", "links", "admission", "listener", "link_dials", "link_table",
        "endpoint", "owners", "bilateral",
    )),
    ("requester and owner, tasks, layer-wise, leases", (
        "transfers", "owner", "task", "layerwise", "leases",
    )),
    ("managers", ("manager", "cache_manager")),
    ("LLMDataDist", ("datadist",)),
    ("compat, testing, demo, command line and the package", (
        "compat", "_compat_v2", "testing", "_negotiated_transport", "metrics", "demo", "__main__", "synchronizers", "",
    )),
    ("integrations with serving engines (vLLM is imported only by integrations.vllm)", (
        "integrations", "integrations.vllm_wire", "integrations.vllm_auth", "integrations.vllm_state",
        "integrations.vllm_agent", "integrations.vllm",
    )),
)


def _full(name: str) -> str:
    return f"{PACKAGE}.{name}" if name else PACKAGE


LAYER_OF = {_full(name): index for index, (_, names) in enumerate(LAYERS) for name in names}


@dataclass(frozen=True)
class Edge:
    importer: str
    imported: str
    line: int
    type_only: bool


def _modules() -> dict[str, Path | None]:
    """Module name -> its source (None for a compiled module without Python source)."""
    found: dict[str, Path | None] = {}
    for path in sorted(ROOT.rglob("*")):
        if "__pycache__" in path.parts or path.suffix not in (".py", ".pyx"):
            continue
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        name = ".".join(parts)
        if path.suffix == ".py":
            found[name] = path
        else:
            found.setdefault(name, None)  # Cython: cimports are not Python imports
    return found


MODULES = _modules()


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _package_module(name: str) -> str | None:
    """The longest package module ``name`` names (``a.b.C`` -> ``a.b``), or None outside the package."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


class _Imports(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool) -> None:
        self.module = module
        self.is_package = is_package
        self.edges: list[Edge] = []
        self._type_only = 0

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):
            self._type_only += 1
            for child in node.body:
                self.visit(child)
            self._type_only -= 1
            for child in node.orelse:
                self.visit(child)
        else:
            self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            parts = self.module.split(".")
            if not self.is_package:
                parts.pop()
            parts = parts[:len(parts) - (node.level - 1)]
            base = ".".join(parts + ([node.module] if node.module else []))
        else:
            base = node.module or ""
        for alias in node.names:
            sub = f"{base}.{alias.name}"  # `from pkg import module` names a module
            self._add(sub if sub in MODULES else base, node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if (name == "import_module" and node.args and isinstance(node.args[0], ast.Constant)
                and isinstance(node.args[0].value, str)):
            self._add(node.args[0].value, node.lineno)
        self.generic_visit(node)

    def _add(self, name: str, line: int) -> None:
        target = _package_module(name)
        if target is not None and target != self.module:
            self.edges.append(Edge(self.module, target, line, self._type_only > 0))


def _edges() -> list[Edge]:
    edges: list[Edge] = []
    for module, path in MODULES.items():
        if path is None:
            continue
        visitor = _Imports(module, path.name == "__init__.py")
        visitor.visit(ast.parse(path.read_text(), str(path)))
        edges.extend(visitor.edges)
    return edges


EDGES = _edges()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 10 * len(graph) + 100))
    try:
        for v in sorted(graph):
            if v not in index:
                visit(v)
    finally:
        sys.setrecursionlimit(limit)
    return found


def _layer_name(module: str) -> str:
    index = LAYER_OF[module]
    return f"[layer {index}: {LAYERS[index][0]}]"


def test_the_import_graph_is_read() -> None:
    """The scan finds known edges of each kind, so the tests below cannot pass by reading nothing."""
    assert len(MODULES) > 30 and f"{PACKAGE}._core" in MODULES and MODULES[f"{PACKAGE}._core"] is None
    pairs = {(e.importer, e.imported) for e in EDGES}
    assert (f"{PACKAGE}.option_checks", f"{PACKAGE}._checks") in pairs  # relative, module level
    assert (f"{PACKAGE}.runtime", f"{PACKAGE}._core") in pairs  # `from aio_datadist import _core`
    assert any(e.type_only for e in EDGES)  # under TYPE_CHECKING
    assert any(e.importer == f"{PACKAGE}.testing" and e.imported == PACKAGE for e in EDGES)  # in functions


def test_no_import_cycle() -> None:
    """No circle among the package's modules, type-only imports counted."""
    graph: dict[str, set[str]] = {module: set() for module in MODULES}
    for edge in EDGES:
        graph[edge.importer].add(edge.imported)
    cycles = _cycles(graph)
    assert not cycles, "import cycles (type-only imports count):\n" + "\n".join(
        "  " + " <-> ".join(cycle) for cycle in cycles)


def test_every_module_has_a_layer() -> None:
    """A new module is placed in LAYERS deliberately; a removed one leaves it."""
    missing = sorted(set(MODULES) - set(LAYER_OF))
    assert not missing, f"modules missing from LAYERS in {Path(__file__).name}: {missing}"
    stale = sorted(set(LAYER_OF) - set(MODULES))
    assert not stale, f"LAYERS names modules that do not exist: {stale}"
    listed = [name for _, names in LAYERS for name in names]
    assert len(listed) == len(set(listed)), "a module is listed in two layers"


def test_imports_go_down_the_layers() -> None:
    """Every import (module level, in a function, or type-only) goes to the same or a lower layer."""
    upward = [
        e for e in EDGES
        if e.importer in LAYER_OF and e.imported in LAYER_OF and LAYER_OF[e.imported] > LAYER_OF[e.importer]
    ]
    assert not upward, f"{len(upward)} upward import(s):\n" + "\n".join(
        f"  {e.importer} {_layer_name(e.importer)} imports {e.imported} {_layer_name(e.imported)}"
        f"{' under TYPE_CHECKING' if e.type_only else ''}, line {e.line}"
        for e in sorted(upward, key=lambda e: (e.importer, e.line)))


def test_the_architecture_doc_places_every_module_in_its_layer() -> None:
    """docs/architecture.md's layer table names every module in the row of the layer it is in here (a ``name*``
    entry covers the modules it matches; the package itself is "the package ``__init__``")."""
    doc = (ROOT.parent / "docs" / "architecture.md").read_text()
    rows = {int(m[1]): m[2] for m in re.finditer(r"^\| (\d+) \| [^|]+ \| (.+) \|$", doc, re.MULTILINE)}
    assert sorted(rows) == list(range(len(LAYERS))), "the table has one row per layer, numbered from 0"
    missing = []
    for index, (_, names) in enumerate(LAYERS):
        named = re.findall(r"`([^`]+)`", rows[index])
        for name in names:
            found = ("the package" in rows[index]) if not name else any(
                fnmatch.fnmatchcase(name, entry) for entry in named)
            if not found:
                missing.append(f"{name or 'the package'} (layer {index})")
    assert not missing, "absent from docs/architecture.md's layer table: " + ", ".join(missing)


@pytest.mark.parametrize("source, expected", [
    ("from . import wire", "aio_datadist.wire"),
    ("from .devices.host import seal_names", "aio_datadist.devices.host"),
    ("import aio_datadist.cache as c", "aio_datadist.cache"),
    ("from aio_datadist import _core", "aio_datadist._core"),
    ("from aio_datadist import LLMDataDist", "aio_datadist"),
    ("if TYPE_CHECKING:\n    from aio_datadist.manager import KvCacheManager", "aio_datadist.manager"),
    ("def f():\n    from ..transfers import x", None),  # two levels up from a top module: outside the package
    ("importlib.import_module('aio_datadist.transport.nixl')", "aio_datadist.transport.nixl"),
])
def test_the_scanner_resolves(source: str, expected: str | None) -> None:
    visitor = _Imports(f"{PACKAGE}.links", is_package=False)
    visitor.visit(ast.parse(source))
    assert [e.imported for e in visitor.edges] == ([expected] if expected else [])
