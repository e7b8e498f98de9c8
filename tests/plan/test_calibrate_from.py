"""`python -m launcher.plan.calibrate --from SWEEP_DIR` on a sweep whose speeds are known."""

from __future__ import annotations

import json

import pytest

from launcher import sweep
from launcher.cli import compose
from launcher.plan import calibrate, make_plan

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
    sweep.write_json(d / sweep.OVERRIDES, overrides)
    sweep.write_json(d / sweep.PLAN, {"train_steps": 3})
    rows = [{"step": s, "loss": 1.0, "tokens_per_s": speed} for s in (1, 2, 3)]
    (d / sweep.METRICS).write_text("".join(json.dumps(r) + "\n" for r in rows))


def residuals(out: str) -> tuple[float, float]:
    """The RMS relative residuals (percent) before and after, from the printed line."""
    line = next(x for x in out.splitlines() if x.startswith("RMS"))
    before, after = (float(w.rstrip("%,")) for w in line.split() if w.endswith(("%", "%,")))
    return before, after


def test_the_refit_recovers_the_efficiency_the_runs_had(tmp_path, capsys):
    fake_sweep(tmp_path, 0.037)
    default = make_plan(compose(POINTS[0])).context.efficiency
    assert default == pytest.approx(0.1321, abs=1e-3)  # the Megatron fit at dim 128
    runs = calibrate.measured_runs(str(tmp_path))
    assert len(runs) == 3
    cfgs = [cfg for _, cfg in runs]
    fitted = calibrate.fit_efficiency(cfgs, [row["tokens_per_s"] for row, _ in runs])
    assert fitted == pytest.approx(0.037, rel=0.005)
    calibrate.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    assert "hardware.efficiency=0.037" in out
    before, after = residuals(out)
    assert before > 50 and after < 0.3  # percent: the grid's resolution


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
    assert "use it with hardware=cpu hardware.efficiency=0.030" in out
    assert "use it with hardware=cpu train.compile=true hardware.efficiency=0.050" in out
