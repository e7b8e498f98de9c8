"""Error bands: every prediction's low and high figure, from the held-out residuals of its class.

A residual is what a held-out run measured over what the planner predicts for it: its tokens/s
per device, and its peak memory without the reserve (the part the planner models). The
residuals are data (launcher/plan/residuals.py), written by `python -m launcher.plan.held_out
--write` from the published runs held out in launcher/plan/published.py and this
engine's held-out runs in docs/measured; tests/plan/test_bands.py fails when they no longer
match the runs and the planner.

A run's class is its part (the die its hardware preset's figures come from: PARTS), its engine's
kind (this engine, and torchtitan, are "fsdp2": published.py's kinds), dense or MoE, and
compiled or not. A class with fewer than MIN_RUNS residuals gives way to the next wider one in
WIDER (fewer of those four fields), and the band names the class it used. The band is the 90%
prediction interval of the class's log residuals (Student's t with n - 1 degrees of freedom,
mean +- t s sqrt(1 + 1/n)), widened to hold the point prediction itself: its low and high figures
never cross the planner's own, so the fit verdict on the high memory never accepts more than the
point figure did.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

from launcher.plan import residuals

# The die each preset's figures were fitted on (calibrate.FITTED_ON): h800 and b200 take
# h100_80g's figures but were measured nowhere, so they are their own parts, with no residual.
PARTS = {
    "h100_80g": "GH100",
    "h200": "GH100",
    "h100_hbm2e": "H100 HBM2e 500 W",
    "a100_80g": "A100",
    "cpu": "cpu",
}
FIELDS = ("part", "engine", "moe", "compiled")
# The classes tried, narrowest first: the fields each keeps.
WIDER = (
    FIELDS,
    ("part", "engine", "compiled"),
    ("part", "engine"),
    ("engine", "moe", "compiled"),
    ("engine", "compiled"),
    ("engine",),
    (),
)
MIN_RUNS = 3
# Student's t, one-sided 0.95 quantile (a two-sided 90% interval), by degrees of freedom; a df
# between two entries takes the smaller one's (the wider interval).
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860}
T95 |= {9: 1.833, 10: 1.812, 12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697, 60: 1.671, 120: 1.658}


@dataclass(frozen=True)
class Residual:
    """One held-out run: its class and measured / predicted (memory: None where unmeasured)."""

    name: str
    part: str
    engine: str
    moe: bool
    compiled: bool
    speed: float
    memory: float | None

    def key(self, fields: tuple[str, ...]) -> tuple:
        return tuple(getattr(self, f) for f in fields)


RESIDUALS = tuple(Residual(*row) for row in residuals.ROWS)


@dataclass(frozen=True)
class Spread:
    """The ratio measured / predicted a class's held-out runs put around a prediction."""

    low: float
    high: float
    runs: int
    of: str  # the class, in words

    def around(self, point: float) -> tuple[float, float]:
        """The band of a figure whose measured value goes as this ratio."""
        return point * min(1.0, self.low), point * max(1.0, self.high)


def t95(df: int) -> float:
    return T95[max(k for k in T95 if k <= df)]


def interval(ratios: list[float]) -> tuple[float, float]:
    """The 90% prediction interval of one more ratio, from these (log-normal)."""
    logs = [math.log(r) for r in ratios]
    n = len(logs)
    mean = sum(logs) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in logs) / (n - 1))
    half = t95(n - 1) * sd * math.sqrt(1 + 1 / n)
    return math.exp(mean - half), math.exp(mean + half)


def describe(probe: Residual, fields: tuple[str, ...]) -> str:
    words = {
        "part": probe.part,
        "engine": probe.engine,
        "moe": "MoE" if probe.moe else "dense",
        "compiled": "compiled" if probe.compiled else "eager",
    }
    return ", ".join(words[f] for f in fields) or "every run"


def spread(probe: Residual, kind: str, rows=RESIDUALS) -> Spread:
    """The band of `kind` ("speed" or "memory") for a run of `probe`'s class: the narrowest class
    of WIDER with MIN_RUNS residuals of that kind in `rows` (probe's own row left out)."""
    measured = [r for r in rows if getattr(r, kind) is not None and r.name != probe.name]
    for fields in WIDER:
        same = [getattr(r, kind) for r in measured if r.key(fields) == probe.key(fields)]
        if len(same) >= MIN_RUNS:
            return Spread(*interval(same), len(same), describe(probe, fields))
    return Spread(1.0, 1.0, len(same), "too few held-out runs for a band")


def class_of(cfg) -> Residual:
    """A probe for `cfg`'s class (a plan is this engine's: fsdp2)."""
    hw = cfg.hardware
    part = PARTS.get(hw.name) or ("cpu" if hw.device_type.value == "cpu" else hw.name)
    moe = cfg.model.n_routed_experts > 0
    return Residual("", part, "fsdp2", moe, cfg.train.compile, 1.0, 1.0)


@dataclass(frozen=True)
class Ratios:
    """A config's speed and memory spreads (layout-independent: Context holds them)."""

    speed: Spread
    memory: Spread


def ratios(cfg) -> Ratios:
    return class_ratios(class_of(cfg))


@lru_cache(maxsize=64)  # a few classes; a search or a sweep plans many configs of one
def class_ratios(probe: Residual) -> Ratios:
    return Ratios(spread(probe, "speed"), spread(probe, "memory"))


@dataclass(frozen=True)
class Band:
    """A prediction's low and high figures: step seconds, tokens/s per device, and the most
    loaded rank's memory in bytes (its reserve taken as is)."""

    step_s: tuple[float, float]
    tokens_per_s: tuple[float, float]
    memory: tuple[float, float]
    speed_from: str
    memory_from: str
    # The speed spread's relative half-width, its offset from the point left out: what two
    # predictions of one class may be off against each other (the search's ties).
    spread: float = 0.0


def memory_band(r: Ratios, total: float, reserve: float) -> tuple[float, float]:
    low, high = r.memory.around(total - reserve)
    return reserve + low, reserve + high


def band(r: Ratios, step: float, tokens_per_s: float, total: float, reserve: float) -> Band:
    slow, fast = r.speed.around(tokens_per_s)
    return Band(
        step_s=(step * tokens_per_s / fast, step * tokens_per_s / slow),
        tokens_per_s=(slow, fast),
        memory=memory_band(r, total, reserve),
        speed_from=f"{r.speed.runs} held-out runs ({r.speed.of})",
        memory_from=f"{r.memory.runs} held-out runs ({r.memory.of})",
        spread=math.sqrt(r.speed.high / r.speed.low) - 1,
    )
