"""The package's layout holds: the core imports downward only, and the runtime imports nothing of pockjax.

Read from the source (every import statement, function-level ones included), so
an import that only runs on some path counts as much as one at the top.
"""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PACKAGE = os.path.join(ROOT, "pockjax")

#: The core: tracing, passes, compile, backends, runtime.
CORE = ("pockjax._compat", "pockjax._src", "pockjax.tags", "pockjax.graph", "pockjax.scheme",
        "pockjax.transforms", "pockjax.compiler", "pockjax.backends", "pockjax.runtime",
        "pockjax.analysis", "pockjax.errors", "pockjax.paths", "pockjax.optim")
#: What drives the core and must never be imported by it.
ABOVE = ("pockjax.train", "pockjax.data", "pockjax.search", "pockjax.cli", "benchmarks")


def _modules() -> dict[str, str]:
    out = {}
    for folder, _, files in os.walk(PACKAGE):
        for f in files:
            if f.endswith(".py"):
                path = os.path.join(folder, f)
                name = os.path.relpath(path, ROOT)[:-3].replace(os.sep, ".")
                out[name.removesuffix(".__init__")] = path
    return out


def _imports(name: str, path: str, known: dict[str, str]) -> set[str]:
    """Modules ``name`` imports (resolved to the module, or the package, that exists)."""
    package = name if path.endswith("__init__.py") else name.rsplit(".", 1)[0]
    found = set()

    def resolve(target: str) -> str:
        while target and target not in known and "." in target:
            target = target.rsplit(".", 1)[0]
        return target

    for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
        if isinstance(node, ast.Import):
            found.update(resolve(a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            for a in node.names:
                full = f"{base}.{a.name}"
                found.add(full if full in known else resolve(base))
    found.discard(name)
    return found


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _cycles(graph: dict[str, set[str]], nodes) -> list[list[str]]:
    """Strongly connected components of more than one module among ``nodes``."""
    nodes = set(nodes)
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v] & nodes:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return out


def _in(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def test_the_core_has_no_import_cycle(graph):
    core = [m for m in graph if _in(m, CORE)]
    assert len(core) > 20
    assert _cycles(graph, core) == []


def test_the_core_imports_nothing_that_drives_it(graph):
    bad = sorted((m, t) for m in graph if _in(m, CORE) for t in graph[m] if _in(t, ABOVE))
    assert bad == []


def test_the_runtime_imports_nothing_of_pockjax_outside_itself(graph):
    bad = sorted((m, t) for m in graph if _in(m, ("pockjax.runtime",))
                 for t in graph[m] if t.startswith("pockjax") and not _in(t, ("pockjax.runtime",)))
    assert bad == []
    external = {t.split(".")[0] for m in graph if _in(m, ("pockjax.runtime",)) for t in graph[m]}
    assert not external & {"jax", "jaxlib", "flax", "optax"}
