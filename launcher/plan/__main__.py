"""`python -m launcher.plan [overrides]`: check a layout on any cluster without touching it.

Takes the same overrides as launcher.train (recipes included). Prints the plan (or one JSON
object with plan.format=json); exit status 0 when it is valid and fits, 2 otherwise.
`plan.search=true` ranks the layouts that fit; `plan.dry_run=true` also builds the real mesh
and sharded model over a fake process group.
"""

from __future__ import annotations

import json
import sys

from omegaconf import DictConfig

from launcher.cli import USAGE_ERROR, fail, hydra_app, to_config
from launcher.config import PlanFormat
from launcher.plan import make_plan
from launcher.plan.report import plan_json, print_plan
from launcher.plan.rules import config_problems


def task(dcfg: DictConfig) -> None:
    cfg = to_config(dcfg)
    as_json = cfg.plan.format == PlanFormat.json
    if cfg.plan.search:
        from launcher.plan.search import run_search

        problems = config_problems(cfg)
        if problems:  # nothing to search: the model, batch or precision itself is refused
            fail("\n".join(["the search has nothing to search:", *(f"  - {p}" for p in problems)]))
        sys.exit(run_search(cfg, as_json))
    plan = make_plan(cfg)
    dry = None
    if cfg.plan.dry_run and plan.valid:
        from launcher.plan.dry_run import dry_run

        dry = dry_run(cfg, plan)
    if as_json:
        out = plan_json(plan)
        if dry is not None:
            out["dry_run"] = dry.as_json()
        print(json.dumps(out, indent=2))
    else:
        print_plan(plan)
        if dry is not None:
            dry.print()
    ok = plan.ok and (dry is None or dry.ok)
    sys.exit(0 if ok else USAGE_ERROR)


main = hydra_app(task)

if __name__ == "__main__":
    main()
