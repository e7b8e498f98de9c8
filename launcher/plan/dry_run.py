"""`plan.dry_run=true`: the engine's real mesh and parallelize functions at full world size.

A fake process group (torch's FakeStore, backend "fake") stands in for every rank and
`launcher.parallel.build`, the trainer's own build path, builds the model on the meta device (no
memory) and shards it exactly as training does, for the stages of the planner's most loaded
pipeline rank; only the last step, allocating on the device, is left out. The local shards of
that stage's first rank give the parameter count it holds (FSDP gives its first ranks the
padded, largest chunks), reported next to the planner's analytic figure; more than 0.1% apart
fails the dry run. Axes the engine does not implement yet are reported as the error the engine
would raise.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from rich.console import Console
from rich.markup import escape

from launcher.config import Config
from launcher.plan import Plan
from launcher.plan.estimate import layout_ranks, rank_params
from launcher.plan.rules import engine_problems

# The engine's count and the planner's may differ by FSDP's padding of uneven shards only.
TOLERANCE = 1e-3


@dataclass
class DryRun:
    world_size: int
    analytic_params: float  # parameters on the most loaded rank, from the planner
    engine_params: int | None = None  # the same, from the engine's real shards
    engine_bytes: int | None = None  # their storage (master dtype)
    rank: int = 0  # the global rank compared: first of the planner's most loaded pp rank
    errors: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def relative_error(self) -> float | None:
        if self.engine_params is None:
            return None
        return abs(self.engine_params - self.analytic_params) / self.engine_params

    @property
    def ok(self) -> bool:
        return not self.errors and (self.relative_error or 0.0) <= TOLERANCE

    def as_json(self) -> dict:
        return {
            "ok": self.ok,
            "errors": self.errors,
            "world_size": self.world_size,
            "analytic_params": self.analytic_params,
            "engine_params": self.engine_params,
            "engine_bytes": self.engine_bytes,
            "relative_error": self.relative_error,
            "seconds": self.seconds,
        }

    def print(self, console: Console | None = None) -> None:
        console = console or Console()
        head = f"dry run over a fake process group of {self.world_size:,} ranks"
        if self.errors:
            console.print(f"{head}: the engine refuses this layout")
            for e in self.errors:
                console.print(f"  - {escape(e)}", style="red")
            return
        console.print(
            f"{head} ({self.seconds:.1f} s): rank {self.rank} holds {self.engine_params:,} "
            f"parameters ({self.engine_bytes / 2**30:,.2f} GiB); the planner says "
            f"{self.analytic_params:,.0f} ({self.relative_error:.3%} apart)"
        )
        if not self.ok:
            console.print(
                f"  - the planner's count is more than {TOLERANCE:.1%} from the engine's: its "
                "memory figures for this layout cannot be trusted (a planner bug; please "
                "report it with this command)",
                style="red",
            )


def dry_run(cfg: Config, plan: Plan) -> DryRun:
    """Shard the meta-device model over a fake group of plan.world_size ranks."""
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    # torch: the planner imports this module, the dry run alone builds
    from launcher.parallel import build
    from launcher.runtime.distributed import mesh_dist

    mem, lay = plan.memory, plan.layout
    pp_rank = mem.rank if mem else 0
    # The parameters that rank keeps at rest (the planner's memory counts them at their peak:
    # gathered from forward to backward under ZeRO-2, or over a pipeline's micro-batches).
    analytic = 0.0
    if plan.context is not None:
        layers, dense = layout_ranks(plan.context, lay)[pp_rank]
        analytic = rank_params(plan.context, lay, pp_rank, layers, dense).at_rest(lay)
    result = DryRun(plan.world_size, analytic, rank=pp_rank * plan.world_size // plan.layout.pp)
    refused = engine_problems(cfg, plan.layout)
    if refused:
        result.errors = [str(p) for p in refused]
        return result
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=plan.world_size)
    try:
        d = mesh_dist(lay, "cpu", torch.device("meta"), rank=0)
        # The trainer's own build (launcher.parallel.build), for that pipeline rank's stages
        # (FSDP shards as on any dp coordinate 0), stopping short of allocating on meta.
        parts = [m for _, m in build(cfg, lay, d, pp_rank).stages]
        local = [
            p.to_local() if hasattr(p, "to_local") else p
            for part in parts
            for p in part.parameters()
        ]
        result.engine_params = sum(t.numel() for t in local)
        result.engine_bytes = sum(t.numel() * t.element_size() for t in local)  # master dtype
    except Exception as e:  # the engine's own refusal, reported rather than raised
        result.errors.append(f"{type(e).__name__}: {e}")
    finally:
        dist.destroy_process_group()
    result.seconds = time.perf_counter() - start
    return result
