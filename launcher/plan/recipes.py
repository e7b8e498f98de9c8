"""`python -m launcher.plan.recipes`: every recipe's plan as a Markdown table (for docs/planner.md),
with whether `launcher.train` runs it (else the limitations that refuse it). The user's recipes
(their configuration directories, launcher/configs.py) are listed too, each with its file."""

from __future__ import annotations

import sys

from launcher import configs
from launcher.cli import adopt_config_dirs, compose, fail
from launcher.plan import make_plan
from launcher.plan.limitations import refusals
from launcher.plan.memory import GIB


def rows() -> list[str]:
    out = [
        "| recipe | model | GPUs | tp cp pp dp ep | schedule | recompute | memory GiB "
        "(of) | step s | MFU | trains |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, path in configs.options("recipe").items():
        cfg = compose([f"recipe={name}"])
        plan = make_plan(cfg)
        d, hw = plan.degrees, cfg.hardware
        lay, est = plan.layout, plan.estimate
        schedule = f"{lay.schedule} v{lay.stages_per_rank}" if lay.pp > 1 else "-"
        dp = f"{d['dp_replicate']}x{d['dp_shard']}" if d["dp_replicate"] > 1 else d["dp_shard"]
        refused = ", ".join(f"no: `{x.name}`" for x, _ in refusals(cfg, lay)) or "yes"
        named = f"{name} ({path})" if configs.is_user(path) else name
        out.append(
            f"| {named} | {cfg.model.name} | {plan.world_size:,} {hw.name} | "
            f"{d['tp']} {d['cp']} {d['pp']} {dp} {d['ep']} | {schedule} | {lay.recompute} | "
            f"{plan.memory.total / GIB:.1f} ({hw.memory_gib:g}) | {est.time.step:.3g} | "
            f"{est.mfu:.1%} | {refused} |"
        )
    return out


def markdown() -> str:
    """The table (docs/planner.md's recipes table)."""
    return "\n".join(rows()) + "\n"


if __name__ == "__main__":
    sys.argv[1:] = adopt_config_dirs(sys.argv[1:])
    if sys.argv[1:]:
        fail(f"{' '.join(sys.argv[1:])}: launcher.plan.recipes takes only --config-dir DIR")
    sys.stdout.write(markdown())
