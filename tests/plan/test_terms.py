"""A step's time is the list of cost terms registered in launcher.plan.terms.TERMS: the
report, the JSON and the search iterate over it, so a new term is one function plus one entry
in the list."""

from __future__ import annotations

import json

import pytest
from conftest import compose_config

from launcher.plan import make_plan, terms
from launcher.plan.report import plan_json, plan_table
from launcher.plan.search import explain, search, time_shares
from launcher.plan.terms.base import Step, Term


def straggler(step: Step) -> Term:
    """A hypothetical term: the slowest of the data-parallel ranks arrives 5% of the compute
    late to every step."""
    late = 0.05 * step.done["compute"].exposed
    return Term("straggler", late, late)


@pytest.fixture
def with_straggler(monkeypatch):
    monkeypatch.setattr(terms, "TERMS", (*terms.TERMS, straggler))


def test_the_step_is_the_sum_of_its_terms():
    plan = make_plan(compose_config(["recipe=llama3_405b_8192gpu"]))
    tm = plan.estimate.time
    assert [t.name for t in tm.terms] == [n for n in terms.NAMES if tm.term(n) is not None]
    assert tm.step == pytest.approx(sum(t.exposed for t in tm.terms))
    assert {"compute", "recompute", "tp", "pp", "dp", "optimizer"} <= {t.name for t in tm.terms}
    assert tm["cp"] == 0.0 and tm.term("cp") is None  # a layout without CP has no CP term
    for t in tm.terms:
        assert 0 <= t.exposed <= t.work + 1e-12


def test_a_new_term_reaches_the_report_the_json_and_the_search(with_straggler):
    cfg = compose_config(["model=llama3_8b", "hardware=h100_80g", "train.global_batch_size=64"])
    plan = make_plan(cfg)
    tm = plan.estimate.time
    assert tm["straggler"] == pytest.approx(0.05 * tm["compute"])
    from rich.console import Console

    console = Console(width=200, record=True)
    console.print(plan_table(plan))
    assert "straggler" in console.export_text()
    data = json.loads(json.dumps(plan_json(plan)))
    assert data["predicted"]["terms"]["straggler"]["exposed_s"] == pytest.approx(tm["straggler"])
    _, fitting = search(cfg)
    assert all(e.time["straggler"] > 0 for e in fitting[:5])
    assert "straggler" in time_shares(fitting[0], n=len(fitting[0].time.terms))
    assert explain(fitting[0], fitting[1]).startswith(("#1 over #2", "#1 and #2 tie"))


def test_the_plan_says_document_masking_and_the_named_validation_sets():
    """Settings that change what a run computes or reports are in the plan's table; the
    defaults (causal attention, each source's held-out tail) go unsaid."""
    from rich.console import Console

    def text(*overrides: str) -> str:
        console = Console(width=200, record=True)
        console.print(plan_table(make_plan(compose_config(list(overrides)))))
        return console.export_text()

    default = text()
    assert "document masking" not in default and "evaluation" not in default
    shown = text("data.attention=document", "data.val_sources={wiki: w.bin, code: c.bin}")
    assert "document masking: a token attends within its own document" in shown
    assert "eval/wiki (w.bin), eval/code (c.bin), every 50 steps, 4 global batches each" in shown
    assert "never (train.eval_interval=0)" in text(
        "data.val_sources={wiki: w.bin}", "train.eval_interval=0"
    )
