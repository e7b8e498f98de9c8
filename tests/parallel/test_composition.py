"""Composition property: random layouts over every axis and option, at debug scale on 2 to 8
CPU ranks, either train like one process or are refused by a limitation of the table.

A seeded generator draws the world size, the family (tied embeddings or not), how the world
splits into dp_replicate, dp_shard, tp, pp and cp, ep for the MoE families, the data-parallel
setting, the schedule, the recompute mode and its `every`, sequence parallelism and the CP
method. A draw that breaks a planner rule (a degree that does not divide, too few
micro-batches) is not a layout and is drawn again; one that a limitation of the table refuses
(the planner and launcher.train both refuse it by that record's message) counts as drawn and
is not trained; every other one is a parity row (tests/parity.py: losses within 1e-5, gradient
norms, final parameters). `make test` runs
SAMPLES of them; HYPOTHESIS_PROFILE=thorough (`make test-all`) ten times as many. A failing
row's id is its overrides: paste them after `python -m launcher.train` to reproduce it.
"""

from __future__ import annotations

import os
import random

import pytest
from conftest import compose_config
from parity import BASE, assert_row, rows

from launcher.plan import engine_plan

pytestmark = pytest.mark.dist

SEED = 24
SAMPLES = 80 if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else 8
MODELS = {
    "llama3_debug": [],
    "llama3_debug tied": ["model.tie_embeddings=true"],
    "gpt_debug": ["model.dropout=0.0"],  # tied by default
    "mixtral_debug": [],
    "deepseek_debug": [],
}
SCHEDULES = {  # schedule: stages per rank
    "gpipe": 1,
    "1f1b": 1,
    "interleaved_1f1b": 2,
    "interleaved_zb": 2,
    "zbv": 2,
    "dualpipev": 2,
}


def draw(rng: random.Random) -> tuple[list[str], list[str]]:
    """(model overrides, layout overrides) of one random layout."""
    name = rng.choice(list(MODELS))
    model = [f"model={name.split()[0]}", *MODELS[name]]
    world = rng.choice([2, 4, 4, 8])
    degrees = dict.fromkeys(("dp_replicate", "dp_shard", "tp", "pp", "cp"), 1)
    for _ in range(world.bit_length() - 1):  # world is a power of two: hand out its factors
        degrees[rng.choice(list(degrees))] *= 2
    layout = [f"hardware.devices_per_node={world}"]
    layout += [f"parallel.{axis}={n}" for axis, n in degrees.items()]
    if name.startswith(("mixtral", "deepseek")):
        borrow = degrees["dp_shard"] * degrees["cp"] * degrees["tp"]
        layout.append(f"parallel.ep={rng.choice([e for e in (1, 2, 4) if borrow % e == 0])}")
    layout.append(f"data_parallel={rng.choice(['ddp', 'zero1', 'zero2', 'fsdp'])}")
    if degrees["pp"] > 1:
        schedule = rng.choice(list(SCHEDULES))
        layout += [f"pipeline={schedule}", f"pipeline.stages_per_rank={SCHEDULES[schedule]}"]
        layout.append("train.micro_batch_size=1")  # enough micro-batches to fill the pipe
    recompute = rng.choice(["none", "selective", "op", "full"])
    layout.append(f"recompute={recompute}")
    if recompute in ("op", "full"):
        layout.append(f"recompute.every={rng.choice([1, 2])}")
    if degrees["tp"] > 1 and rng.random() < 0.5:
        layout.append("tensor=sequence_parallel")
    if degrees["cp"] > 1:
        layout.append(f"context={rng.choice(['allgather', 'ring'])}")
    return model, layout


def sample(seed: int, n: int) -> dict:
    """{label: (model, layout)} of the first n draws that are layouts, less those a limitation
    refuses."""
    rng = random.Random(seed)
    trains, drawn = {}, 0
    while drawn < n:
        model, layout = draw(rng)
        cfg = compose_config([*BASE, *model, *layout])
        plan = engine_plan(cfg)
        if any(p.rule != "not_available" for p in plan.errors):
            continue  # not a valid layout (the planner's rules and their tests cover these)
        drawn += 1
        if not plan.errors:
            trains[" ".join([*model, *layout])] = (model, layout)
    return trains


TRAINS = sample(SEED, SAMPLES)


@pytest.mark.parametrize("row", rows(TRAINS))
def test_a_random_layout_trains_like_one_process(row, group):
    assert_row(group, row)
