"""Imports point one way: tools -> stages -> engine -> kernels, everything -> schemas, and no
circles. Inside stages/ the runtime is the ground, tenancy and the event log stand on it, the
request-path stages on those, and the edge on top; the module that assembles a package is
imported by none of its parts.

The graph is read with `ast` from every module of the five packages: imports at module level
and inside functions alike, relative ones resolved, `from x import y` taken as the submodule
`x.y` when there is one, `if TYPE_CHECKING:` imports counted too. `import a.b` is an import of
`a.b` (the packages' `__init__` modules around it import nothing of the project). Imports by a
string (importlib) are not seen.
"""

from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tools", "stages", "engine", "kernels", "schemas")
# The layers, top to bottom: (name, the module prefixes it holds, the layers it may import).
# A module belongs to the first layer holding a prefix of it (prefixes match whole name parts).
# tools/cli assembles the commands (tools/bench, tools/log...) and stages/edge/app the edge's
# routes: neither is imported by its parts. tenancy and the event log are siblings on the
# runtime, and none of the three needs the engine. kernels import nothing, not even schemas: a
# kernel knows tensors, not the wire.
STAGES = ("stages/edge", "request path", "stages/eventlog", "stages/tenancy", "stages/runtime")
LOWER = ("engine", "kernels", "schemas")
LAYERS: tuple[tuple[str, tuple[str, ...], tuple[str, ...]], ...] = (
    ("tools/cli", ("tools.cli",), ("tools", "stages/edge/app", *STAGES, *LOWER)),
    ("tools", ("tools",), ("tools", "stages/edge/app", *STAGES, *LOWER)),
    ("stages/edge/app", ("stages.edge.app",), (*STAGES, *LOWER)),
    ("stages/edge", ("stages.edge",), (*STAGES, *LOWER)),
    ("stages/eventlog", ("stages.eventlog",), ("stages/eventlog", "stages/runtime", "schemas")),
    ("stages/tenancy", ("stages.tenancy",), ("stages/tenancy", "stages/runtime", "schemas")),
    ("stages/runtime", ("stages.runtime",), ("stages/runtime", "schemas")),
    ("request path", ("stages",), (*STAGES[1:], *LOWER)),
    ("engine", ("engine",), LOWER),
    ("kernels", ("kernels",), ("kernels",)),
    ("schemas", ("schemas",), ("schemas",)),
)


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    line: int


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def read_graph(root: Path, packages: tuple[str, ...]) -> tuple[set[str], list[Import]]:
    """Every module of `packages` under `root`, and every import between two of them."""
    files = {
        module_name(path, root): path
        for package in packages
        for path in sorted((root / package).rglob("*.py"))
    }
    modules = set(files)
    imports: dict[Import, None] = {}  # ordered, one per statement and module imported
    for name, path in files.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            for target in _targets(node, package, modules):
                imports[Import(name, target, node.lineno)] = None
    return modules, list(imports)


def _targets(node: ast.AST, package: str, modules: set[str]) -> list[str]:
    if isinstance(node, ast.Import):
        return [t for t in (_known(a.name, modules) for a in node.names) if t]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join(anchor + ([base] if base else []))
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        target = sub if sub in modules else _known(base, modules)
        if target:
            found.append(target)
    return found


def _known(name: str, modules: set[str]) -> str | None:
    """The module `import name` loads (its longest known prefix), or None outside the project."""
    parts = name.split(".")
    for end in range(len(parts), 0, -1):
        candidate = ".".join(parts[:end])
        if candidate in modules:
            return candidate
    return None


def graph_of(imports: list[Import]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {}
    for i in imports:
        graph.setdefault(i.source, set()).add(i.target)
        graph.setdefault(i.target, set())
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One closed chain `a -> ... -> a` per strongly connected component that has a cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
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
            if len(component) > 1 or v in graph.get(v, ()):
                components.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_chain(graph, c) for c in components]


def _chain(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """The shortest cycle through the component's first module, by breadth-first search."""
    start, members = component[0], set(component)
    came_from: dict[str, str] = {}
    queue = deque([start])
    while queue:
        v = queue.popleft()
        for w in sorted(graph[v] & members):
            if w == start:
                chain = [v]
                while chain[-1] != start:
                    chain.append(came_from[chain[-1]])
                return [*reversed(chain), start]
            if w not in came_from:
                came_from[w] = v
                queue.append(w)
    raise AssertionError(f"no cycle through {start} in its component {component}")


def layer_of(module: str) -> str:
    for name, holds, _ in LAYERS:
        if any(within(module, p) for p in holds):
            return name
    raise AssertionError(f"{module} belongs to no layer; add its package to LAYERS")


def wrong_way(imports: list[Import]) -> list[str]:
    """Each import that does not point down the layers, as `a:line -> b (why)`."""
    may_import = {name: below for name, _, below in LAYERS}
    found = []
    for i in imports:
        source, target = layer_of(i.source), layer_of(i.target)
        if target not in may_import[source]:
            found.append(f"{i.source}:{i.line} -> {i.target} ({source} may not import {target})")
    return found


@pytest.fixture(scope="module")
def project() -> tuple[set[str], list[Import]]:
    return read_graph(ROOT, PACKAGES)


def test_the_project_has_no_import_circles(project) -> None:
    _, imports = project
    found = circles(graph_of(imports))
    assert not found, "import circles:\n" + "\n".join(" -> ".join(c) for c in found)


def test_imports_point_down_the_layers(project) -> None:
    modules, imports = project
    found = wrong_way(imports)
    num_edges = sum(len(targets) for targets in graph_of(imports).values())
    print(f"\nimport graph: {len(modules)} modules, {len(imports)} imports of one another "
          f"({num_edges} distinct module -> module edges), no circles allowed")  # fmt: skip
    for name, holds, below in LAYERS:
        print(f"  {name:<16} ({', '.join(holds)}) may import: {', '.join(below)}")
    assert not found, "imports against the layers:\n" + "\n".join(found)


def test_every_module_has_a_layer_and_the_reader_resolves_each_form(project) -> None:
    modules, imports = project
    assert {m for m in modules if "." not in m} == set(PACKAGES)
    for m in modules:
        layer_of(m)
    seen = {(i.source, i.target) for i in imports}
    assert ("stages.gateway", "stages.runtime.spec") in seen  # from a.b import name
    assert ("stages.edge.runs", "stages.edge.realtime") in seen  # from a.b import submodule
    assert ("tools.bench.load", "tools.bench.capacity") in seen  # inside a function


def test_the_checker_catches_a_circle_and_a_wrong_way_import(tmp_path: Path) -> None:
    files = {
        "engine/__init__.py": "",
        "engine/a.py": "def f():\n    from engine import b\n",
        "engine/b.py": "from .c import X\n",
        "engine/c.py": "import engine.a\nfrom stages.gateway import g\n",
        "engine/d.py": "from . import d\n",
        "stages/__init__.py": "",
        "stages/gateway.py": "import schemas\n",
        "stages/edge/__init__.py": "",
        "stages/edge/app.py": "from .runs import R\n",
        "stages/edge/runs.py": "from ..edge import app\n",
        "schemas/__init__.py": "",
    }
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(text)
    _, imports = read_graph(tmp_path, ("engine", "stages", "schemas"))
    assert circles(graph_of(imports)) == [
        ["engine.a", "engine.b", "engine.c", "engine.a"],
        ["engine.d", "engine.d"],
        ["stages.edge.app", "stages.edge.runs", "stages.edge.app"],
    ]
    assert wrong_way(imports) == [
        "engine.c:2 -> stages.gateway (engine may not import request path)",
        "stages.edge.runs:1 -> stages.edge.app (stages/edge may not import stages/edge/app)",
    ]
