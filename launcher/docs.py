"""`make docs`: every block of real output in README.md and docs/ regenerated from its command,
and the comparison tests/test_docs.py makes (a block that no longer matches what its command
prints fails, timings aside).

Two kinds of block, each announced by an HTML comment the rendered page does not show:

    <!-- output                       a fenced block right below: what the commands print
    $ python -m launcher.plan ...     run in one bash, in a fresh directory, each shown as typed
    script: tour                      or docs/examples/tour.sh, which shows its own commands
    cwd: /tmp/own                     optional: where they run, a directory of the temporary
                                      directory's own (emptied first: one this command made)
    timeout: 600                      optional: seconds before the block is killed (600)
    keep: REGEX                       optional: show only the lines that match (and the commands),
                                      each run of lines left out shown as "..."
    hide: plan                        optional: each plan table shown as "..."
    ignore: REGEX                     optional: more of the output that changes run to run
    tier: slow | slurm                optional: the check runs it in the slow tier / with SLURM
    -->

    <!-- generated: python -m launcher.plan.composes -->
    Markdown the command prints, kept exactly
    <!-- end generated -->

and, in a recipe's YAML header, the same as comments (the planner's figures for the recipe):

    # generated: python -m launcher.plan.compare recipe=NAME --rows "" recompute=none --comment
    # what the command prints, each line a comment
    # end generated

A generated command `python -m MODULE ARGS` whose module has `generate(argv) -> str` (or, without
arguments, `markdown() -> str`) runs in this process: no interpreter start for each block.

python -m launcher.docs [--check] [FILE ...] [--name SUBSTRING]: regenerate (or only compare) the
blocks of those files (default: README.md, docs/*.md and recipes/*.yaml).
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLES = ROOT / "docs" / "examples"
WIDTH = 100  # a shown command longer than this is wrapped with " \" continuations

# What changes from run to run of the same command: speeds, wall times, clocks, process ids,
# ports. Masked before two outputs are compared.
VOLATILE = (
    r"(?<=tok/s/dev )\s*[\d,]+",
    r"(?<=mfu )\s*[\d.]+%",
    r"(?<=eta )\s*\d+s",
    r"(?<= in )[\d.]+ s\b",
    r"(?<=\()[\d.]+ s(?=\))",
    r"\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d",
    r"(?<=PID )\d+",
    r"(?<=offline-run-)[\w-]+",
    r"(?<=\]:)\d+",
)
# A number in the output; those with a fraction or an exponent may move in their last places
# between CPUs (a different vector unit sums in a different order).
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:e[+-]?\d+)?")
REL_TOL = 1e-2

OUTPUT = re.compile(
    r"<!-- output\n(?P<spec>.*?)-->\n+(?P<fence>```[^\n]*)\n(?P<body>.*?)^```\n", re.S | re.M
)
GENERATED = re.compile(
    r"<!-- generated: (?P<cmd>[^\n]*?) -->\n(?P<body>.*?)<!-- end generated -->\n", re.S
)
GENERATED_YAML = re.compile(
    r"^# generated: (?P<cmd>[^\n]*)\n(?P<body>(?:#[^\n]*\n)*?)# end generated\n", re.M
)


def generated_pattern(path: Path) -> re.Pattern:
    return GENERATED_YAML if path.suffix == ".yaml" else GENERATED


@dataclass
class Block:
    path: Path
    kind: str  # "output" or "generated"
    commands: list[str] = field(default_factory=list)
    script: str | None = None
    cwd: str | None = None
    keep: list[str] = field(default_factory=list)
    hide: str = ""
    ignore: list[str] = field(default_factory=list)
    tier: str = ""
    timeout: float = 0.0  # seconds; 0: OUTPUT_TIMEOUT_S, GENERATED_TIMEOUT_S
    body: str = ""

    @property
    def name(self) -> str:
        what = self.script or (self.commands[0] if self.commands else "")
        return f"{self.path.relative_to(ROOT)}: {what}"


def parse_spec(path: Path, spec: str, body: str) -> Block:
    block = Block(path, "output", body=body)
    for line in spec.strip().splitlines():
        line = line.strip()
        if line.startswith("$ "):
            block.commands.append(line[2:])
        elif ":" in line and line.split(":", 1)[0] in (
            "script",
            "cwd",
            "keep",
            "hide",
            "ignore",
            "tier",
            "timeout",
        ):
            key, value = (s.strip() for s in line.split(":", 1))
            if key in ("keep", "ignore"):
                getattr(block, key).append(value)
            elif key == "timeout":
                block.timeout = float(value)
            else:
                setattr(block, key, value)
        else:
            raise ValueError(f"{path}: cannot read {line!r} in an output block's comment")
    if not block.commands and not block.script:
        raise ValueError(f"{path}: an output block names neither a command nor a script")
    if block.cwd and Path(block.cwd).parent != Path(tempfile.gettempdir()):
        raise ValueError(
            f"{path}: cwd: {block.cwd} must be a directory right under {tempfile.gettempdir()} "
            "(it is emptied before the block runs)"
        )
    return block


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    found = [parse_spec(path, m["spec"], m["body"]) for m in OUTPUT.finditer(text)]
    found += [
        Block(path, "generated", commands=[m["cmd"]], body=m["body"])
        for m in generated_pattern(path).finditer(text)
    ]
    return found


def doc_files() -> list[Path]:
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        *sorted((ROOT / "recipes").glob("*.yaml")),
    ]


def environment() -> dict[str, str]:
    env = dict(os.environ)
    if not entered():  # no venv to enter: this Python's directory first
        env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["REPO"] = str(ROOT)
    env["PYTHONUNBUFFERED"] = "1"
    for name in ("COLUMNS", "LINES", "FORCE_COLOR"):
        env.pop(name, None)
    return env


def wrap(line: str) -> str:
    """A shown command over WIDTH characters, cut at spaces outside quotes (one with a comment
    stays as it is)."""
    if not line.startswith("$ ") or len(line) <= WIDTH or " # " in line:
        return line
    words = re.findall(r"""(?:[^\s"']+|"[^"]*"|'[^']*')+""", line[2:])
    out, current = [], "$"
    for word in words:
        if len(current) + 1 + len(word) > WIDTH - 2 and current.strip() not in ("$", ""):
            out.append(current + " \\")
            current = "   "
        current += " " + word
    return "\n".join([*out, current])


def entered() -> list[str]:
    """The README's own set-up line, as a user types it: a block runs after
    `. .venv/bin/activate` of the environment running the docs (when that is a venv)."""
    activate = Path(sys.prefix) / "bin" / "activate"
    return [f". {shlex.quote(str(activate))}"] if activate.exists() else []


def script_text(block: Block) -> str:
    lines = [*entered(), "set -u", f"source {shlex.quote(str(EXAMPLES / 'lib.sh'))}", "exec 2>&1"]
    if block.script:
        lines.append(f"source {shlex.quote(str(EXAMPLES / (block.script + '.sh')))}")
    for cmd in block.commands:
        if block.kind == "output":
            lines.append(f"printf '%s\\n' {shlex.quote('$ ' + cmd)}")
        lines.append(cmd)
    return "\n".join(lines) + "\n"


def in_process(block: Block) -> str | None:
    """What a generated block's `python -m MODULE ARGS` prints, run here when MODULE has
    `generate(argv)`, or `markdown()` and the command no arguments (None: it runs in bash)."""
    if block.kind != "generated":
        return None
    argv = shlex.split(block.commands[0])
    if argv[:2] != ["python", "-m"] or len(argv) < 3:
        return None
    module = importlib.import_module(argv[2])
    if hasattr(module, "generate"):
        return module.generate(argv[3:])
    if hasattr(module, "markdown") and len(argv) == 3:
        return module.markdown()
    return None


OUTPUT_TIMEOUT_S, GENERATED_TIMEOUT_S = 600.0, 1800.0  # `make bench` is a generated block
MADE = ".launcher-docs"  # in a cwd: made by this command, so it may empty it


def working_dir(block: Block, scratch: str) -> Path:
    """Where the block runs: a fresh temporary directory, or its `cwd` emptied (only one this
    command made: it holds MADE)."""
    if not block.cwd:
        return Path(scratch)
    cwd = Path(block.cwd)
    if (cwd.exists() or cwd.is_symlink()) and not (cwd / MADE).is_file():
        raise ValueError(
            f"{block.path}: cwd: {cwd} exists and was not made by launcher.docs (no {MADE} in "
            "it): move it aside, it is not emptied"
        )
    subprocess.run(["rm", "-rf", str(cwd)], check=True)
    cwd.mkdir(parents=True)
    (cwd / MADE).touch()
    return cwd


def run(block: Block) -> tuple[str, float]:
    """What the block's commands print now, and how long they took; a block still running
    after its timeout is killed (with every process it started), what it printed kept."""
    start = time.monotonic()
    text = in_process(block)
    if text is not None:
        return text, time.monotonic() - start
    limit = block.timeout or (OUTPUT_TIMEOUT_S if block.kind == "output" else GENERATED_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="docs-") as scratch:
        proc = subprocess.Popen(
            ["bash", "-c", script_text(block)],
            cwd=working_dir(block, scratch),
            env=environment(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
            out += f"launcher.docs: the block was killed after its timeout, {limit:g} s\n"
    if block.kind == "output":
        lines = out.splitlines()
        if block.hide == "plan":
            lines = without_plans(lines)
        out = "".join(wrap(line) + "\n" for line in kept(lines, block.keep))
    return out, time.monotonic() - start


def without_plans(lines: list[str]) -> list[str]:
    """Each plan table (its "plan" title to its bottom border) as one "..." line."""
    out, inside = [], False
    for line in lines:
        if line.strip() == "plan":
            inside = True
            out.append("...")
        elif not inside:
            out.append(line)
        elif line.startswith("└"):
            inside = False
    return out


def kept(lines: list[str], keep: list[str]) -> list[str]:
    """The commands and the lines that match one of `keep` (all, without any), "..." for each
    run of lines left out."""
    if not keep:
        return lines
    out = []
    for line in lines:
        if line.startswith("$ ") or line == "..." or any(re.search(k, line) for k in keep):
            out.append(line)
        elif not out or out[-1] != "...":
            out.append("...")
    return out


def normalise(text: str, ignore: list[str]) -> list[tuple[str, list[str]]]:
    """Each line as (its words, with numbers and table padding taken out; its numbers)."""
    rows = []
    for line in text.splitlines():
        for pattern in (*VOLATILE, *ignore):
            line = re.sub(pattern, "#", line)
        numbers = NUMBER.findall(line)
        words = NUMBER.sub("0", line)
        words = re.sub(r"([─━═│┃┏┓┗┛┡┩└┘┌┐├┤┼╇╋┳┻┬┴|-])\1+", r"\1", words)
        rows.append((" ".join(words.split()), numbers))
    return rows


def close(shown: str, now: str) -> bool:
    if shown == now:
        return True
    if "." not in shown + now and "e" not in shown + now:
        return False
    a, b = float(shown.replace(",", "")), float(now.replace(",", ""))
    return abs(a - b) <= REL_TOL * max(abs(a), abs(b)) + 10.0 ** -_decimals(shown)


def _decimals(number: str) -> int:
    mantissa = number.split("e")[0]
    return len(mantissa.split(".")[1]) if "." in mantissa else 0


def differences(block: Block, now: str) -> list[str]:
    """Where the shown block and the command's output now part, one line each (none: they
    agree, timings aside)."""
    if block.kind == "generated":
        return [] if now == block.body else ["the generated text differs"]
    shown, current = normalise(block.body, block.ignore), normalise(now, block.ignore)
    problems = []
    if len(shown) != len(current):
        problems.append(f"{len(shown)} lines shown, {len(current)} printed now")
    old, new = block.body.splitlines(), now.splitlines()
    pairs = zip(shown, current, strict=False)  # a length apart is reported above
    for i, ((words_a, nums_a), (words_b, nums_b)) in enumerate(pairs, 1):
        if words_a != words_b or len(nums_a) != len(nums_b):
            problems.append(f"line {i}: shown {old[i - 1]!r}, now {new[i - 1]!r}")
        elif not all(close(a, b) for a, b in zip(nums_a, nums_b, strict=True)):
            problems.append(f"line {i}: numbers {nums_a} shown, {nums_b} now")
    return problems


def replace(block: Block, now: str) -> None:
    text = block.path.read_text()
    pattern = OUTPUT if block.kind == "output" else generated_pattern(block.path)
    for m in pattern.finditer(text):
        same = (
            m["cmd"] == block.commands[0]
            if block.kind == "generated"
            else parse_spec(block.path, m["spec"], m["body"]) == block
        )
        if same:
            start, end = m.span("body")
            block.path.write_text(text[:start] + now + text[end:])
            block.body = now
            return
    raise LookupError(f"{block.name}: the block moved while it ran")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.docs", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument(
        "files",
        nargs="*",
        type=Path,
        help="Markdown or recipe files (default: README.md, docs/*.md, recipes/*.yaml)",
    )
    parser.add_argument("--check", action="store_true", help="compare only; exit 1 on a difference")
    parser.add_argument("--name", default="", help="only blocks whose name contains this")
    parser.add_argument(
        "--skip-tier", action="append", default=[], help="leave out a tier (slow, slurm)"
    )
    args = parser.parse_args(argv)
    failed = 0
    for path in [p.resolve() for p in args.files] or doc_files():
        for block in blocks(path):
            if args.name not in block.name or block.tier in args.skip_tier:
                continue
            now, seconds = run(block)
            problems = differences(block, now)
            status = "ok" if not problems else ("differs" if args.check else "updated")
            print(f"{status:8} {seconds:6.1f} s  {block.name}", flush=True)
            for problem in problems[:5]:
                print(f"           {problem}")
            if problems:
                failed += 1
                if not args.check:
                    replace(block, now)
    return 1 if failed and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
