"""launcher.plan.compare: the verdict names what stops a layout, and the table has one row per
variant (its figures are the planner's, checked in the docs' and recipes' generated blocks)."""

from __future__ import annotations

import pytest
from conftest import compose_config

from launcher.plan import engine_plan
from launcher.plan.compare import generate, main, three_digits, verdict


def test_verdict_names_the_rules_and_says_nothing_of_memory_it_has_not():
    """tp=3 on 8 GPUs: no degree fills the world, so no memory is known (not "does not fit")."""
    refused = engine_plan(compose_config(["model=llama3_8b", "hardware=h100_80g", "parallel.tp=3"]))
    assert refused.memory is None
    assert verdict(refused) == "refused (tp_ffn, tp_heads, world_size)"
    assert verdict(engine_plan(compose_config([]))) == "fits"
    big = engine_plan(
        compose_config(["model=llama3_70b", "hardware=h100_80g", "train.micro_batch_size=2"])
    )
    assert verdict(big) == "does not fit"


def test_rows_and_comment_form():
    text = generate(["--rows", "", "train.micro_batch_size=1", "--columns", "step", "--comment"])
    lines = text.splitlines()
    assert lines[0].startswith("# | overrides | step s |") and len(lines) == 4
    assert lines[2].startswith("# | as written |")
    assert lines[3].startswith("# | `train.micro_batch_size=1` |")


def test_three_significant_digits_keep_their_zeros():
    assert [three_digits(x) for x in (12.0, 127.3, 4.912, 0.5, 99.96)] == [
        "12.0",
        "127",
        "4.91",
        "0.500",
        "100",
    ]


def test_a_bad_override_ends_in_one_line_and_exit_2(capsys):
    """As launcher.train and launcher.plan: the checks' wording, no traceback."""
    with pytest.raises(SystemExit) as e:
        main(["model=llama3_dbug", "--rows", ""])
    assert e.value.code == 2
    assert "error: model=llama3_dbug: no such model (did you mean llama3_debug" in (
        capsys.readouterr().err
    )
