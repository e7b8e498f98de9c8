"""The import graph of launcher/ and models/, read from the source (no import runs): no module
imports itself back, the packages form layers (docs/architecture.md draws them), every module is
named there, and a module imports another inside a function only with its reason beside it."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import ROOT

SOURCES = sorted(p for top in ("launcher", "models") for p in (ROOT / top).rglob("*.py"))


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in SOURCES}


def imported(node: ast.Import | ast.ImportFrom) -> list[str]:
    """The project's modules an import statement loads (a `from package import module` names
    the module, not the package)."""
    if isinstance(node, ast.Import):
        names = [a.name for a in node.names]
    elif node.level or not node.module:
        return []
    else:
        subs = [f"{node.module}.{a.name}" for a in node.names]
        names = [n for n in subs if n in MODULES] or [node.module]
    found = []
    for name in names:
        while name and name not in MODULES:
            name = name.rpartition(".")[0]
        if name:
            found.append(name)
    return found


def imports(path: Path) -> list[tuple[str, ast.stmt, bool]]:
    """(module, statement, whether at the module's top level) for each project import."""
    tree = ast.parse(path.read_text())
    top = {id(n) for n in tree.body}
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            for name in imported(node):
                out.append((name, node, id(node) in top))
    return out


GRAPH = {m: {t for t, _, _ in imports(p) if t != m} for m, p in MODULES.items()}


def unit(module: str) -> str:
    """The layer a module belongs to: its package under launcher/ (launcher.plan for
    launcher.plan.terms.tp), a top-level module itself, models as one."""
    parts = module.split(".")
    return "models" if parts[0] == "models" else ".".join(parts[:2])


def cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the graph (empty when there is none)."""
    state, path = {}, []

    def visit(v):
        state[v] = "open"
        path.append(v)
        for w in sorted(graph.get(v, ())):
            if state.get(w) == "open":
                return path[path.index(w) :] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        state[v] = "done"
        path.pop()
        return []

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return []


def test_no_module_imports_itself_back():
    assert cycle(GRAPH) == []


def test_the_packages_form_layers():
    """Package to package, no cycle either: runtime/ below parallel/, parallel/ below plan/ and
    checkpoint/, training/ above them all, the commands on top."""
    units = {}
    for m, targets in GRAPH.items():
        units.setdefault(unit(m), set()).update(unit(t) for t in targets if unit(t) != unit(m))
    assert cycle(units) == []


def test_the_cycle_finder_finds_cycles():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) == []


ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()


def entries() -> dict[str, str]:
    """docs/architecture.md's layout block: each entry's head (a path at the line's start) and
    its text, continuation lines included."""
    block = ARCHITECTURE.split("```")[1]
    out, head = {}, None
    for line in block.splitlines():
        if line and not line[0].isspace():
            head = line.split()[0]
            out[head] = line
        elif head:
            out[head] += " " + line.strip()
    return out


def unnamed(path: Path, found: dict[str, str]) -> str | None:
    """Why docs/architecture.md does not name this module (None: it does). A module is an
    entry of its own, or a file its package's entry names; an empty __init__.py names nothing."""
    rel = path.relative_to(ROOT).as_posix()
    if rel in found or not path.read_text().strip():
        return None
    package, _, name = rel.rpartition("/")
    if package + "/" not in found:
        return f"{rel}: no entry for it or for {package}/"
    if name != "__init__.py" and name not in found[package + "/"]:
        return f"{rel}: {package}/'s entry leaves out {name}"
    return None


def test_every_module_is_named_in_the_architecture_page():
    found = entries()
    missing = [why for p in SOURCES if (why := unnamed(p, found))]
    assert not missing, missing


def test_a_module_left_out_of_the_page_is_found():
    found = {"launcher/plan/": "launcher/plan/ rules.py, memory.py"}
    assert unnamed(ROOT / "launcher/plan/rules.py", found) is None
    assert "leaves out search.py" in unnamed(ROOT / "launcher/plan/search.py", found)
    assert "no entry" in unnamed(ROOT / "launcher/train.py", found)
