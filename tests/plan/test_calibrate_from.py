"""`python -m launcher.plan.calibrate --from SWEEP_DIR` on a sweep whose speeds are known."""

from __future__ import annotations

import json

import pytest

from launcher.cli import compose
from launcher.plan import calibrate, kernels, make_plan
from launcher.runtime import sweep_files

POINTS = [
    ["hardware.devices_per_node=2", "parallel.tp=1"],
    ["hardware.devices_per_node=2", "parallel.tp=2"],
    ["hardware.devices_per_node=4", "train.seq_len=256"],
]


def fake_sweep(root, efficiency: float, noise=(1.0, 1.0, 1.0)) -> None:
    """Completed jobs whose measured speed is what the planner predicts at `efficiency`
    (times `noise`), as launcher.train would leave them."""
    for n, (overrides, factor) in enumerate(zip(POINTS, noise, strict=True)):
        write_job(
            root / str(n),
            overrides,
            calibrate.predicted_speed(compose(overrides), efficiency) * factor,
        )


def write_job(d, overrides: list[str], speed: float) -> None:
    """One completed job of 3 steps at `speed` tokens/s per device."""
    sweep_files.write_json(d / sweep_files.OVERRIDES, overrides)
    sweep_files.write_json(d / sweep_files.PLAN, {"train_steps": 3})
    rows = [{"step": s, "loss": 1.0, "tokens_per_s": speed} for s in (1, 2, 3)]
    (d / sweep_files.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))


def residuals(out: str) -> tuple[float, float]:
    """The RMS relative residuals (percent) before and after, from the printed line."""
    line = next(x for x in out.splitlines() if x.startswith("RMS"))
    before, after = (float(w.rstrip("%,")) for w in line.split() if w.endswith(("%", "%,")))
    return before, after


def test_the_refit_recovers_the_efficiency_the_runs_had(tmp_path, capsys):
    fake_sweep(tmp_path, 0.037)
    default = make_plan(compose(POINTS[0])).context.efficiency
    assert default == compose(["hardware=cpu"]).hardware.efficiency  # an explicit rate: as is
    assert kernels.model_efficiency(128, 1.0) < default  # the A100 fit at dim 128
    runs = calibrate.measured_runs(str(tmp_path))
    assert len(runs) == 3
    cfgs = [cfg for _, cfg in runs]
    fitted = calibrate.fit_efficiency(cfgs, [row["tokens_per_s"] for row, _ in runs])
    assert fitted == pytest.approx(0.037, rel=0.005)
    calibrate.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    assert fitted_values(out)["efficiency"] == pytest.approx(0.037, rel=0.005)
    before, after = residuals(out)
    assert before > 50 and after < 0.5  # percent: the grid's resolution


def fitted_values(out: str) -> dict[str, float]:
    """The hardware.X=V overrides of the printed "use it with" line."""
    line = next(x for x in out.splitlines() if "use it with" in x)
    return {
        k.removeprefix("hardware."): float(v)
        for k, v in (w.split("=") for w in line.split() if w.startswith("hardware.") and "=" in w)
        if k != "hardware"
    }


def test_a_micro_batch_sweep_refits_the_per_op_host_time_too(tmp_path, capsys):
    """Micro-batches 1, 2 and 4 of one layout differ by their count of launches per step: the
    refit recovers both the kernels' efficiency and the host's time per operator the runs
    were made with, and prints where the remaining error sits, term by term."""
    true = {"efficiency": 0.05, "op_overhead_us": 40.0}
    for n, b in enumerate((1, 2, 4)):
        overrides = ["hardware.devices_per_node=2", f"train.micro_batch_size={b}"]
        cfg = calibrate.with_hardware(compose(overrides), **true)
        write_job(tmp_path / str(n), overrides, make_plan(cfg).estimate.tokens_per_s_per_device)
    calibrate.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    got = fitted_values(out)
    assert got["efficiency"] == pytest.approx(0.05, rel=0.02)
    assert got["op_overhead_us"] == pytest.approx(40.0, rel=0.05)
    assert residuals(out)[1] < 0.5
    assert "residual by term" in out and "compute (" in out


def test_noisy_runs_land_between_and_the_residuals_shrink(tmp_path, capsys):
    fake_sweep(tmp_path, 0.05, noise=(0.9, 1.1, 1.0))
    calibrate.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    before, after = residuals(out)
    assert after < before and after < 10


def test_an_override_uses_the_measured_efficiency_and_bad_values_are_refused():
    cfg = compose(["hardware.efficiency=0.02"])
    assert make_plan(cfg).context.efficiency == 0.02
    plan = make_plan(compose(["hardware.efficiency=1.5"]))
    assert any("hardware.efficiency=1.5 must be in [0, 1]" in p.message for p in plan.errors)


def test_nothing_measured_exits_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        calibrate.main(["--from", str(tmp_path)])
    assert e.value.code == 2
    assert "no completed job" in capsys.readouterr().err


def test_compiled_and_eager_runs_get_one_efficiency_each(tmp_path, capsys):
    """A refitted hardware.efficiency is the measured one of runs as configured, so a sweep
    over train.compile refits each setting apart."""
    point = ["hardware.devices_per_node=2"]
    for n, (extra, efficiency) in enumerate([([], 0.03), (["train.compile=true"], 0.05)]):
        overrides = point + extra
        write_job(
            tmp_path / str(n), overrides, calibrate.predicted_speed(compose(overrides), efficiency)
        )
    calibrate.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    eager = next(x for x in out.splitlines() if "use it with hardware=cpu hardware." in x)
    compiled = next(x for x in out.splitlines() if "use it with hardware=cpu train.compile" in x)
    assert fitted_values(eager)["efficiency"] == pytest.approx(0.03, rel=0.01)
    assert fitted_values(compiled)["efficiency"] == pytest.approx(0.05, rel=0.01)
