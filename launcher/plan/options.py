"""The layout options as one table (docs/architecture.md, "Adding a layout option"): each
Layout field's record (launcher/layout.py), the rules and engine limitations that declare they
read it, and the cost terms and engine modules that read it from the Layout.
`python -m launcher.plan.options` prints it; the docs test checks it."""

from __future__ import annotations

import ast
import sys
from dataclasses import MISSING
from pathlib import Path

from launcher.layout import OPTIONS
from launcher.plan.rules import readers

LAUNCHER = Path(__file__).resolve().parents[1]
# Where an option's work is done: the planner's cost (memory and time) and the engine.
WORKERS = ("plan/context.py", "plan/estimate.py", "plan/terms", "parallel", "training")


def _searched(name: str, opt) -> str:
    """How plan.search sets it: its own search values, or with another option's."""
    if opt.search is not None:
        return "cheapest first" if opt.escalates else "yes"
    by = [f"with `{f.name}`" for f, o in OPTIONS if name in o.also_sets]
    return by[0] if by else "-"


def _of_a_layout(node: ast.Attribute) -> bool:
    """`lay.X`, `layout.X`, `self.layout.X`: what the engine and the cost terms call a Layout."""
    owner = node.value
    name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", "")
    return name in ("lay", "layout")


def attributes_read() -> dict[str, set[str]]:
    """Attribute name -> the modules of WORKERS that read it from a Layout (`lay.schedule`)."""
    found: dict[str, set[str]] = {}
    for part in WORKERS:
        root = LAUNCHER / part
        for path in [root] if root.is_file() else sorted(root.rglob("*.py")):
            module = str(path.relative_to(LAUNCHER).with_suffix(""))
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Attribute) and _of_a_layout(node):
                    found.setdefault(node.attr, set()).add(module)
    return found


def markdown() -> str:
    lines = [
        "| option | setting | override | default | searched | rules, limitations | work |",
        "|---|---|---|---|---|---|---|",
    ]
    read = attributes_read()
    for f, opt in OPTIONS:
        derived = f.default is MISSING
        cells = [
            f"`{f.name}`",
            f"`{opt.setting}`",
            "derived" if derived else f"`{opt.spelt or opt.setting}`",
            "derived" if derived else f"`{f.default!r}`",
            _searched(f.name, opt),
            ", ".join(readers(f.name)) or "-",
            ", ".join(sorted(read.get(f.name, ()))) or "-",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from launcher.cli import print_table

    sys.exit(print_table("launcher.plan.options", markdown, __doc__, sys.argv[1:]))
