"""The import graph of launcher/, read from the source (no import runs): no module
imports itself back, the packages form layers (docs/architecture.md draws them), every module is
named there, and a module imports another inside a function only with its reason beside it."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

from conftest import ROOT

from launcher.models.families import FAMILIES, Family

SOURCES = sorted((ROOT / "launcher").rglob("*.py"))


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
    launcher.plan.terms.tp), a top-level module itself."""
    return ".".join(module.split(".")[:2])


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


# docs/architecture.md's layers, from the top: the commands (1: every module of launcher/ not
# named here, and each package's __main__), then the packages and modules below them.
LAYERS = {
    "training/": 2,
    "plan/": 3, "checkpoint/": 3, "hf/": 3, "data/": 3,
    "parallel/": 4,
    "runtime/": 5,
    "config.py": 6, "layout.py": 6, "cli.py": 6, "configs.py": 6, "models/": 6,
}  # fmt: skip


def layer(module: str) -> int:
    if module.endswith(".__main__"):
        return 1
    name = (module.split(".")[1:2] or [""])[0]
    return LAYERS.get(f"{name}/", LAYERS.get(f"{name}.py", 6 if name in ("", "__init__") else 1))


def upward(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a layer above the importer's (a command's included)."""
    return [
        f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
        for m, targets in sorted(graph.items())
        for t in sorted(targets)
        if unit(t) != unit(m) and layer(t) < layer(m)
    ]


def test_each_layer_imports_only_the_layers_below_it():
    """As the page draws them: a library module that imports a command (plan/calibrate.py
    read a sweep's files through the `sweep` command module) fails."""
    assert upward(GRAPH) == []
    items = re.findall(r"^(\d)\. (.*?)(?=^\d\. |^$)", ARCHITECTURE, re.M | re.S)
    for name, number in LAYERS.items():
        assert f"`{name}`" in dict(items)[str(number)], f"{name} is not in layer {number}"


def test_an_import_of_a_layer_above_is_found():
    assert upward({"launcher.plan.calibrate": {"launcher.sweep"}}) == [
        "launcher.plan.calibrate (layer 3) imports launcher.sweep (layer 1)"
    ]
    assert upward({"launcher.runtime.launch": {"launcher.config"}}) == []


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


def import_groups(tree: ast.AST):
    """Each run of consecutive import statements inside a function body (or a block of one)."""
    functions = [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]
    for fn in functions:
        for node in ast.walk(fn):
            for field in ("body", "orelse", "finalbody"):
                group = []
                block = getattr(node, field, None)
                for stmt in [*block, None] if isinstance(block, list) else []:
                    if isinstance(stmt, ast.Import | ast.ImportFrom):
                        group.append(stmt)
                    elif group:
                        yield group
                        group = []


def unexplained_imports(text: str, name: str) -> list[str]:
    """The function-level imports of the project's modules whose group carries no comment (on
    the line above it or on one of its lines): the reason it is not at the top."""
    lines = text.splitlines()
    out = []
    for group in import_groups(ast.parse(text)):
        spanned = lines[group[0].lineno - 2 : group[-1].end_lineno]
        if any("#" in line for line in spanned):
            continue
        out += [
            f"{name}:{stmt.lineno}: {lines[stmt.lineno - 1].strip()}"
            for stmt in group
            if imported(stmt)
        ]
    return out


def test_a_function_imports_a_module_only_with_its_reason():
    """Imports belong at the top; one inside a function is there because importing it at the
    top would cost every command that loads the module (torch, a library only one path needs),
    and says so."""
    found = [
        line
        for p in SOURCES
        for line in unexplained_imports(p.read_text(), p.relative_to(ROOT).as_posix())
    ]
    assert not found, found


def test_an_import_without_its_reason_is_found():
    text = (
        "def f():\n    import torch\n\n    from launcher.cli import fail\n\n\n"
        "def g():\n    # torch: g alone needs it\n    from launcher.parallel import build\n"
    )
    assert unexplained_imports(text, "m.py") == ["m.py:4: from launcher.cli import fail"]


def family_branches(text: str, name: str, names: set[str]) -> list[str]:
    """Where code compares with a family's name, or keys a table or lists by one."""

    def named(node) -> bool:
        return isinstance(node, ast.Constant) and node.value in names

    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Compare):
            hit = any(named(n) for n in [node.left, *node.comparators])
            hit |= any(
                isinstance(n, ast.Tuple | ast.List | ast.Set) and any(map(named, n.elts))
                for n in node.comparators
            )
        elif isinstance(node, ast.Dict):
            hit = any(named(k) for k in node.keys if k is not None)
        elif isinstance(node, ast.Subscript):
            hit = named(node.slice)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            hit = sum(map(named, node.elts)) > 1
        else:
            continue
        if hit:
            out.append(f"{name}:{node.lineno}")
    return sorted(set(out))


# Every module but the families' own (launcher/models/).
OUTSIDE_THE_FAMILIES = [
    p
    for top in ("launcher", "hydra_plugins")
    for p in (ROOT / top).rglob("*.py")
    if not p.is_relative_to(ROOT / "launcher" / "models")
]


def test_no_code_outside_the_families_names_a_family():
    """A family is one unit (launcher/models/: its record in families.py, its model module): the
    planner, the engine, the Hugging Face mapping, checkpoints and the benchmarks read what
    differs from the record's fields, never a family's name."""
    sources = OUTSIDE_THE_FAMILIES
    found = [
        hit
        for p in sources
        for hit in family_branches(p.read_text(), p.relative_to(ROOT).as_posix(), set(FAMILIES))
    ]
    assert not found, found


def test_a_branch_on_a_family_name_is_found():
    text = (
        'a = m["family"] == "gpt"\nb = {"llama": 1}\nc = TABLE["mixtral"]\n'
        'd = f in ("llama", "gpt")\ne = ("deepseek", "mixtral")\nok = family or "llama"\n'
    )
    lines = [
        hit.split(":")[1]
        for hit in family_branches(text, "m.py", {"llama", "gpt", "mixtral", "deepseek"})
    ]
    assert lines == ["1", "2", "3", "4", "5"]


# A record's text fields that name a module, a class or a preset ("" for none): read as names.
NAMES = {"name", "model", "args", "debug", "tp_embedding", "tp_embedding_sum"}


def flag_reads(text: str, name: str, fields: set[str]) -> list[str]:
    """Where code tests a record's field as a flag: its truth (`if fam.moe`, `not fam.mla`,
    `fam.moe or ...`) or its equality with a constant (`fam.feed_forward == "routed"`,
    `"yarn" in fam.rope`)."""

    def field(node) -> bool:
        return isinstance(node, ast.Attribute) and node.attr in fields

    def constant(node) -> bool:
        return isinstance(node, ast.Constant) or (
            isinstance(node, ast.Tuple | ast.List | ast.Set)
            and all(isinstance(e, ast.Constant) for e in node.elts)
        )

    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.If | ast.IfExp | ast.While | ast.Assert):
            tests = [node.test]
        elif isinstance(node, ast.BoolOp):
            tests = node.values
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            tests = [node.operand]
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            tests = [n for n in sides if field(n)] if any(map(constant, sides)) else []
        else:
            continue
        out += [f"{name}:{node.lineno} {n.attr}" for n in tests if field(n)]
    return sorted(set(out))


def test_no_shared_code_tests_a_familys_flag():
    """A family answers for itself (issue 62): shared code asks its record for parts, tables and
    functions (launcher/models/shapes.py's attention and MLP, Family.problems), never decodes a
    flag. A record has no yes/no field, and nothing outside launcher/models/ tests the truth of a
    field naming a kind (its blocks' feed-forward, its torchtitan peer) or compares one with a
    constant."""
    flags = [f.name for f in dataclasses.fields(Family) if f.type in ("bool", bool)]
    assert not flags, f"Family's yes/no fields: {flags}"
    kinds = {f.name for f in dataclasses.fields(Family) if f.type in ("str", str)} - NAMES
    assert "feed_forward" in kinds  # what the test reads for: the kinds a record names
    sources = OUTSIDE_THE_FAMILIES
    found = [
        hit
        for p in sources
        for hit in flag_reads(p.read_text(), p.relative_to(ROOT).as_posix(), kinds)
    ]
    assert not found, found


def test_a_flag_read_is_found():
    text = (
        "if fam.moe:\n    pass\n"
        "a = fam.mla or x\n"
        "b = not fam.learned_positions\n"
        'c = fam.feed_forward == "routed"\n'
        "d = fam.tp_block.get(name)\n"  # a table, read
        "e = x if fam.moe else y\n"
        'f = fam.feed_forward in ("routed", "dense first")\n'
        "g = fam.attention.widths(m)\n"  # a part, asked
    )
    fields = {"moe", "mla", "learned_positions", "feed_forward", "tp_block", "attention"}
    lines = [hit.split(":")[1].split()[0] for hit in flag_reads(text, "m.py", fields)]
    assert lines == ["1", "3", "4", "5", "7", "8"]


def long_parameter_lists(text: str, name: str, most: int = 8) -> list[str]:
    """Functions taking more than `most` parameters (self, cls and an autograd ctx aside)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            a = node.args
            params = [*a.posonlyargs, *a.args, *a.kwonlyargs, *filter(None, [a.vararg, a.kwarg])]
            count = len(params) - (bool(a.args) and a.args[0].arg in ("self", "cls", "ctx"))
            if count > most:
                out.append(f"{name}:{node.lineno} {node.name} ({count})")
    return out


def test_no_function_takes_more_than_eight_parameters():
    """A longer list is the fields of an object the caller has (a layout, a config group, a
    block's widths): pass that."""
    found = [
        hit
        for p in SOURCES
        for hit in long_parameter_lists(p.read_text(), p.relative_to(ROOT).as_posix())
    ]
    assert not found, found


def test_a_long_parameter_list_is_found():
    text = (
        "def f(a, b, c, d, e, f, g, h, i):\n    pass\n\n\n"
        "class C:\n    def m(self, a, b, c, d, e, f, g, h):\n        pass\n"
    )
    assert long_parameter_lists(text, "m.py") == ["m.py:1 f (9)"]
