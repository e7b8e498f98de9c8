"""What the engine cannot run yet: one record per limitation, in one table.

The planner refuses a layout that one of them applies to (`launcher.plan` exits 2 and names
it, as `launcher.train` does), the search leaves such layouts out, and docs/planner.md's list of
known limitations is generated from this table (`python -m launcher.plan.limitations`), so that a
workaround is found, and retired, in one place. Each record carries its evidence: the
upstream issue or the measurement that shows the limitation. Pure Python: the planner imports
it without torch.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from launcher.layout import SPLIT_BACKWARD, Layout


@dataclass(frozen=True)
class Limitation:
    name: str
    reads: tuple[str, ...]  # the Layout fields `applies` and `message` read
    applies: Callable[[object, Layout], bool]  # (Config, Layout) -> whether it refuses them
    message: Callable[[object, Layout], str]  # the rule and the fix, with the values
    summary: str  # one line for the docs: which layouts
    evidence: str  # the upstream issue or the measured case


def _routed_elsewhere(cfg, lay: Layout) -> bool:
    """Routed experts whose tokens travel between ranks (expert or tensor parallelism)."""
    return bool(cfg.model.n_routed_experts) and (lay.ep > 1 or lay.tp > 1)


LIMITATIONS: tuple[Limitation, ...] = (
    Limitation(
        "op_recompute_split_backward",
        ("pp", "schedule", "recompute"),
        lambda cfg, lay: lay.pp > 1 and lay.schedule in SPLIT_BACKWARD and lay.recompute == "op",
        lambda cfg, lay: (
            f"recompute=op with pipeline.schedule={lay.schedule} is not available; use "
            "recompute=full (recompute.every=k for less), or gpipe, 1f1b or interleaved_1f1b"
        ),
        "per-op recompute under interleaved_zb, zbv, dualpipev",
        "the split schedules run each micro-batch's backward in two passes (input, then "
        "weight gradients), each of which recomputes the block, and torch 2.13's selective "
        "checkpoint can be backwarded once (RuntimeError 'Trying to backward an extra time', "
        "llama3_debug pp=2 zbv); one GraphExecGroup for both passes is refused by torch "
        "because they unpack some of the same saved tensors. AReaL's torch engine turns "
        "op-level selective recompute off under the V schedules for the same reason "
        "(areal-project/AReaL#916)",
    ),
    Limitation(
        "op_recompute_pp_fsdp_experts",
        ("pp", "recompute", "ep", "tp", "zero_stage", "dp_shard", "cp"),
        lambda cfg, lay: (
            lay.pp > 1
            and lay.recompute == "op"
            and _routed_elsewhere(cfg, lay)
            and lay.fsdp_enabled
        ),
        lambda cfg, lay: (
            f"recompute=op with parallel.pp={lay.pp}, FSDP and routed experts on their own FSDP "
            f"mesh (ep={lay.ep}, tp={lay.tp}) is not available; use recompute=full, "
            "data_parallel=ddp or zero1, or pp=1"
        ),
        "op recompute under a pipeline with FSDP-sharded routed experts",
        "FSDP gathers the experts again inside the recompute, which torch 2.13's selective "
        "checkpoint cannot replay (mixtral_debug pp=2 x ep=2, 1f1b: aten.copy_ 'encountered "
        "during backward but not found in storage'); torchtitan#3427",
    ),
)


def refusals(cfg, lay: Layout) -> list[tuple[Limitation, str]]:
    """The limitations that apply to a layout, each with its message."""
    return [(x, x.message(cfg, lay)) for x in LIMITATIONS if x.applies(cfg, lay)]


def markdown() -> str:
    """docs/planner.md's list of known limitations."""
    lines = ["| limitation | layouts | evidence |", "|---|---|---|"]
    lines += [f"| `{x.name}` | {x.summary} | {x.evidence} |" for x in LIMITATIONS]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    from launcher.cli import print_table

    sys.exit(print_table("launcher.plan.limitations", markdown, __doc__, sys.argv[1:]))
