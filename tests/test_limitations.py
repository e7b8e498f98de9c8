"""The limitations table: the README's copy is generated from it, and each record refuses the
layouts it names (with its message) and nothing else of the ones shown here."""

from __future__ import annotations

import re

import pytest
from conftest import ROOT, compose_config

from launcher.limitations import LIMITATIONS, markdown
from launcher.plan import engine_plan


def test_readme_lists_the_table():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"<!-- limitations:start -->\n(.*?)<!-- limitations:end -->", text, re.S)
    assert block, "README.md lost its limitations block"
    assert block.group(1) == markdown(), "regenerate it: python -m launcher.limitations"


def test_each_record_has_evidence_and_a_unique_name():
    names = [x.name for x in LIMITATIONS]
    assert len(set(names)) == len(names)
    assert all(x.evidence and x.summary for x in LIMITATIONS)


# A layout each limitation refuses (debug scale), and the same with the fix its message names.
PP2 = ["hardware.devices_per_node=2", "parallel.pp=2", "parallel.dp_shard=1"]
MOE_PP = ["model=mixtral_debug", "hardware.devices_per_node=4", "parallel.pp=2", "parallel.ep=2"]
CASES = {
    "compile_tp_cpu": (
        ["hardware.devices_per_node=2", "parallel.tp=2", "train.compile=true"],
        ["hardware.devices_per_node=2", "parallel.tp=2"],
    ),
    "cp_family": (
        ["model=deepseek_debug", "hardware.devices_per_node=2", "parallel.cp=2"],
        ["model=deepseek_debug", "hardware.devices_per_node=2", "parallel.tp=2"],
    ),
    "cp_dropout": (
        ["model=gpt_debug", "model.dropout=0.1", "hardware.devices_per_node=2", "parallel.cp=2"],
        ["model=gpt_debug", "model.dropout=0.0", "hardware.devices_per_node=2", "parallel.cp=2"],
    ),
    "split_backward_fsdp": (
        ["hardware.devices_per_node=4", "parallel.pp=2", "pipeline=zbv"],
        ["hardware.devices_per_node=4", "parallel.pp=2", "pipeline=zbv", "data_parallel=ddp"],
    ),
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
