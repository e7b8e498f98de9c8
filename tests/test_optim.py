"""The learning-rate schedules (linear warmup, then cosine, linear, constant or
warmup-stable-decay to min_lr at the last step) and train.adamw: which of torch's AdamW
implementations a run uses, and that a checkpoint crosses between them."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from conftest import compose_config
from test_bf16_moments import KWARGS, tiny_model, train  # the same tiny model and loop

from launcher.config import AdamWImpl, DType, PrecisionConfig, TrainConfig
from launcher.plan import make_plan
from launcher.training.optim import Optimizers, adamw_impl, lr_at


def test_warmup_then_cosine_to_min_lr():
    t = TrainConfig(steps=100, warmup_steps=10, lr=1.0, min_lr=0.1)
    lrs = [lr_at(s, t) for s in range(t.steps)]
    assert lrs[:10] == pytest.approx([(i + 1) / 10 for i in range(10)])
    assert lrs[-1] == pytest.approx(0.1)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    middle = 10 + (100 - 10 - 1) / 2
    assert lr_at(math.floor(middle), t) == pytest.approx(0.55, abs=0.02)


def test_no_warmup_starts_at_peak():
    t = TrainConfig(steps=5, warmup_steps=0, lr=2.0, min_lr=0.0)
    assert lr_at(0, t) == pytest.approx(2.0) and lr_at(4, t) == pytest.approx(0.0)


# Each schedule's value at chosen steps of 100 with 10 of warmup (lr 1.0 -> min_lr 0.1); the
# decay runs over steps 10..99, progress (step - 10) / 89.
SCHEDULES = {
    "cosine": {0: 0.1, 9: 1.0, 10: 1.0, 99: 0.1},
    "linear": {0: 0.1, 10: 1.0, 99: 0.1, 10 + 89 // 2: 0.1 + 0.9 * (1 - 44 / 89)},
    "constant": {0: 0.1, 9: 1.0, 10: 1.0, 50: 1.0, 99: 1.0},
    # decay_fraction 0.2: flat until progress 0.8 (step 81.2), then linear to 0.1 at step 99.
    "wsd": {10: 1.0, 50: 1.0, 81: 1.0, 90: 0.1 + 0.9 * (1 - 80 / 89) / 0.2, 99: 0.1},
}


@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_each_schedule_at_chosen_steps(schedule):
    t = TrainConfig(
        steps=100, warmup_steps=10, lr=1.0, min_lr=0.1, lr_schedule=schedule, decay_fraction=0.2
    )
    for step, want in SCHEDULES[schedule].items():
        assert lr_at(step, t) == pytest.approx(want), (schedule, step)
    lrs = [lr_at(s, t) for s in range(10, 100)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:], strict=False))  # never rises after warmup


@pytest.mark.parametrize(
    ("impl", "device", "moments", "want"),
    [
        ("auto", "cpu", "fp32", {}),  # torch's default: the for-loop the parity tests compare
        ("auto", "cuda", "fp32", {"fused": True}),
        ("auto", "cuda", "bf16", {}),  # MomentDtypeAdamW's own loop
        ("fused", "cpu", "fp32", {"fused": True}),
        ("foreach", "cpu", "fp32", {"foreach": True}),
        ("for_loop", "cuda", "fp32", {"foreach": False}),
    ],
)
def test_train_adamw_chooses_torch_adamw_keywords(impl, device, moments, want):
    t = TrainConfig(adamw=AdamWImpl(impl))
    prec = PrecisionConfig(optimizer_dtype=DType(moments))
    assert adamw_impl(t, prec, SimpleNamespace(device=torch.device(device))) == want


def test_fused_adamw_is_the_for_loop_update_to_rounding():
    fused, loop = tiny_model(), tiny_model()
    train(torch.optim.AdamW(fused.parameters(), fused=True, **KWARGS), fused, 5)
    train(torch.optim.AdamW(loop.parameters(), foreach=False, **KWARGS), loop, 5)
    for a, b in zip(fused.parameters(), loop.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    start = tiny_model().parameters()
    assert all(not torch.equal(a, b) for a, b in zip(fused.parameters(), start, strict=True))


def test_a_checkpoint_resumes_in_the_loading_runs_adamw():
    """A fused run's checkpoint (a GPU's) loads into a for-loop optimizer (a CPU's): moments and
    steps arrive, the loader's fused/foreach stay; the run goes on as if uninterrupted."""
    saved_model = tiny_model()
    saved = torch.optim.AdamW(saved_model.parameters(), fused=True, **KWARGS)
    train(saved, saved_model, 3)
    # Copies, as a checkpoint read from disk gives (torch's optimizers keep the tensors given).
    state = {
        k: v.clone() if isinstance(v, torch.Tensor) else v
        for k, v in Optimizers([(saved_model, saved)]).state_dict().items()
    }
    assert state["param_groups.0.weight.fused"] is True
    model = tiny_model()
    model.load_state_dict(saved_model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), foreach=False, **KWARGS)
    Optimizers([(model, opt)]).load_state_dict(state)
    assert (opt.param_groups[0]["fused"], opt.param_groups[0]["foreach"]) == (None, False)
    for p, q in zip(model.parameters(), saved_model.parameters(), strict=True):
        assert torch.equal(opt.state[p]["exp_avg_sq"], saved.state[q]["exp_avg_sq"])
        assert opt.state[p]["step"].item() == 3
    train(opt, model, 2)
    train(saved, saved_model, 2)
    for a, b in zip(model.parameters(), saved_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_fused_adamw_needs_moments_of_the_weights_dtype():
    plan = make_plan(compose_config(["precision=bf16_moments", "train.adamw=fused"]))
    assert [p.rule for p in plan.errors] == ["precision"]
    assert "train.adamw=fused needs precision.optimizer_dtype equal to master_dtype" in (
        plan.errors[0].message
    )
    assert make_plan(compose_config(["precision=bf16_moments", "train.adamw=for_loop"])).valid
