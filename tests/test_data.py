"""Batching is layout-free; token files round-trip through `launcher.prepare`."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from conftest import read_metrics, run_cli

from launcher.data import Batches, ByteTokenizer, embedded_tokens, load_tokens, split


def global_batch(data, k, dp, micro, g=16):
    """Concatenate every data-parallel rank's micro-batches of global batch k."""
    parts = [
        x for r in range(dp) for x, _ in Batches(data, g, micro, r, dp, 0, True).micro_batches(k)
    ]
    return torch.cat(parts)


def test_embedded_corpus_is_real_text():
    tokens = embedded_tokens()
    text = ByteTokenizer().decode(tokens[:2000])
    assert len(tokens) > 400_000 and "statement" in text and tokens[-1] == ByteTokenizer.eos_id


@pytest.mark.parametrize(("dp", "micro"), [(2, 4), (4, 1), (8, 2), (16, 1)])
def test_global_batches_do_not_depend_on_layout(dp, micro):
    train, _ = split(embedded_tokens(), 64, 0.05)
    for k in (0, 1, 57):
        assert torch.equal(global_batch(train, k, dp, micro), global_batch(train, k, 1, 16))


def test_targets_are_inputs_shifted_by_one():
    train, _ = split(embedded_tokens(), 32, 0.05)
    ((x, y),) = Batches(train, 2, 2, 0, 1, 0, True).micro_batches(3)
    assert x.shape == y.shape == (2, 32) and torch.equal(x[:, 1:], y[:, :-1])


def test_epochs_reshuffle_and_validation_does_not():
    train, val = split(embedded_tokens(), 64, 0.05)
    per_epoch = train.n_windows // 16
    b = Batches(train, 16, 16, 0, 1, 0, True)
    first, second = b.micro_batches(0)[0][0], b.micro_batches(per_epoch)[0][0]
    assert not torch.equal(first, second)
    v = Batches(val, 4, 4, 0, 1, 0, False).micro_batches(0)[0][0]
    assert torch.equal(v[0], torch.from_numpy(val.window(0)[:-1]))


def test_train_and_validation_do_not_overlap():
    tokens = np.arange(10_000) % 1000
    train, val = split(tokens, 16, 0.1)
    assert len(train.tokens) + len(val.tokens) == len(tokens) and len(val.tokens) == 1000


@pytest.mark.e2e
def test_prepare_round_trip_and_train_on_it(tmp_path):
    docs = {"a.txt": "hello world\n" * 300, "b.txt": "naïve café " * 300}
    for name, text in docs.items():
        (tmp_path / name).write_text(text, encoding="utf-8")
    out = tmp_path / "tok" / "corpus"
    result = run_cli("launcher.prepare", "--out", str(out), *(str(tmp_path / n) for n in docs))
    assert result.returncode == 0, result.stderr
    header = json.loads(out.with_suffix(".json").read_text())
    assert header["dtype"] == "uint16" and header["vocab_size"] == 257
    tokens, vocab = load_tokens(str(out.with_suffix(".bin")))
    assert vocab == 257
    eos = np.flatnonzero(np.asarray(tokens) == ByteTokenizer.eos_id)
    assert len(eos) == 2 and header["n_tokens"] == len(tokens)
    assert ByteTokenizer().decode(tokens[: eos[0]]) == docs["a.txt"]
    assert ByteTokenizer().decode(tokens[eos[0] + 1 : eos[1]]) == docs["b.txt"]

    run_dir = tmp_path / "run"
    result = run_cli(
        "launcher.train",
        f"data.path={out}.bin",
        "hardware.devices_per_node=1",
        "train.steps=3",
        "train.seq_len=32",
        "train.eval_interval=0",
        "logging.wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(read_metrics(run_dir)) == 3


def test_prepare_refuses_missing_files(tmp_path):
    result = run_cli("launcher.prepare", "--out", str(tmp_path / "x"), str(tmp_path / "nope.txt"))
    assert result.returncode == 2 and "not a file" in result.stderr
