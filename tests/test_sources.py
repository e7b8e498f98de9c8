"""What the configs and the code cite is in the repository: no file outside it (the shared
REFERENCE.md the first recipes were written from), and every section of docs/sources.md they
name is one of its headings."""

from __future__ import annotations

import re

from conftest import ROOT

CITING = [
    "conf/**/*.yaml",
    "recipes/*.yaml",
    "launcher/**/*.py",
    "tests/**/*.py",
    "README.md",
    "docs/*.md",
]
# The names citations use -> the heading of docs/sources.md they mean.
SECTIONS = {
    "model shapes": "Model shapes",
    "published layouts": "Published layouts",
    "published runs": "Published runs",
    "formulas": "Memory and time formulas",
    "hardware": "Hardware",
}


def test_every_cited_section_of_the_sources_exists():
    headings = {
        line.removeprefix("## ")
        for line in (ROOT / "docs" / "sources.md").read_text().splitlines()
        if line.startswith("## ")
    }
    assert set(SECTIONS.values()) <= headings
    cited = 0
    for path in (p for pattern in CITING for p in ROOT.glob(pattern)):
        if path.name == "test_sources.py":
            continue
        text = path.read_text()
        assert "REFERENCE.md" not in text, f"{path} cites a file outside the repository"
        for names in re.findall(r"docs/sources\.md(?:'s|[,:]) ([a-z ,]+?)[)\]:;.]", text):
            for name in names.split(", "):
                assert name in SECTIONS, f"{path} cites section {name!r} of docs/sources.md"
                cited += 1
    assert cited >= 36, cited  # the recipes, the model and hardware presets, planner and tests
