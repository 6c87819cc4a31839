"""Imports run one way: the command-line tools -> ``plugin`` -> ``hooks`` -> ``startup`` -> the two sides and
their vLLM-format helpers -> the core (ledger, round, selection, moves, policies), which knows nothing of vLLM.
Read from the sources (every ``import`` of a kvcompact module, those inside functions included), so a lazy import
cannot hide a circle. Controls: the import each check exists to refuse, planted in the real sources, is caught."""

from __future__ import annotations

import ast

from support import ROOT

SRC = ROOT / "src"


def sources() -> dict[str, str]:
    """{dotted module name: source} of every module of the package."""
    out = {}
    for path in sorted((SRC / "kvcompact").rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path.read_text()
    return out


def import_graph(modules: dict[str, str]) -> dict[str, set[str]]:
    """{module: the kvcompact modules it imports}, ``from pkg import mod`` resolved to the module."""
    graph: dict[str, set[str]] = {}
    for name, text in modules.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvcompact"):
                for alias in node.names:
                    full = f"{node.module}.{alias.name}"
                    deps.add(full if full in modules else node.module)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("kvcompact"))
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    """0 the core, 1 the sides and vLLM-format helpers, 2 startup, 3 the hooks, 4 the plugin, 5 the tools."""
    if module.startswith("kvcompact.tools"):
        return 5
    if module == "kvcompact.vllm.plugin":
        return 4
    if module.startswith("kvcompact.vllm.hooks"):
        return 3
    if module == "kvcompact.vllm.startup":
        return 2
    return 1 if module.startswith("kvcompact.vllm") else 0


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """Imports from a lower layer into a higher one."""
    return sorted((m, d) for m, deps in graph.items() for d in deps if layer(d) > layer(m))


def test_no_import_circle_in_the_package() -> None:
    assert cycles(import_graph(sources())) == []


def test_imports_only_go_down_the_layers() -> None:
    assert upward(import_graph(sources())) == []


def test_the_checks_catch_the_imports_they_exist_to_refuse() -> None:
    """Controls on the real sources: the scheduler side reaching back into the plugin (the circle this layout
    removed) is a circle and an upward import; the core importing vLLM code is an upward import."""
    planted = sources()
    planted["kvcompact.vllm.scheduler_side"] += "\n\ndef _f():\n    from kvcompact.vllm.plugin import HOOKS\n"
    graph = import_graph(planted)
    assert any({"kvcompact.vllm.plugin", "kvcompact.vllm.scheduler_side"} <= set(c) for c in cycles(graph))
    assert ("kvcompact.vllm.scheduler_side", "kvcompact.vllm.plugin") in upward(graph)
    planted = sources()
    planted["kvcompact.ledger"] += "\nfrom kvcompact.vllm import metrics\n"
    assert ("kvcompact.ledger", "kvcompact.vllm.metrics") in upward(import_graph(planted))


def same_basenames(paths: list[str]) -> set[str]:
    """The test module names more than one room uses: pytest imports test modules by basename (the rooms are not
    packages), so a second ``test_x.py`` stops the whole collection with "import file mismatch"."""
    names = [p.rsplit("/", 1)[-1] for p in paths]
    return {n for n in names if names.count(n) > 1}


def test_every_test_module_has_its_own_name():
    paths = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py"))
    assert len(paths) > 40 and not same_basenames(paths), same_basenames(paths)
    assert same_basenames([*paths, "tests/engine/test_recall_store.py"]) == {"test_recall_store.py"}  # control
