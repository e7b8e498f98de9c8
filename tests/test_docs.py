"""The docs' real output (launcher/docs.py): every block in README.md and docs/ matches what its
command prints now, timings aside; `make docs` rewrites them instead (DOCS_UPDATE=1). The SLURM
blocks run on the test cluster: tests/slurm/test_docs.py."""

from __future__ import annotations

import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from launcher import docs

BLOCKS = [b for path in docs.doc_files() for b in docs.blocks(path)]


class Ahead:
    """The selected output blocks run ahead of their tests, two pages at a time and each
    page's blocks in order (a page's blocks share their files: docs/data.md's /tmp/own;
    no two pages do). Each is a command in a shell, one or two processes at a time: alone,
    one page after another kept 1.2 of this machine's 2 cores busy."""

    PAGES_AT_ONCE = 2

    def __init__(self, blocks: list[docs.Block]):
        self.outputs: dict[int, Future] = {id(b): Future() for b in blocks}
        pages: dict[Path, list[docs.Block]] = {}
        for b in blocks:
            pages.setdefault(b.path, []).append(b)
        self.pool = ThreadPoolExecutor(self.PAGES_AT_ONCE, thread_name_prefix="docs")
        for page in pages.values():  # in the tests' order: the first test's page first
            self.pool.submit(self._run, page)

    def _run(self, page: list[docs.Block]) -> None:
        for b in page:
            out = self.outputs[id(b)]
            if out.set_running_or_notify_cancel():
                try:
                    out.set_result(docs.run(b)[0])
                except BaseException as e:  # the test asking for it raises it
                    out.set_exception(e)

    def output(self, block: docs.Block) -> str:
        """What the block's command printed (docs.run), waited for; a block not run ahead
        (a generated one, which may run in this process) runs now."""
        out = self.outputs.get(id(block))
        return out.result() if out is not None else docs.run(block)[0]

    def close(self) -> None:
        for out in self.outputs.values():
            out.cancel()
        self.pool.shutdown(wait=True)


@pytest.fixture(scope="session")
def ahead(request):
    selected = [
        item.callspec.params["block"]
        for item in request.session.items
        if getattr(item, "originalname", "") == "test_block_matches_what_its_command_prints"
        and item.module.__name__ == __name__
    ]
    runner = Ahead([b for b in selected if b.kind == "output"])
    yield runner
    runner.close()


def check(block: docs.Block, ahead: Ahead | None = None) -> None:
    """The block's command run now: equal to the page (timings aside), or, under `make docs`,
    written into it."""
    now = ahead.output(block) if ahead else docs.run(block)[0]
    problems = docs.differences(block, now)
    if problems and os.environ.get("DOCS_UPDATE") == "1":
        docs.replace(block, now)
        return
    assert not problems, f"{block.name} no longer matches (make docs rewrites it):\n" + "\n".join(
        problems[:10]
    )


def marks(block: docs.Block) -> list:
    return [pytest.mark.slow] if block.tier == "slow" else []


def params(tier: str) -> list:
    return [
        pytest.param(b, id=b.name, marks=marks(b))
        for b in BLOCKS
        if (b.tier == "slurm") == (tier == "slurm")
    ]


@pytest.mark.e2e
@pytest.mark.parametrize("block", params("local"))
def test_block_matches_what_its_command_prints(block, ahead):
    check(block, ahead)


def test_no_script_works_in_the_repository():
    """No block's script works in the repository (`cd "$REPO"`, itself or in a script it
    sources): it would write conf/ while the session's tests read it; a user's presets go into
    a config directory of their own (docs/config.md)."""

    def text(name: str) -> str:
        own = (docs.EXAMPLES / f"{name}.sh").read_text()
        sourced = re.findall(r'source "\$REPO/docs/examples/(\w+)\.sh"', own)
        return own + "".join(text(s) for s in sourced)

    scripts = {b.script for b in BLOCKS if b.script}
    assert not {s for s in scripts if 'cd "$REPO"' in text(s)}


def test_every_block_that_shows_a_command_is_generated():
    """A fenced block that starts with `$ command` shows what it printed: it must be one that
    make docs regenerates."""
    for path in docs.doc_files():
        text = path.read_text()
        for m in re.finditer(r"^```[^\n]*\n\$ ", text, re.M):
            before = text[: m.start()].rstrip("\n")
            assert before.endswith("-->") and "<!-- output" in before[-2000:], (
                f"{path.name}: the block at line {text[: m.start()].count(chr(10)) + 1} shows "
                "a command but has no <!-- output --> comment"
            )


def block_of(body: str, ignore: list[str] | None = None) -> docs.Block:
    return docs.Block(docs.ROOT / "README.md", "output", ["true"], body=body, ignore=ignore or [])


SHOWN = """$ python -m launcher.train train.steps=2
│ total              │ 0.53 GiB of 8 GiB: fits                │
step  1/2  loss 5.7804  lr 1.50e-04  grad_norm 5.762  tok/s/dev 3,087  mfu 18.4%  eta 2s
run finished at step 2 of 2, loss 5.5833; 4,096 tokens in 3 s
"""


def test_timings_and_table_widths_are_not_differences():
    now = SHOWN.replace("3,087", "12,950").replace("18.4%", "77.1%").replace("eta 2s", "eta 14s")
    now = now.replace("in 3 s", "in 41 s").replace("fits                │", "fits  │")
    assert docs.differences(block_of(SHOWN), now) == []


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("loss 5.7804", "loss 5.9804"),  # another loss
        ("fits", "DOES NOT FIT"),  # another verdict
        ("step 2 of 2", "step 1 of 2"),  # an integer, exact
        ("4,096 tokens", "4,097 tokens"),
    ],
)
def test_a_changed_output_fails_the_check(old, new):
    problems = docs.differences(block_of(SHOWN), SHOWN.replace(old, new))
    assert len(problems) == 1 and problems[0].startswith(("line", "numbers")), problems


def test_a_line_more_or_less_fails_the_check():
    assert docs.differences(block_of(SHOWN), SHOWN + "warning: new\n")
    assert docs.differences(block_of(SHOWN), SHOWN.split("\n", 1)[1])


def test_a_real_block_changed_on_the_page_fails_against_its_command():
    """The docs' own planner block, run: equal as shown; one figure of the page changed, not."""
    (block,) = [
        b for b in BLOCKS if b.commands == ["python -m launcher.plan recipe=llama3_405b_8192gpu"]
    ]
    now, _ = docs.run(block)
    assert docs.differences(block, now) == []
    changed = docs.Block(**{**vars(block), "body": block.body.replace("fits", "fit", 1)})
    assert docs.differences(changed, now)


def test_kept_lines_and_hidden_plans():
    lines = ["$ cmd", "plan", "┌──┐", "│ x │", "└──┘", "step 1", "step 2", "done"]
    assert docs.kept(docs.without_plans(lines), [r"^step 2", r"^done"]) == [
        "$ cmd",
        "...",
        "step 2",
        "done",
    ]
    assert docs.wrap("$ " + "word " * 30).count("\\\n") == 1


CLUSTER_RECIPES = [
    p for p in sorted((docs.ROOT / "recipes").glob("*.yaml")) if "debug" not in p.stem
]
# A planner figure written as prose: "77.0 GiB", "22.0 s per step", "23.8% MFU".
HAND_FIGURE = re.compile(r"\d GiB|\d s per step|\d% MFU|MFU \d")


@pytest.mark.parametrize("path", CLUSTER_RECIPES, ids=[p.stem for p in CLUSTER_RECIPES])
def test_every_cluster_recipe_shows_the_planners_figures_only_generated(path):
    """The header's figures come from launcher.plan.compare (checked above with every block);
    none is written by hand in a comment, where the next change to the planner would leave it
    behind."""
    text = path.read_text()
    assert f"# generated: python -m launcher.plan.compare recipe={path.stem} " in text
    comments = "".join(
        line + "\n"
        for line in docs.GENERATED_YAML.sub("", text).splitlines()
        if line.lstrip().startswith("#")
    )
    assert not HAND_FIGURE.search(comments), HAND_FIGURE.findall(comments)


# Paths a comment or page names that are not this repository's files, each for its reason.
NAMED_ELSEWHERE = {
    "docs/performance.md": "torchtitan's benchmark page",
    "docs/performance-summary.md": "NeMo AutoModel's benchmark page",
    "recipes/NAME.yaml": "a placeholder",
    "launcher/models/NAME.py": "a placeholder",
    "docs/examples/tour.sh": "an example in launcher/docs.py's docstring",
}
REPO_PATH = re.compile(
    r"(?<![\w/.-])((?:launcher|models|tests|docs|recipes|conf|hydra_plugins)/[\w/.-]*\w"
    r"\.(?:py|md|yaml|sh|json))"
)


def test_comments_and_pages_cite_only_files_the_repository_has():
    """A path named in a comment or a page exists (a module renamed or never written leaves
    its citations behind), and nothing cites notes outside the repository (../shared/)."""
    tops = ("launcher", "tests", "docs", "recipes", "conf", "hydra_plugins")
    files = [p for top in tops for p in (docs.ROOT / top).rglob("*") if p != Path(__file__)]
    files = [p for p in files if p.suffix in (".py", ".md", ".yaml", ".sh")]
    missing = [
        f"{p.relative_to(docs.ROOT)}: {ref}"
        for p in [*files, docs.ROOT / "README.md", docs.ROOT / "Makefile"]
        for ref in REPO_PATH.findall(p.read_text())
        if ref not in NAMED_ELSEWHERE and not (docs.ROOT / ref).exists()
    ]
    outside = [str(p.relative_to(docs.ROOT)) for p in files if "../shared/" in p.read_text()]
    assert not missing and not outside, (missing, outside)


def test_only_a_generated_python_module_block_runs_in_this_process():
    script = docs.Block(docs.ROOT / "README.md", "output", script="tour")
    assert docs.in_process(script) is None  # a script's block: bash
    shown = docs.Block(docs.ROOT / "README.md", "output", ["python -m launcher.plan.compare"])
    assert docs.in_process(shown) is None  # an output block: bash, as typed
    limits = ["python -m launcher.plan.limitations"]
    table = docs.Block(docs.ROOT / "README.md", "generated", limits)
    assert docs.in_process(table).startswith("| limitation |")


def plain_blocks(path: Path) -> list[tuple[int, str]]:
    """The fenced blocks of `path` that no command generates: (line, text)."""
    text = path.read_text()
    found = []
    for m in re.finditer(r"^```[^\n]*\n(.*?)^```", text, re.M | re.S):
        if not text[: m.start()].rstrip("\n").endswith("-->"):
            found.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return found


def test_the_readmes_set_up_lines_come_before_its_commands_and_its_layouts_plan():
    """The README's command lines as a user copies them: its set-up block (`. .venv/bin/activate`)
    is what every generated block runs after (docs.entered), and each `python -m
    launcher.train ...` line of its plain blocks (the layouts, a preset, a sweep) is accepted
    as written by launcher.plan, which takes the same overrides and accepts only what
    launcher.train runs; the generated blocks run their own commands as shown."""
    readme = docs.ROOT / "README.md"
    blocks = plain_blocks(readme)
    setup_line = next((n for n, b in blocks if b.strip() == ". .venv/bin/activate"), None)
    assert setup_line is not None, "no set-up block"
    lines = [
        line.split("  #")[0].strip()
        for n, b in blocks
        for line in b.splitlines()
        if line.startswith("python -m ")
    ]
    first_command = min(n for n, b in blocks if "python -m " in b)
    assert setup_line < first_command and len(lines) >= 5, (setup_line, first_command, lines)
    assert all(line.startswith("python -m launcher.train ") for line in lines), lines
    planned = [line.replace("launcher.train", "launcher.plan", 1) for line in lines]
    # The printed command shows `$((40 + 2))`; only a refusal prints 42.
    checks = [f'{cmd} > /dev/null || echo "$((40 + 2)) refused it"' for cmd in planned]
    out, _ = docs.run(docs.Block(readme, "output", checks))
    assert docs.entered() and "42 refused it" not in out, out


def test_a_blocks_directory_is_one_of_the_temporary_directorys_own_and_made_by_it(tmp_path):
    """`cwd:` is emptied before a block runs: only a directory right under the temporary
    directory, and only one that launcher.docs made (a user's own is refused, untouched)."""
    with pytest.raises(ValueError, match=r"cwd: /home/me/work must be a directory right under"):
        docs.parse_spec(docs.ROOT / "x.md", "$ true\ncwd: /home/me/work", "")
    theirs = Path(docs.tempfile.mkdtemp())
    (theirs / "notes.txt").write_text("mine")
    block = docs.parse_spec(docs.ROOT / "x.md", f"$ ls -A\ncwd: {theirs}", "")
    with pytest.raises(ValueError, match="exists and was not made by launcher.docs"):
        docs.run(block)
    assert (theirs / "notes.txt").read_text() == "mine"
    (theirs / "notes.txt").unlink()
    theirs.rmdir()
    assert docs.run(block)[0] == f"$ ls -A\n{docs.MADE}\n"  # made now: emptied and reused
    assert docs.run(block)[0] == f"$ ls -A\n{docs.MADE}\n"


def read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # gone meanwhile
        return b""


def test_a_block_past_its_timeout_is_killed_with_what_it_started():
    """A hung example ends at its timeout, its processes with it; what it printed stays."""
    block = docs.parse_spec(docs.ROOT / "x.md", "$ echo begun; sleep 3017 & wait\ntimeout: 2", "")
    out, seconds = docs.run(block)
    assert seconds < 30 and "begun" in out
    assert "killed after its timeout, 2 s" in out
    left = [p for p in Path("/proc").glob("[0-9]*/cmdline") if b"sleep\x003017" in read(p)]
    assert not left
