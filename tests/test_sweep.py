"""The sweep summary from a sweep directory's files (launcher/sweep.py), without running."""

from __future__ import annotations

import json

from rich.console import Console

from launcher import sweep
from launcher.runtime import sweep_files


def job(root, n, overrides, rejected=None, steps=None, losses=(), status=None):
    d = root / str(n)
    sweep_files.write_json(d / sweep_files.OVERRIDES, overrides)
    if rejected:
        sweep_files.write_json(d / sweep_files.REJECTED, {"problems": rejected})
    if steps is not None:
        plan = {
            "degrees": {"dp_replicate": 1, "dp_shard": 2, "tp": 2, "cp": 1, "pp": 2, "ep": 1},
            "layout": {
                "schedule": "1f1b",
                "stages_per_rank": 1,
                "zero_stage": 1,
                "micro_batch_size": 2,
                "recompute": "full",
            },
            "predicted": {"tokens_per_s_per_device": 100.0, "mfu": 0.5},
            "memory_gib": {"total": 2.0},
            "train_steps": steps,
        }
        sweep_files.write_json(d / sweep_files.PLAN, plan)
    rows = [
        {"step": i + 1, "loss": loss, "tokens_per_s": 50.0 + i, "mfu": 0.1, "peak_memory_gib": 1}
        for i, loss in enumerate(losses)
    ]
    if rows:
        (d / sweep_files.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))
    if status:
        sweep_files.write_json(d / sweep_files.STATUS, status)


def test_every_status_and_the_figures_beside_the_plans(tmp_path):
    common = ["train.steps=3"]
    problems = "the plan has 1 problem:\n  - [tp] tp=3 must divide n_heads=8"
    job(tmp_path, 0, ["parallel.tp=1", *common], steps=3, losses=[5.0, 4.0, 3.5])
    job(tmp_path, 1, ["parallel.tp=3", *common], rejected=problems)
    job(tmp_path, 2, ["parallel.tp=2", *common], steps=3, losses=[5.0], status=None)
    job(
        tmp_path,
        10,
        ["parallel.tp=4", *common],
        steps=3,
        losses=[5.0],
        status={"status": "failed", "reason": "job 7 was killed"},
    )
    job(
        tmp_path,
        3,
        ["parallel.tp=8", *common],
        steps=3,
        losses=[5.0, 4.0, 3.0],
        status={"status": "completed", "requeued": 1},
    )
    rows = sweep_files.summarize(tmp_path)
    assert [r["job"] for r in rows] == ["0", "1", "2", "3", "10"]  # numeric order
    by = {r["job"]: r for r in rows}
    assert by["0"]["status"] == "completed" and by["0"]["loss"] == 3.5
    assert by["0"]["layout"] == "dp 1x2 tp 2 pp 2 1f1b/1 zero 1 mb 2 recompute full"
    assert by["0"]["tokens_per_s"] == 52.0  # the median after the first step: 51, 52
    assert by["0"]["predicted_tokens_per_s"] == 100.0 and by["0"]["predicted_memory_gib"] == 2.0
    assert (
        by["1"]["status"] == "rejected" and by["1"]["reason"] == "[tp] tp=3 must divide n_heads=8"
    )
    assert by["2"]["status"] == "incomplete"
    assert by["10"]["status"] == "failed" and by["10"]["reason"] == "job 7 was killed"
    assert by["3"]["status"] == "completed" and by["3"]["requeued"] == 1
    written = [json.loads(x) for x in (tmp_path / sweep_files.SUMMARY).read_text().splitlines()]
    assert written == rows
    console = Console(record=True, width=200)
    console.print(sweep.summary_table(rows, "sweep"))
    text = console.export_text()
    assert "every point: train.steps=3" in text
    assert "rejected (below)" in text and "[tp] tp=3" not in text  # the table stays narrow
    (line,) = sweep.rejected_lines(rows)
    assert line == "#1 rejected (parallel.tp=3 train.steps=3): [tp] tp=3 must divide n_heads=8"
    assert "completed (requeued 1x)" in text and "52 / 100" in text


def test_each_layout_a_point_ran_on_and_its_eval_loss(tmp_path):
    """A parallel.auto point requeued onto fewer nodes ran on two layouts: the summary names
    both, in order; the eval loss is the last one measured."""
    job(tmp_path, 0, ["train.steps=4"], steps=4, losses=[5.0, 4.0, 3.5, 3.0])
    job(tmp_path, 1, ["train.steps=4"], steps=4, losses=[5.0, 4.0, 3.5, 3.0])
    metrics = tmp_path / "1" / sweep_files.METRICS
    rows = [json.loads(x) for x in metrics.read_text().splitlines()]
    for r in rows:
        r["layout"] = "4 rank(s): dp_shard=4" if r["step"] <= 2 else "2 rank(s): dp_shard=2"
    rows[1]["eval_loss"], rows[3]["eval_loss"] = 4.25, None  # the last evaluation: step 2
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    by = {r["job"]: r for r in sweep_files.summarize(tmp_path)}
    assert by["0"]["layouts"] == [] and by["0"]["eval_loss"] is None
    assert by["0"]["layout"].startswith("dp 1x2 tp 2")  # one layout: the plan's words
    assert by["1"]["layouts"] == ["4 rank(s): dp_shard=4", "2 rank(s): dp_shard=2"]
    assert by["1"]["layout"] == "4 rank(s): dp_shard=4 -> 2 rank(s): dp_shard=2"
    assert by["1"]["eval_loss"] == 4.25
    console = Console(record=True, width=200)
    console.print(sweep.summary_table(list(by.values()), "sweep"))
    text = console.export_text()
    assert "4.2500" in text and "eval loss" in text
