"""Batching is layout-free; token files round-trip through `launcher.prepare` (byte-level or a
Hugging Face tokenizer.json); the plan refuses a token file that does not fit the run."""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import re

import numpy as np
import pytest
import torch
from conftest import compose_config, read_metrics, run_cli
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from launcher.data.batches import (
    EMBEDDED,
    FORMAT,
    Batches,
    ByteTokenizer,
    data_sizes,
    embedded_tokens,
    load_tokens,
    read_header,
    split,
    split_sizes,
    write_tokens,
)
from launcher.plan import make_plan
from launcher.prepare import main as prepare_main


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


# -- your own data: Hugging Face tokenizers, JSON lines, token file headers ------------------


def bpe_tokenizer(path, vocab_size=512):
    """A byte-level BPE trained on the first 64 KB of the embedded corpus, saved as path."""
    with gzip.open(EMBEDDED) as f:
        text = f.read(65536).decode("utf-8", errors="replace")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(text.split("\n\n"), trainer)
    tok.save(str(path))
    return tok


def word_tokenizer(path, words):
    """A WordLevel tokenizer over whitespace-separated words: word i has id i."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token=words[0]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path))
    return tok


def prepare(*args):
    """launcher.prepare in this process: (exit status, its stderr line or the stdout line)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = prepare_main([str(a) for a in args])
    return status, err.getvalue() or out.getvalue()


def documents_of(path, eos_id):
    """The token ids of each document of a token file, EOS removed."""
    tokens = np.asarray(load_tokens(str(path))[0])
    ends = np.flatnonzero(tokens == eos_id)
    assert ends[-1] == len(tokens) - 1, "the file does not end with EOS"
    return [d[:-1].tolist() for d in np.split(tokens, ends + 1)[:-1]]


@pytest.fixture(scope="module")
def bpe(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "tokenizer.json"
    return path, bpe_tokenizer(path)


def test_prepare_with_a_trained_tokenizer_from_text_and_json_lines(tmp_path, bpe):
    path, tok = bpe
    text = "def f(x):\n    return x + 1\n" * 20
    (tmp_path / "a.txt").write_text(text)
    lines = ["The with statement.", "", "naïve café ∑ 😀", ""]  # blank lines are skipped
    jsonl = "\n".join(json.dumps({"id": i, "text": t}) if t else "" for i, t in enumerate(lines))
    (tmp_path / "b.jsonl").write_text(jsonl)
    out = tmp_path / "tok" / "corpus"
    status, msg = prepare(
        "--tokenizer", path, "--out", out, tmp_path / "a.txt", tmp_path / "b.jsonl"
    )
    assert status == 0, msg
    assert "from 3 document(s)" in msg and "<|endoftext|> (id 0" in msg

    header = json.loads(out.with_suffix(".json").read_text())
    assert header["version"] == 2 and header["tokenizer"] == "huggingface"
    assert header["tokenizer_path"] == str(path.resolve())
    assert header["tokenizer_sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()
    assert header["eos_token"] == "<|endoftext|>" and header["eos_id"] == 0
    assert header["vocab_size"] == tok.get_vocab_size(with_added_tokens=True) == 512
    assert header["dtype"] == "uint16"
    assert header["n_tokens"] * 2 == out.with_suffix(".bin").stat().st_size
    assert header["sources"] == [str(tmp_path / "a.txt"), str(tmp_path / "b.jsonl")]
    docs = documents_of(out.with_suffix(".bin"), 0)
    assert [tok.decode(d) for d in docs] == [text, lines[0], lines[2]]
    assert docs[0] == tok.encode(text).ids  # the same ids as encoding the document alone
    assert data_sizes(str(out.with_suffix(".bin"))) == (header["n_tokens"], 512)


def test_prepare_without_a_tokenizer_stays_byte_level(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"body": "héllo"}\n{"body": "x"}\n')
    status, msg = prepare("--text-field", "body", "--out", tmp_path / "c", tmp_path / "a.jsonl")
    header = json.loads((tmp_path / "c.json").read_text())
    assert status == 0 and header["tokenizer"] == "bytes" and header["vocab_size"] == 257
    assert header["eos_id"] == 256 and header["tokenizer_path"] is None
    assert documents_of(tmp_path / "c.bin", 256) == [list("héllo".encode()), [ord("x")]]


WORDS = ["<unk>", "</s>", "<|end_of_text|>", "<my_end>", "hello", "world"]


def prepare_with_words(tmp_path, words, config, flag, text):
    """prepare one document with a word-level tokenizer (and tokenizer_config.json if given)."""
    word_tokenizer(tmp_path / "tokenizer.json", words)
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "a.txt").write_text(text)
    tok = tmp_path / "tokenizer.json"
    return prepare("--tokenizer", tok, *flag, "--out", tmp_path / "t", tmp_path / "a.txt")


@pytest.mark.parametrize(
    ("config", "flag", "expected"),
    [
        (None, [], "<|end_of_text|>"),  # first of the well-known end tokens in the vocabulary
        ({"eos_token": "</s>"}, [], "</s>"),  # tokenizer_config.json over the well-known list
        ({"eos_token": {"content": "<my_end>", "lstrip": False}}, [], "<my_end>"),
        ({"eos_token": None}, [], "<|end_of_text|>"),
        ({"eos_token": "</s>"}, ["--eos", "<my_end>"], "<my_end>"),  # --eos over everything
    ],
)
def test_eos_detection_order(tmp_path, config, flag, expected):
    status, msg = prepare_with_words(tmp_path, WORDS, config, flag, "hello world")
    header = json.loads((tmp_path / "t.json").read_text())
    assert status == 0, msg
    assert header["eos_token"] == expected and header["eos_id"] == WORDS.index(expected)
    assert documents_of(tmp_path / "t.bin", header["eos_id"]) == [[4, 5]]


@pytest.mark.parametrize(
    ("words", "config", "flag", "expected"),
    [
        (["<unk>", "hello"], None, [], "pass --eos TOKEN"),
        (WORDS, None, ["--eos", "<stop>"], "EOS token '<stop>' (from --eos) is not in the vocab"),
        (WORDS, {"eos_token": "<eot>"}, [], "'<eot>' (from tokenizer_config.json) is not in the"),
    ],
    ids=["none found", "--eos unknown", "config eos unknown"],
)
def test_eos_that_cannot_be_found_exits_2(tmp_path, words, config, flag, expected):
    status, msg = prepare_with_words(tmp_path, words, config, flag, "hello")
    assert status == 2 and expected in msg
    assert not list(tmp_path.glob("t.*"))


def test_a_vocabulary_past_65536_is_written_as_uint32(tmp_path):
    words = ["<unk>", "</s>", *(f"w{i}" for i in range(2, 70_000))]
    tok = word_tokenizer(tmp_path / "tokenizer.json", words)
    (tmp_path / "a.txt").write_text("w69999 w2 w65536 w65535")
    status, msg = prepare(
        "--tokenizer", tmp_path / "tokenizer.json", "--out", tmp_path / "t", tmp_path / "a.txt"
    )
    header = json.loads((tmp_path / "t.json").read_text())
    assert status == 0, msg
    assert header["dtype"] == "uint32" and header["vocab_size"] == tok.get_vocab_size() == 70_000
    assert (tmp_path / "t.bin").stat().st_size == 4 * header["n_tokens"]
    assert np.fromfile(tmp_path / "t.bin", dtype="<u4").tolist() == [69999, 2, 65536, 65535, 1]


def test_a_vocabulary_with_a_gap_is_sized_by_its_largest_id(tmp_path):
    tok = Tokenizer(models.WordLevel({"<unk>": 0, "</s>": 1, "far": 700}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "a.txt").write_text("far far")
    status, msg = prepare(
        "--tokenizer", tmp_path / "tokenizer.json", "--out", tmp_path / "t", tmp_path / "a.txt"
    )
    assert status == 0, msg
    assert tok.get_vocab_size(with_added_tokens=True) == 3  # the count misses the gap
    assert json.loads((tmp_path / "t.json").read_text())["vocab_size"] == 701


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"text": "a",', "b.jsonl:3: not valid JSON"),
        ('{"txt": "a"}', "b.jsonl:3: no field 'text' (fields: txt)"),
        ('["a"]', "b.jsonl:3: a JSON list, not an object"),
        ('{"text": 7}', "b.jsonl:3: field 'text' is not a string (int)"),
    ],
)
def test_a_bad_json_line_exits_2_naming_file_and_line(tmp_path, line, expected):
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "b.jsonl").write_text(f'{{"text": "ok"}}\n\n{line}\n{{"text": "after"}}\n')
    status, msg = prepare("--out", tmp_path / "t", tmp_path / "a.txt", tmp_path / "b.jsonl")
    assert status == 2 and expected in msg
    assert not list(tmp_path.glob("t.*")), "a failed prepare left a (partial) token file"


def test_a_failed_prepare_keeps_the_earlier_token_file(tmp_path):
    (tmp_path / "a.txt").write_text("hello")
    (tmp_path / "bad.jsonl").write_text("{}\n")
    assert prepare("--out", tmp_path / "t", tmp_path / "a.txt")[0] == 0
    before = {p.name: p.read_bytes() for p in tmp_path.glob("t.*")}
    assert prepare("--out", tmp_path / "t", tmp_path / "a.txt", tmp_path / "bad.jsonl")[0] == 2
    assert {p.name: p.read_bytes() for p in tmp_path.glob("t.*")} == before


def test_sharded_output_replaced_by_renames_and_put_back_after_a_kill_between(
    tmp_path, monkeypatch
):
    """A sharded --out is replaced by renaming the old one aside, not deleting it first: a
    prepare killed between the two renames leaves it, and the next prepare puts it back."""
    from pathlib import Path

    (tmp_path / "a.txt").write_text("hello " * 50)
    out = tmp_path / "shards"
    assert prepare("--shard-tokens", 100, "--out", out, tmp_path / "a.txt")[0] == 0
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    real = Path.rename

    def killed_between(self, target):
        if self.name.endswith(".partial"):
            raise SystemExit(137)  # as a SIGKILL there: nothing after it runs
        return real(self, target)

    monkeypatch.setattr(Path, "rename", killed_between)
    with pytest.raises(SystemExit):
        prepare("--shard-tokens", 50, "--out", out, tmp_path / "a.txt")
    monkeypatch.undo()
    assert not out.exists() and (tmp_path / ".shards.prepare-replaced").is_dir()
    (tmp_path / "bad.jsonl").write_text("{}\n")  # the next prepare fails, after the put-back
    status, said = prepare("--shard-tokens", 50, "--out", out, tmp_path / "bad.jsonl")
    assert status == 2 and said.startswith(f"{out}: put back (a prepare replacing it was stopped)")
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before


def test_write_tokens_writes_the_header_after_the_tokens(tmp_path):
    def chunks():
        yield np.array([1, 2, 3])
        assert not (tmp_path / "t.json").exists() and not (tmp_path / "t.bin").exists()
        raise KeyboardInterrupt  # prepare interrupted half-way

    tokenizer = {"vocab_size": 8, "eos_id": 3}
    with pytest.raises(KeyboardInterrupt):
        write_tokens(str(tmp_path / "t"), chunks(), tokenizer, [])
    assert not list(tmp_path.iterdir())
    with pytest.raises(ValueError, match="token id 9 is outside the vocabulary of 8"):
        write_tokens(str(tmp_path / "t"), iter([np.array([9])]), tokenizer, [])


def test_prepare_cli_errors_exit_2_without_traceback(tmp_path):
    (tmp_path / "a.jsonl").write_text("not json\n")
    bad = run_cli("launcher.prepare", "--out", str(tmp_path / "t"), str(tmp_path / "a.jsonl"))
    assert bad.returncode == 2 and f"{tmp_path / 'a.jsonl'}:1: not valid JSON" in bad.stderr
    tok = run_cli(
        "launcher.prepare",
        "--tokenizer",
        str(tmp_path / "a.jsonl"),
        "--out",
        "x",
        str(tmp_path / "a.jsonl"),
    )
    assert tok.returncode == 2 and "is not a tokenizer.json" in tok.stderr
    assert "Traceback" not in bad.stderr + tok.stderr


def test_version_1_headers_are_still_read(tmp_path):
    np.arange(40, dtype=np.uint16).tofile(tmp_path / "old.bin")
    v1 = {"format": FORMAT, "version": 1, "dtype": "uint16", "n_tokens": 40, "vocab_size": 257}
    v1 |= {"tokenizer": "bytes", "eos_id": 256, "sources": ["a.txt"]}
    (tmp_path / "old.json").write_text(json.dumps(v1))
    tokens, vocab = load_tokens(str(tmp_path / "old.bin"))
    assert vocab == 257 and np.asarray(tokens).tolist() == list(range(40))
    assert data_sizes(str(tmp_path / "old.bin")) == (40, 257)
    (tmp_path / "old.json").write_text(json.dumps({**v1, "version": 3}))
    with pytest.raises(ValueError, match="version 3; this launcher reads versions 1, 2"):
        read_header(str(tmp_path / "old.bin"))


def test_a_truncated_bin_is_not_a_token_file(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    assert prepare("--out", tmp_path / "t", tmp_path / "a.txt")[0] == 0
    with open(tmp_path / "t.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(ValueError, match="has 10 bytes but its header promises n_tokens=12"):
        data_sizes(str(tmp_path / "t.bin"))


@pytest.mark.parametrize("seq_len", [1, 7, 128, 1000])
@pytest.mark.parametrize("val_fraction", [0.01, 0.05, 0.1, 0.5, 0.9, 0.99])
def test_the_minimum_named_is_the_true_minimum(seq_len, val_fraction):
    with pytest.raises(ValueError) as refused:
        split_sizes(3, seq_len, val_fraction)
    need = int(re.search(r"at least ([\d,]+) tokens", str(refused.value))[1].replace(",", ""))
    n_train, n_val = split_sizes(need, seq_len, val_fraction)
    assert n_train >= seq_len + 1 and n_val >= seq_len + 1 and n_train + n_val == need
    with pytest.raises(ValueError, match=f"n_tokens={need - 1:,} is too few"):
        split_sizes(need - 1, seq_len, val_fraction)


def test_split_refuses_what_the_plan_refuses():
    with pytest.raises(ValueError, match="n_tokens=33 is too few for train.seq_len=128"):
        split(np.zeros(33, dtype=np.uint16), 128, 0.05)
    train, val = split(np.zeros(258, dtype=np.uint16), 128, 0.05)
    assert train.n_windows == val.n_windows == 1


@pytest.fixture(scope="module")
def small_files(tmp_path_factory, bpe):
    """A 33-token byte-level file and a 512-token-vocabulary file."""
    d = tmp_path_factory.mktemp("small")
    (d / "a.txt").write_text("x" * 32)
    assert prepare("--out", d / "tiny", d / "a.txt")[0] == 0
    (d / "b.txt").write_text("def f(x):\n    return x\n" * 500)
    assert prepare("--tokenizer", bpe[0], "--out", d / "bpe", d / "b.txt")[0] == 0
    return d


def test_plan_refuses_a_token_file_too_small_for_the_run(small_files):
    plan = make_plan(compose_config([f"data.path={small_files / 'tiny.bin'}"]))
    assert [p.rule for p in plan.errors] == ["data_size"]
    msg = plan.errors[0].message
    assert f"data.path={small_files / 'tiny.bin'}: n_tokens=33 is too few" in msg
    assert "train.seq_len=128 with data.val_fraction=0.05" in msg and "at least 258" in msg
    ok = make_plan(compose_config([f"data.path={small_files / 'tiny.bin'}", "train.seq_len=15"]))
    assert ok.valid, ok.errors


def test_plan_refuses_a_vocabulary_the_model_cannot_hold(small_files):
    path = small_files / "bpe.bin"
    plan = make_plan(compose_config([f"data.path={path}"]))
    assert [p.rule for p in plan.errors] == ["vocab"]
    assert f"model.vocab_size=320 is smaller than the vocabulary of data.path={path}, 512" in (
        plan.errors[0].message
    )
    assert make_plan(compose_config([f"data.path={path}", "model.vocab_size=512"])).valid


TOO_SMALL = (
    "data.path={}: n_tokens=33 is too few for train.seq_len=128 with data.val_fraction=0.05: "
    "training and validation each need a window of seq_len + 1 = 129 tokens, so at least 258 tokens"
)
TOO_BIG = (
    "model.vocab_size=320 is smaller than the vocabulary of data.path={}, 512 tokens "
    "(model=llama3_debug): set model.vocab_size >= 512"
)


@pytest.mark.e2e
@pytest.mark.parametrize(
    ("name", "rule", "expected"),
    [("tiny", "data_size", TOO_SMALL), ("bpe", "vocab", TOO_BIG)],
    ids=["too small", "vocabulary too big"],
)
def test_cli_refuses_unfit_token_files_before_any_process(small_files, name, rule, expected):
    path = small_files / f"{name}.bin"
    train = run_cli("launcher.train", f"data.path={path}", "logging.wandb.mode=disabled")
    assert train.returncode == 2, train.stderr[-3000:]
    assert f"error: the plan has 1 problem:\n  - [{rule}] {expected.format(path)}\n" in train.stderr
    assert "Traceback" not in train.stderr and "torch.distributed.run" not in train.stderr
    plan = run_cli("launcher.plan", f"data.path={path}", "plan.format=json")
    assert plan.returncode == 2 and "Traceback" not in plan.stderr
    assert json.loads(plan.stdout)["errors"] == [{"rule": rule, "message": expected.format(path)}]


def write_parquet(path, texts, column="text", row_group_size=None):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(
        pa.table({column: texts, "id": list(range(len(texts)))}),
        path,
        row_group_size=row_group_size,
    )


def test_parquet_jsonl_and_text_with_workers_and_shards_give_one_stream(tmp_path, bpe):
    """Parquet (its text column, several row groups), JSON lines and text, tokenized two files
    at a time in processes of their own and cut into shards between documents: the same ids,
    in the order given, as one process writing one file; the shards read as one source."""
    path, tok = bpe
    texts = [f"Document {i}: " + "word " * (i % 7 + 1) for i in range(60)]
    write_parquet(tmp_path / "a.parquet", texts[:30], row_group_size=8)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[30:50]))
    (tmp_path / "c.txt").write_text(texts[50])
    (tmp_path / "d.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in texts[51:]))
    inputs = [tmp_path / n for n in ("a.parquet", "b.jsonl", "c.txt", "d.jsonl")]
    one = tmp_path / "one" / "all"
    status, msg = prepare("--tokenizer", path, "--out", one, *inputs)
    assert status == 0 and "from 60 document(s)" in msg, msg
    sharded = tmp_path / "sharded" / "all"
    status, msg = prepare(
        "--tokenizer", path, "--workers", 2, "--shard-tokens", 100, "--out", sharded, *inputs
    )
    assert status == 0 and "from 60 document(s)" in msg and "shard(s) of at most 100" in msg, msg
    whole = np.asarray(load_tokens(str(one.with_suffix(".bin")))[0])
    assert [tok.decode(d) for d in documents_of(one.with_suffix(".bin"), 0)] == texts
    shards = sorted(sharded.glob("all-*.bin"))
    assert len(shards) > 3
    parts = [np.asarray(load_tokens(str(s))[0]) for s in shards]
    assert (np.concatenate(parts) == whole).all()
    assert all(len(p) <= 100 and p[-1] == 0 for p in parts)  # cut after an EOS, within the limit
    from launcher.data.sources import read_source

    source = read_source("x", str(sharded), 1.0)
    assert source.files == tuple(str(s) for s in shards) and source.n_tokens == len(whole)


@pytest.mark.parametrize(
    ("make", "expected"),
    [
        (lambda p: write_parquet(p, ["a"], column="body"), "no column 'text' (columns: body, id)"),
        (lambda p: write_parquet(p, ["a", None]), "row 1 of column 'text' is null"),
        (lambda p: p.write_bytes(b"PAR1 not really"), "is not a Parquet file"),
        (lambda p: write_parquet(p, []), "holds no rows"),
    ],
    ids=["no column", "null row", "not parquet", "no rows"],
)
def test_bad_parquet_exits_2_naming_it(tmp_path, make, expected):
    make(tmp_path / "in.parquet")
    status, msg = prepare("--out", tmp_path / "x", tmp_path / "in.parquet")
    assert status == 2 and expected in msg and "Traceback" not in msg, msg


def test_a_bad_file_in_a_worker_exits_2_naming_it(tmp_path):
    (tmp_path / "a.txt").write_text("fine")
    (tmp_path / "b.jsonl").write_text('{"txt": 1}\n')
    status, msg = prepare(
        "--workers", 2, "--out", tmp_path / "x", tmp_path / "a.txt", tmp_path / "b.jsonl"
    )
    assert status == 2 and "b.jsonl:1: no field 'text'" in msg, msg
    assert not list(tmp_path.glob(".x*")) and not (tmp_path / "x.bin").exists()


@pytest.mark.parametrize(("flag", "value"), [("--workers", 0), ("--shard-tokens", 0)])
def test_workers_and_shard_size_must_be_positive(tmp_path, flag, value):
    (tmp_path / "a.txt").write_text("fine")
    status, msg = prepare(flag, value, "--out", tmp_path / "x", tmp_path / "a.txt")
    assert status == 2 and f"{flag} 0 must be at least 1" in msg, msg
