"""Your own data end to end: a tokenizer trained here -> `launcher.prepare` -> `launcher.train`
-> `launcher.convert to-hf`, which publishes the tokenizer with the model."""

from __future__ import annotations

import json

import pytest
from conftest import read_metrics, run_cli

from launcher.bench.prepare_speed import byte_level_bpe, embedded_paragraphs

pytestmark = pytest.mark.e2e


def test_train_on_a_locally_trained_tokenizer(tmp_path):
    """A 512-token byte-level BPE of the embedded corpus, as the Hugging Face files a model
    ships (tokenizer.json + tokenizer_config.json), tokenizes the corpus as JSON lines; 20 steps
    on one process lower the loss."""
    paragraphs = embedded_paragraphs()
    tok = byte_level_bpe(paragraphs, 512, ["<|begin_of_text|>", "<|end_of_text|>"])
    hf = tmp_path / "hf"
    hf.mkdir()
    tok.save(str(hf / "tokenizer.json"))
    (hf / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|end_of_text|>"}))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": p}) + "\n" for p in paragraphs))

    out = tmp_path / "tokens" / "docs"
    prepared = run_cli(
        "launcher.prepare",
        "--tokenizer",
        str(hf / "tokenizer.json"),
        "--out",
        str(out),
        str(corpus),
    )
    assert prepared.returncode == 0, prepared.stderr
    assert f"from {len(paragraphs):,} document(s)" in prepared.stdout
    header = json.loads(out.with_suffix(".json").read_text())
    assert header["vocab_size"] == 512 and header["eos_token"] == "<|end_of_text|>"
    assert header["eos_id"] == 1 and header["tokenizer"] == "huggingface"

    run_dir = tmp_path / "run"
    result = run_cli(
        "launcher.train",
        f"data.path={out}.bin",
        f"model.vocab_size={header['vocab_size']}",
        "hardware.devices_per_node=1",
        "train.steps=20",
        "train.eval_interval=0",
        "logging.wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [r["loss"] for r in read_metrics(run_dir)]
    assert len(losses) == 20
    assert sum(losses[-5:]) / 5 < losses[0], losses

    # Sampling from it: generate finds the tokenizer through the token file's header.
    sampled = run_cli(
        "launcher.generate", str(run_dir), "--prompt", "The list", "--max-new-tokens", "12"
    )
    assert sampled.returncode == 0, sampled.stderr[-3000:]
    assert sampled.stdout.startswith("The list")
    assert f"Hugging Face {hf / 'tokenizer.json'} tokenizer" in sampled.stderr
    assert f"{len(tok.encode('The list').ids)} prompt + " in sampled.stderr

    # Publishing it: to-hf takes the tokenizer the data was prepared with, and its EOS.
    published = run_cli("launcher.convert", "to-hf", str(run_dir), str(tmp_path / "published"))
    assert published.returncode == 0, published.stderr[-3000:]
    assert "tokenizer.json, tokenizer_config.json from" in published.stdout
    config = json.loads((tmp_path / "published" / "config.json").read_text())
    assert config["eos_token_id"] == header["eos_id"] and config["vocab_size"] == 512
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(tmp_path / "published")
    text = paragraphs[7]
    assert theirs(text)["input_ids"] == tok.encode(text).ids
    assert theirs.eos_token == "<|end_of_text|>"


def test_a_blend_with_a_named_validation_set(tmp_path):
    """Three sources by weight (tests/blend_data.py), document masking, and a named validation
    set: the plan's data row names each source, every eval step logs eval_loss (the sources'
    held-out tails) and eval/<name>, in metrics.jsonl and on the progress line."""
    from blend_data import BLEND, ROOT

    run_dir = tmp_path / "run"
    result = run_cli(
        "launcher.train",
        *BLEND,
        f"data.val_sources={{books: {ROOT}/books.bin}}",
        "hardware.devices_per_node=1",
        "train.steps=4",
        "train.eval_interval=2",
        "train.eval_batches=1",
        "logging.wandb.mode=disabled",
        f"hydra.run.dir={run_dir}",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"│ data               │ {ROOT}/web.bin: " in result.stdout
    assert f"{ROOT}/code (2 files): " in result.stdout and ", weight 0.3, " in result.stdout
    rows = read_metrics(run_dir)
    evals = [(r["step"], sorted(k for k in r if k.startswith("eval"))) for r in rows]
    assert evals == [
        (1, []),
        (2, ["eval/books", "eval_loss"]),
        (3, []),
        (4, ["eval/books", "eval_loss"]),
    ]
    assert rows[-1]["eval/books"] != rows[-1]["eval_loss"]
    assert f"eval/books {rows[-1]['eval/books']:.4f}" in result.stdout
