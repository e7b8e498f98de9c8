"""`python -m launcher.plan [overrides]`: check a layout on any cluster without touching it.

Takes the same overrides as launcher.train (recipes included). Prints the plan (or one JSON
object with plan.format=json); exit status 0 when it is valid and fits, 2 otherwise.
`plan.search=true` ranks the layouts that fit; `plan.dry_run=true` also builds the real mesh
and sharded model over a fake process group; `plan.draw=FILE.png` (or .svg, .pdf) draws the
pipeline schedule of a pp > 1 plan.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from hydra.utils import to_absolute_path
from omegaconf import DictConfig

from launcher import configs
from launcher.cli import USAGE_ERROR, fail, hydra_app, to_config
from launcher.config import PlanFormat
from launcher.plan import auto, engine_plan
from launcher.plan.config_rules import config_problems
from launcher.plan.draw import draw_plan
from launcher.plan.report import plan_json, print_plan
from launcher.plan.search import run_search

DRAWING_FORMATS = (".png", ".svg", ".pdf")


def task(dcfg: DictConfig) -> None:
    cfg = to_config(dcfg)
    if cfg.parallel.auto:  # the layout launcher.train would choose on hardware.*
        from hydra import compose

        overrides = list(HydraConfig.get().overrides.task)
        dcfg, problem = auto.recompose(
            cfg, overrides, None, lambda o: compose(config_name="config", overrides=o)
        )
        if problem:
            fail(problem)
        cfg = to_config(dcfg)
    as_json = cfg.plan.format == PlanFormat.json
    if cfg.plan.search and cfg.plan.draw:
        fail(
            f"plan.draw={cfg.plan.draw} draws one plan, not a search: run the search, then "
            "draw the layout you pick with its overrides"
        )
    if cfg.plan.search:
        problems = config_problems(cfg)
        if problems:  # nothing to search: the model, batch or precision itself is refused
            fail("\n".join(["the search has nothing to search:", *(f"  - {p}" for p in problems)]))
        sys.exit(run_search(cfg, as_json))
    drawing_suffix = Path(cfg.plan.draw).suffix.lower()
    if cfg.plan.draw and drawing_suffix not in DRAWING_FORMATS:
        fail(f"plan.draw={cfg.plan.draw}: the file must end in one of {', '.join(DRAWING_FORMATS)}")
    # What launcher.train would refuse is refused here too: the engine's limitations included.
    plan = engine_plan(cfg)
    plan.config_files = configs.user_files(HydraConfig.get().runtime.choices)
    dry = None
    if cfg.plan.dry_run and plan.valid:
        from launcher.plan.dry_run import dry_run  # torch: plan.dry_run=true only

        dry = dry_run(cfg, plan)
    drawing, note = None, ""
    if cfg.plan.draw:
        drawing, note = draw(plan, to_absolute_path(cfg.plan.draw))
    if as_json:
        out = plan_json(plan)
        if dry is not None:
            out["dry_run"] = dry.as_json()
        if cfg.plan.draw:
            out["drawing"] = (
                {"path": str(drawing.path), "bubble_fraction": drawing.bubble_fraction}
                if drawing
                else {"error": note}
            )
        print(json.dumps(out, indent=2))
    else:
        print_plan(plan)
        if dry is not None:
            dry.print()
        if note:
            print(note)
    if not plan.ok:
        sys.exit(USAGE_ERROR)
    # The planner disagreeing with the engine's own shards is the planner's failure, not a
    # usage error.
    sys.exit(0 if dry is None or dry.ok else 1)


def draw(plan, path: str):
    """(the drawing or None, a line saying what was drawn or why nothing was)."""
    if not plan.valid or plan.layout is None:
        return None, "plan.draw: nothing drawn, the plan breaks the rules above"
    if plan.layout.pp == 1:
        return None, "plan.draw: nothing drawn, pp=1 has no pipeline schedule"

    try:
        drawing = draw_plan(plan, path)
    except OSError as e:
        fail(f"plan.draw={path}: cannot write the drawing ({e.strerror or e})")
    lay = plan.layout
    return drawing, (
        f"schedule drawing: {drawing.path} ({lay.schedule}, pp={lay.pp}, "
        f"{lay.microbatches} micro-batches; bubble {drawing.bubble_fraction:.1%} of compute)"
    )


_statuses: list[int] = []  # each point's exit status, in a -m sweep of plans


def each_point(dcfg: DictConfig) -> None:
    """One plan; in a -m sweep every point is planned (a plan ends with its exit status, which
    would end the sweep at its first point), the command's status the worst of theirs."""
    if HydraConfig.get().mode != RunMode.MULTIRUN:
        task(dcfg)
        return
    try:
        task(dcfg)
    except SystemExit as e:
        _statuses.append(e.code if isinstance(e.code, int) else 1)


app = hydra_app(each_point)


def main() -> None:
    """Plan without writing anything: no run or sweep directory under outputs/ or multirun/,
    no .hydra record (unless the command line asks for them)."""
    _statuses.clear()  # (a process may run the command more than once: the tests)
    given = {a.lstrip("+~").split("=", 1)[0] for a in sys.argv[1:]}
    # A -m sweep of plans: Hydra's sweeper writes its multirun.yaml into the sweep directory,
    # so that is a temporary one, removed at the end; no sweep summary (nothing ran).
    scratch = tempfile.mkdtemp(prefix="launcher-plan-")
    defaults = (
        ("hydra.run.dir", "."),
        ("hydra.sweep.dir", scratch),
        ("hydra.sweep.subdir", "."),
        ("hydra.output_subdir", "null"),
        ("hydra/help", "plan"),
    )
    for key, value in defaults:
        if key not in given:
            sys.argv.append(f"{key}={value}")
    if {"-m", "--multirun"} & set(sys.argv[1:]):
        sys.argv.append("~hydra.callbacks.sweep_summary")
    try:
        app()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sys.exit(max(_statuses, default=0))


if __name__ == "__main__":
    main()
