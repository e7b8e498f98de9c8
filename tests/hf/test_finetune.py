"""Fine-tuning end to end, against transformers: a tiny BPE with a Llama 3-style chat template
and a tiny Llama built here (nothing downloaded); launcher.prepare --chat, launcher.train from
the Hugging Face directory, launcher.convert to-hf, launcher.generate --chat."""

from __future__ import annotations

import gzip
import json

import pytest
import torch
from conftest import compose_config, read_metrics, run_cli
from test_chat import tokenizer_dir, write_jsonl

from hf import hf_models
from launcher.data.batches import EMBEDDED

pytestmark = pytest.mark.e2e

VOCAB = 520  # the test tokenizer: 512 BPE tokens and the chat template's 5 special ones
STEP = ["train.global_batch_size=4", "train.micro_batch_size=2", "precision=fp32",
        "train.seq_len=256", "train.eval_interval=0", "train.warmup_steps=1"]  # fmt: skip


def chat_records(n: int = 60) -> list[dict]:
    """Conversations of the corpus's paragraphs: a system line now and then, a question, an
    answer, sometimes a second exchange; of unequal lengths."""
    with gzip.open(EMBEDDED) as f:
        text = f.read(200_000).decode("utf-8", errors="replace")
    paragraphs = [p.strip()[:160] for p in text.split("\n\n") if len(p.strip()) > 20]
    out = []
    for i in range(n):
        a, b, c = paragraphs[3 * i : 3 * i + 3]
        turns = [{"role": "system", "content": "Answer briefly."}] if i % 3 == 0 else []
        turns += [{"role": "user", "content": a[:60]}, {"role": "assistant", "content": b}]
        if i % 4 == 1:
            turns += [{"role": "user", "content": "And then?"},
                      {"role": "assistant", "content": c[:40]}]  # fmt: skip
        out.append({"messages": turns})
    return out


def transformers_batch_loss(model, x, y, eos_id: int) -> tuple[float, int]:
    """The mean cross-entropy over the targets that are not -100, each document (up to and
    including its EOS) run alone through transformers' model, as document masking means; and
    how many targets that is."""
    total = torch.zeros((), dtype=torch.float64)
    count = 0
    for row in range(x.shape[0]):
        ends = [i + 1 for i, t in enumerate(x[row].tolist()) if t == eos_id]
        for a, b in zip([0, *ends], [*ends, x.shape[1]], strict=True):
            if a == b:
                continue
            with torch.no_grad():
                logits = model(x[row : row + 1, a:b]).logits[0]
            target = y[row, a:b]
            kept = target != -100
            ce = torch.nn.functional.cross_entropy(logits, target.clamp(min=0), reduction="none")
            total = total + ce[kept].double().sum()
            count += int(kept.sum())
    return float(total / count), count


def test_fine_tune_from_hugging_face_and_back(tmp_path, capsys):
    """Prepare a chat set, train 2 steps from a transformers Llama, export: the first step's
    loss is transformers' masked loss of the same batch (1e-5, fp32) and not its loss over
    every target; the export loads in transformers, its tokenizer's chat template formats a
    conversation exactly as the source tokenizer's, and generate answers a chat prompt."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok_dir = tokenizer_dir(tmp_path / "tok", "llama3")
    records = chat_records()
    write_jsonl(tmp_path / "chat.jsonl", records)
    out = tmp_path / "data" / "chat"
    # prepare, convert and generate in this process (their `main`: a Python and torch start-up
    # less each; launcher.prepare and launcher.convert run as commands in tests/test_data.py
    # and tests/hf/test_convert.py), the training as the command.
    from launcher import convert, generate, prepare

    assert prepare.main(["--chat", "--tokenizer", str(tok_dir / "tokenizer.json"),
                         "--out", str(out), str(tmp_path / "chat.jsonl")]) == 0  # fmt: skip
    src = hf_models.save(hf_models.build("llama", vocab_size=VOCAB), tmp_path / "hf")
    run_dir = tmp_path / "run"
    overrides = [*hf_models.LLAMA_RUN, f"model.vocab_size={VOCAB}", f"data.path={out}.bin", *STEP]
    result = run_cli(
        "launcher.train", *overrides, "train.steps=2", "hardware.devices_per_node=1",
        "logging.wandb.mode=disabled", f"checkpoint.initial_load_path={src}",
        "checkpoint.initial_load_format=hf", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    first = read_metrics(run_dir)[0]

    # The same first batch, from the data as the run reads it, through transformers' model.
    from launcher.data.batches import Batches
    from launcher.data.sources import run_data

    cfg = compose_config(overrides)
    t = cfg.train
    data = run_data(cfg.data, t.seq_len)
    ((x, y),) = Batches(data.train, t.global_batch_size, t.global_batch_size, 0, 1, t.seed,
                        True).at(0)  # fmt: skip
    theirs = AutoModelForCausalLM.from_pretrained(src).eval()
    masked, count = transformers_batch_loss(theirs, x, y, data.eos_id)
    assert first["trained_tokens"] == count
    assert first["loss"] == pytest.approx(masked, rel=1e-5), (first["loss"], masked)
    with torch.no_grad():
        every = torch.nn.functional.cross_entropy(
            theirs(x).logits.flatten(0, 1), x.new_tensor(y).clamp(min=0).flatten()
        )
    assert abs(float(every) - masked) > 1e-2  # the mask counts

    exported = tmp_path / "exported"
    capsys.readouterr()
    assert convert.main(["to-hf", str(run_dir), str(exported)]) == 0
    assert "tokenizer_config.json" in capsys.readouterr().out
    model = AutoModelForCausalLM.from_pretrained(exported)
    assert model.config.vocab_size == VOCAB
    config = json.loads((exported / "config.json").read_text())
    source_tok, exported_tok = (AutoTokenizer.from_pretrained(str(d)) for d in (tok_dir, exported))
    eot = source_tok.convert_tokens_to_ids("<|eot_id|>")
    assert eot in config["eos_token_id"]  # generation stops after an answer
    for record in records[:5]:
        for prompt in (False, True):
            kw = {"tokenize": False, "add_generation_prompt": prompt}
            turns = record["messages"] if not prompt else record["messages"][:-1]
            assert exported_tok.apply_chat_template(turns, **kw) == source_tok.apply_chat_template(
                turns, **kw
            )

    question = "What does the with statement do?"
    assert generate.main([str(run_dir), "--chat", "--prompt", question, "--temperature", "0",
                          "--max-new-tokens", "8"]) == 0  # fmt: skip
    answer = capsys.readouterr()
    asked = source_tok.apply_chat_template(
        [{"role": "user", "content": question}], tokenize=True, add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]  # fmt: skip
    assert f"{len(asked)} prompt + " in answer.err, answer.err  # the template's tokens
    assert question not in answer.out  # the answer alone
