"""The limitations table (docs/planner.md's copy is checked by tests/test_docs.py): each record
refuses the layouts it names (with its message) and nothing else of the ones shown here."""

from __future__ import annotations

import pytest
from conftest import compose_config

from launcher.plan import composes, engine_plan
from launcher.plan.limitations import LIMITATIONS


@pytest.mark.parametrize(
    "pair", [("HSDP", "EP"), ("ZBV", "recompute=op"), ("TP + SP", "MLA (deepseek)"), ("DDP", "CP")]
)
def test_composes_merges_values_as_hydra_does(pair):
    """The table's configs (the model's composition with single values merged in) equal what
    launcher.train composes from the same overrides."""
    features = tuple(f for f in composes.FEATURES if f.label in pair)
    overrides = composes.overrides(features)
    assert composes.config(overrides) == compose_config(overrides)


def test_each_record_has_evidence_and_a_unique_name():
    names = [x.name for x in LIMITATIONS]
    assert len(set(names)) == len(names)
    assert all(x.evidence and x.summary for x in LIMITATIONS)


# A layout each limitation refuses (debug scale), and the same with the fix its message names.
PP2 = ["hardware.devices_per_node=2", "parallel.pp=2", "parallel.dp_shard=1"]
MOE_PP = ["model=mixtral_debug", "hardware.devices_per_node=4", "parallel.pp=2", "parallel.ep=2"]
CASES = {
    "op_recompute_split_backward": (
        [*PP2, "pipeline=zbv", "recompute=op"],
        [*PP2, "pipeline=zbv", "recompute=full"],
    ),
    "op_recompute_pp_fsdp_experts": (
        [*MOE_PP, "recompute=op"],
        [*MOE_PP, "recompute=op", "data_parallel=ddp"],
    ),
}


def test_every_record_has_a_case():
    assert set(CASES) == {x.name for x in LIMITATIONS}


@pytest.mark.parametrize("name", list(CASES))
def test_the_plan_refuses_what_a_limitation_names_and_takes_its_fix(name):
    record = next(x for x in LIMITATIONS if x.name == name)
    refused, fixed = (engine_plan(compose_config(o)) for o in CASES[name])
    assert [p.rule for p in refused.errors] == ["not_available"], refused.errors
    assert refused.errors[0].message == record.message(refused.cfg, refused.layout)
    assert fixed.ok, fixed.errors
