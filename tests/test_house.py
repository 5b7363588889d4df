"""The house's rules, read from the code's own imports (lazy ones inside functions included):
no import circle among tierlog's modules, and no import that runs back up a floor (``connectors/``
and ``state/`` never import ``streaming/``)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("streaming", "connectors", "state")


def modules(root: Path) -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (root / package).rglob("*.py"):
            name = ".".join(path.relative_to(root).with_suffix("").parts)
            out[name.removesuffix(".__init__")] = path
    return out


def imports(root: Path) -> dict[str, set[str]]:
    """Each module's imports of the others: ``from pkg import sub`` is an import of ``pkg.sub``."""
    mods = modules(root)

    def owner(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {name: set() for name in mods}
    for name, path in mods.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(parts + ([base] if base else []))
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names]
            else:
                continue
            for target in targets:
                found = owner(target)
                if found is not None and found != name:
                    graph[name].add(found)
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected parts of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            nxt = next(edges, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph.get(nxt, ())))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                part = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    part.append(member)
                    if member == node:
                        break
                if len(part) > 1:
                    found.append(sorted(part))
    return found


def test_no_import_circle():
    assert circles(imports(ROOT)) == []


def test_no_import_runs_up_a_floor():
    upward = sorted((a, b) for a, targets in imports(ROOT).items() for b in targets
                    if a.split(".")[0] in ("connectors", "state") and b.split(".")[0] == "streaming")
    assert upward == []


def test_a_circle_through_a_lazy_import_is_found(tmp_path):
    """The check can fail: two modules of a made-up tree that import each other, one inside a function."""
    for package in PACKAGES:
        (tmp_path / package).mkdir()
        (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / "connectors" / "a.py").write_text("from connectors import b\n")
    (tmp_path / "connectors" / "b.py").write_text("def f():\n    from connectors.a import x\n")
    (tmp_path / "state" / "c.py").write_text("from .. import streaming\nimport streaming.d\n")
    (tmp_path / "streaming" / "d.py").write_text("")
    graph = imports(tmp_path)
    assert circles(graph) == [["connectors.a", "connectors.b"]]
    assert "streaming.d" in graph["state.c"]
