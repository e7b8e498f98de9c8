"""Blends of sources (launcher/data/sources.py): the proportions hold in every window, the order
is a function of the sequence's index alone (the same for every data-parallel layout), a source's
shards read as one stream, and what the plan says about each source."""

from __future__ import annotations

import numpy as np
import pytest
from blend_data import HEADER
from conftest import compose_config

from launcher.data.batches import Batches, Concat, Split, write_tokens
from launcher.data.sources import Blend, run_data, shares
from launcher.plan import make_plan


def test_proportions_hold_over_the_run_and_in_every_window():
    blend = Blend([0.7, 0.2, 0.1])
    source = np.array([blend.locate(i)[0] for i in range(1000)])
    for s, weight in enumerate([0.7, 0.2, 0.1]):
        assert abs((source == s).mean() - weight) <= 0.01
        windows = np.lib.stride_tricks.sliding_window_view(source == s, 100).mean(axis=1)
        assert np.abs(windows - weight).max() <= 0.03


@pytest.mark.parametrize("weights", [[1, 1, 1], [0.5, 0.3, 0.2], [0.999, 0.0005, 0.0005], [3, 1]])
def test_each_source_is_read_in_order_without_gaps(weights):
    blend = Blend(weights, period=2000)
    seen: dict[int, list[int]] = {}
    for i in range(5000):
        s, k = blend.locate(i)
        seen.setdefault(s, []).append(k)
    assert sorted(seen) == list(range(len(weights)))
    assert all(ks == list(range(len(ks))) for ks in seen.values())
    assert sum(shares(weights, 2000)) == 2000 and min(shares(weights, 2000)) >= 1


def test_the_global_batch_is_the_same_for_every_data_parallel_layout():
    rng = np.random.default_rng(0)
    splits = [Split(rng.integers(0, 100, n).astype(np.uint16), 8) for n in (500, 300, 90)]
    blend = Blend([0.6, 0.3, 0.1])

    def global_batch(dp: int, micro: int, k: int) -> np.ndarray:
        rows = []
        for r in range(dp):
            batches = Batches(splits, 24, micro, r, dp, seed=3, shuffle=True, blend=blend)
            rows += [x for inputs, _ in batches.micro_batches(k) for x in inputs.numpy()]
        return np.stack(rows)

    for k in (0, 5, 40):  # 40 global batches of 24 pass several epochs of the small source
        one = global_batch(1, 24, k)
        assert (global_batch(2, 4, k) == one).all() and (global_batch(4, 3, k) == one).all()


def test_shards_read_as_one_stream():
    parts = [np.arange(0, 7), np.arange(7, 10), np.arange(10, 25)]
    whole = Concat(parts)
    assert len(whole) == 25 and (np.asarray(whole[5:20]) == np.arange(5, 20)).all()
    assert (np.asarray(whole[:-3][8:]) == np.arange(8, 22)).all()
    split = Split(whole, 4)
    assert (split.window(3) == np.arange(12, 17)).all()


def write(path, n: int, seed: int) -> str:
    ids = np.random.default_rng(seed).integers(0, 256, n).astype(np.uint32)
    write_tokens(str(path), [ids], HEADER, ["random"])
    return f"{path}.bin"


def test_a_blend_of_a_file_and_a_directory_of_shards(tmp_path):
    a = write(tmp_path / "a", 40_000, 0)
    write(tmp_path / "b" / "part1", 15_000, 1)
    write(tmp_path / "b" / "part2", 5_000, 2)
    held = write(tmp_path / "held", 3_000, 3)
    overrides = [
        f"data.sources=[{{path: {a}, weight: 3}}, {{path: {tmp_path}/b, weight: 1}}]",
        f"data.val_sources={{held: {held}}}",
        "train.steps=1000",
    ]
    cfg = compose_config(overrides)
    plan = make_plan(cfg)
    assert plan.ok, plan.errors
    use = {u.label: u for u in plan.data}
    b = use[f"data.sources[1].path={tmp_path}/b"]
    assert (b.files, b.n_tokens, b.weight) == (2, 20_000, 0.25)
    windows = (20_000 - int(20_000 * 0.05) - 1) // 128
    assert b.epochs == pytest.approx(1000 * 16 * 0.25 / windows)
    assert [w.rule for w in plan.warnings] == ["data_epochs"] * 2  # both read > 4 times
    data = run_data(cfg.data, 128)
    assert [len(s.tokens) for s in data.train] == [38_000, 19_000]
    assert list(data.named) == ["held"] and len(data.named["held"].tokens) == 3_000


def test_finite_weights_whose_sum_overflows_blend_as_their_ratio(tmp_path):
    """1e308 twice sums to inf: normalised by the largest first, each is half (the plan's data
    row said weight 0 and the run died dividing by it)."""
    assert shares([1e308, 1e308], 2000) == [1000, 1000]
    assert shares([1e308, 1e307], 1100) == [1000, 100]
    a, b = write(tmp_path / "a", 20_000, 0), write(tmp_path / "b", 20_000, 1)
    sources = f"data.sources=[{{path: {a}, weight: 1e308}}, {{path: {b}, weight: 1e308}}]"
    plan = make_plan(compose_config([sources]))
    assert plan.ok, plan.errors
    assert [u.weight for u in plan.data] == [0.5, 0.5]
