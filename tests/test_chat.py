"""launcher.prepare --chat (launcher/data/chat.py) against transformers: a tiny BPE with a
Llama 3-style and a ChatML-style chat template, built here; the rendered tokens equal
apply_chat_template's, and the loss mask equals the assistant mask transformers computes from
the same template with {% generation %} tags around each answer (an independent reckoning of
which tokens are the answers')."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_data import bpe_tokenizer, prepare

from launcher.data.batches import data_sizes, load_tokens
from launcher.data.sources import read_source

LLAMA_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>",
                  "<|end_header_id|>", "<|eot_id|>"]  # fmt: skip
HEAD = "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'"
LLAMA = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ " + HEAD + " + message['content'] | trim + '<|eot_id|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}"
    "{% endif %}"
)
# The same template, each answer (its content and end of turn) inside {% generation %}.
LLAMA_TAGGED = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% generation %}"
    "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
    "{% else %}{{ " + HEAD + " + message['content'] | trim + '<|eot_id|>' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
CHATML = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_TAGGED = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}"
    "{{ '<|im_start|>assistant\\n' }}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
    "{% endgeneration %}{% else %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
STYLES = {
    "llama3": (LLAMA, LLAMA_TAGGED, LLAMA_SPECIALS, "<|begin_of_text|>", "<|eot_id|>"),
    "chatml": (CHATML, CHATML_TAGGED, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"], None,
               "<|im_end|>"),
}  # fmt: skip

CONVERSATIONS = [
    {"messages": [
        {"role": "system", "content": "You answer in one line."},
        {"role": "user", "content": "What does the with statement do?"},
        {"role": "assistant", "content": "It runs a block inside a context manager."},
        {"role": "user", "content": "And try?"},
        {"role": "assistant", "content": "It catches the exceptions a block raises."},
    ]},
    {"prompt": "Name a built-in type.", "completion": "The dict."},
    {"messages": [{"role": "user", "content": "naïve café ∑"},
                  {"role": "assistant", "content": "Unicode text."}]},
]  # fmt: skip


def tokenizer_dir(path, style: str):
    """tokenizer.json (a BPE with the style's special tokens) and tokenizer_config.json with
    its chat template, as a released model ships them."""
    template, _, specials, bos, eos = STYLES[style]
    path.mkdir(parents=True, exist_ok=True)
    tok = bpe_tokenizer(path / "tokenizer.json")
    tok.add_special_tokens(specials)
    tok.save(str(path / "tokenizer.json"))
    config = {"eos_token": eos, "chat_template": template,
              "tokenizer_class": "PreTrainedTokenizerFast"}  # fmt: skip
    if bos:
        config["bos_token"] = bos
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


def transformers_reference(path, style: str, record: dict) -> tuple[list[int], list[int]]:
    """(ids, assistant mask) of a conversation by transformers: apply_chat_template of the
    tokenizer as loaded from its directory, the mask from the tagged template."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    messages = record.get("messages") or [
        {"role": "user", "content": record["prompt"]},
        {"role": "assistant", "content": record["completion"]},
    ]
    ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
    tagged = tok.apply_chat_template(
        messages, chat_template=STYLES[style][1], tokenize=True, return_dict=True,
        return_assistant_tokens_mask=True,
    )  # fmt: skip
    assert list(tagged["input_ids"]) == list(ids)
    return list(ids), list(tagged["assistant_masks"])


def conversations_of(out, eos_id):
    """(ids, mask) of each conversation of a chat set, the EOS prepare appends removed."""
    ids = np.asarray(load_tokens(str(out))[0])
    mask = np.fromfile(out.with_suffix(".mask"), dtype=np.uint8)
    assert mask.shape == ids.shape
    ends = np.flatnonzero(ids == eos_id)
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [(ids[a:b].tolist(), mask[a:b].tolist()) for a, b in zip(starts, ends, strict=True)]


def write_jsonl(path, records):
    path.write_text("\n".join(json.dumps(r) for r in records) + "\n")
    return path


@pytest.mark.parametrize("style", STYLES)
def test_chat_tokens_and_mask_equal_transformers(tmp_path, style):
    """Each conversation's tokens are apply_chat_template's; its mask is 1 exactly on the
    tokens transformers' assistant mask marks (each answer and its end of turn), so not on
    the system and user turns; the EOS prepare appends is not trained on."""
    tok_dir = tokenizer_dir(tmp_path / "tok", style)
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    out = tmp_path / "out" / "chat"
    status, msg = prepare("--chat", "--tokenizer", tok_dir / "tokenizer.json", "--out", out, data)
    assert status == 0, msg
    header = json.loads(out.with_suffix(".json").read_text())
    eos = header["eos_id"]
    got = conversations_of(out, eos)
    assert len(got) == len(CONVERSATIONS)
    trained = 0
    for (ids, mask), record in zip(got, CONVERSATIONS, strict=True):
        ref_ids, ref_mask = transformers_reference(tok_dir, style, record)
        assert ids == ref_ids
        assert mask == ref_mask
        assert 0 < sum(mask) < len(mask)
        trained += sum(mask)
    assert header["loss_mask"] == {"file": "chat.mask", "trained_tokens": trained}
    assert header["chat"]["conversations"] == 3 and header["chat"]["dropped"] == 0
    assert f"from 3 conversation(s) to {out}.bin, {trained:,} of them trained on" in msg
    assert data_sizes(str(out))[0] == header["n_tokens"]


def test_the_template_transformers_saves_beside_the_tokenizer_is_read(tmp_path):
    """A tokenizer directory as transformers 5 saves it (chat_template.jinja beside
    tokenizer.json) prepares the same set as the one it was saved from."""
    from transformers import AutoTokenizer

    src = tokenizer_dir(tmp_path / "src", "llama3")
    saved = tmp_path / "saved"
    AutoTokenizer.from_pretrained(str(src)).save_pretrained(str(saved))
    assert (saved / "chat_template.jinja").is_file()
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    for name, tok in (("a", src), ("b", saved)):
        status, msg = prepare("--chat", "--tokenizer", tok / "tokenizer.json",
                              "--out", tmp_path / name, data)  # fmt: skip
        assert status == 0, msg
    for suffix in (".bin", ".mask"):
        assert (tmp_path / f"a{suffix}").read_bytes() == (tmp_path / f"b{suffix}").read_bytes()


def test_long_conversations_are_refused_truncated_or_dropped_and_counted(tmp_path):
    tok_dir = tokenizer_dir(tmp_path / "tok", "chatml")
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    tok = ("--chat", "--tokenizer", tok_dir / "tokenizer.json")
    whole = tmp_path / "whole"
    assert prepare(*tok, "--out", whole, data)[0] == 0
    eos = json.loads(whole.with_suffix(".json").read_text())["eos_id"]
    convs = conversations_of(whole, eos)
    lengths = [len(ids) + 1 for ids, _ in convs]
    limit = convs[0][1].index(1) + 4  # the first is over it; cut there, 4 tokens of an answer
    assert lengths[0] > limit >= max(lengths[1:])
    status, msg = prepare(*tok, "--max-tokens", limit, "--out", tmp_path / "r", data)
    assert status == 2 and f"chat.jsonl:1: {lengths[0]:,} tokens, over --max-tokens" in msg
    assert not (tmp_path / "r.bin").exists() and not (tmp_path / "r.mask").exists()
    status, msg = prepare(*tok, "--max-tokens", limit, "--long", "drop", "--out", tmp_path / "d",
                          data)  # fmt: skip
    assert status == 0 and "; 1 dropped" in msg, msg
    status, msg = prepare(*tok, "--max-tokens", limit, "--long", "truncate",
                          "--out", tmp_path / "t", data)  # fmt: skip
    assert status == 0 and "; 1 truncated" in msg, msg
    header = json.loads((tmp_path / "t.json").read_text())
    assert header["chat"]["longest"] == limit and header["n_tokens"] == limit + sum(lengths[1:])
    cut = conversations_of(tmp_path / "t", eos)  # still three documents, the first one cut
    assert [len(ids) + 1 for ids, _ in cut] == [limit, *lengths[1:]]
    assert cut[0] == (convs[0][0][: limit - 1], convs[0][1][: limit - 1])


@pytest.mark.parametrize(
    ("record", "expect"),
    [
        ({"messages": [{"role": "user", "content": "Hi"}]}, "chat.jsonl:1: no assistant turn"),
        ({"messages": [{"role": "narrator", "content": "Once"},
                       {"role": "assistant", "content": "upon"}]},
         "chat.jsonl:1: turn 0 has role 'narrator', which the chat template does not know "
         "(it knows system, user, assistant)"),
        ({"messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
         "chat.jsonl:1: turn 0 (user) has no text content"),
        ({"text": "plain"}, "chat.jsonl:1: a conversation holds messages, or a prompt and a "
         "completion (fields: text)"),
        ({"messages": []}, "chat.jsonl:1: messages must be a non-empty list of turns"),
    ],
    ids=["no assistant", "unknown role", "no content", "not a conversation", "no turns"],
)  # fmt: skip
def test_a_bad_conversation_is_refused_naming_its_line(tmp_path, record, expect):
    tok_dir = tokenizer_dir(tmp_path / "tok", "llama3")
    data = write_jsonl(tmp_path / "chat.jsonl", [record])
    status, msg = prepare("--chat", "--tokenizer", tok_dir / "tokenizer.json",
                          "--out", tmp_path / "o", data)  # fmt: skip
    assert status == 2 and expect in msg, msg
    assert not list(tmp_path.glob("o*"))


def test_a_tokenizer_without_a_chat_template_is_refused(tmp_path):
    tok_dir = tokenizer_dir(tmp_path / "tok", "llama3")
    config = json.loads((tok_dir / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (tok_dir / "tokenizer_config.json").write_text(json.dumps(config))
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    status, msg = prepare("--chat", "--tokenizer", tok_dir / "tokenizer.json",
                          "--out", tmp_path / "o", data)  # fmt: skip
    assert status == 2 and "has no chat template" in msg, msg


def test_a_mask_that_does_not_match_its_tokens_is_refused(tmp_path):
    """A whole chat set reads as a chat source (its loss on its mask, under the rule its
    prepare applied to long conversations); one whose mask was cut (or lost) is refused by
    name when read."""
    tok_dir = tokenizer_dir(tmp_path / "tok", "llama3")
    out = tmp_path / "chat"
    data = write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS)
    assert prepare("--chat", "--tokenizer", tok_dir / "tokenizer.json", "--out", out, data)[0] == 0
    source = read_source("data.path", str(out), 1.0)
    assert source.chat and source.long == "refuse"
    mask = out.with_suffix(".mask")
    mask.write_bytes(mask.read_bytes()[:-3])
    with pytest.raises(ValueError, match="the mask does not match its tokens"):
        data_sizes(str(out))
    mask.unlink()
    with pytest.raises(ValueError, match=r"chat.mask is missing"):
        data_sizes(str(out))


def test_windows_hold_whole_conversations():
    """Packing (launcher.data.batches.pack): every conversation of the test set sits whole in
    one window, in order, except those longer than a window (cut to it under --long truncate);
    windows never exceed seq_len + 1 tokens; the trained tokens are the masks' inside them."""
    from chat_data import ROOT, conversations

    from launcher.data.batches import conversation_ends, load_tokens, pack

    tokens, _ = load_tokens(str(ROOT / "chat.bin"))
    mask = np.fromfile(ROOT / "chat.mask", dtype=np.uint8)
    width = 129
    ends = conversation_ends(tokens, 256)
    pairs = conversations()
    assert ends.tolist() == np.cumsum([i.size for i, _ in pairs]).tolist()
    p = pack(ends, mask, width, "truncate")
    lengths = [i.size for i, _ in pairs]
    long = [n for n in lengths if n > width]
    assert long and p.truncated == len(long) and p.dropped == 0
    assert (np.diff(p.bounds, axis=1) <= width).all() and (
        p.bounds[1:, 0] >= p.bounds[:-1, 1]
    ).all()
    starts = set(np.concatenate([[0], ends[:-1]]).tolist())
    assert set(p.bounds[:, 0].tolist()) <= starts  # a window starts where a conversation does
    kept = sum(int(m[:width].sum()) if m.size > width else int(m.sum()) for _, m in pairs)
    assert p.trained_tokens == kept
    dropped = pack(ends, mask, width, "drop")
    assert dropped.dropped == len(long) and dropped.conversations == len(pairs) - len(long)


def test_the_plan_refuses_a_conversation_longer_than_a_window_under_the_refuse_rule(tmp_path):
    """A set prepared with --long refuse (the default) holding a conversation longer than
    train.seq_len + 1 is refused by the plan, naming it, its length and the ways out; the same
    set prepared with truncate trains, and the plan's data row says what its loss is taken on."""
    from chat_data import conversations, write
    from conftest import compose_config

    from launcher.plan import engine_plan
    from launcher.plan.report import plan_json

    pairs = conversations()
    write(tmp_path / "refuse", pairs, long="refuse")
    write(tmp_path / "cut", pairs, long="truncate")
    plan = engine_plan(compose_config([f"data.path={tmp_path}/refuse.bin"]))
    (problem,) = [str(p) for p in plan.errors]
    first = next(i for i, (ids, _) in enumerate(pairs) if ids.size > 129)
    assert f"conversation {first + 1} has {pairs[first][0].size} tokens" in problem, problem
    assert "train.seq_len + 1 = 129 (prepared with --long refuse)" in problem, problem
    assert "--max-tokens 129 and --long truncate or drop" in problem, problem
    assert not engine_plan(compose_config([f"data.path={tmp_path}/refuse.bin",
                                           "train.seq_len=256"])).errors  # fmt: skip
    plan = engine_plan(compose_config([f"data.path={tmp_path}/cut.bin"]))
    assert not plan.errors, plan.errors
    (use,) = plan_json(plan)["data"]
    long = sum(ids.size > 129 for ids, _ in pairs)
    assert use["chat"]["truncated"] == long and use["chat"]["conversations"] == len(pairs)
    assert plan.context.document_mask  # data.attention=auto: each conversation its document
    causal = engine_plan(compose_config([f"data.path={tmp_path}/cut.bin",
                                         "data.attention=causal"]))  # fmt: skip
    assert not causal.context.document_mask


def test_a_chat_set_blends_with_plain_text_and_mtp_is_refused_on_it(tmp_path):
    """A blend of a chat set and a plain token file: the plain source's targets are all kept,
    the chat set's masked; multi-token prediction on a chat set is refused by name."""
    from blend_data import HEADER
    from chat_data import conversations, write
    from conftest import compose_config

    from launcher.data.batches import IGNORE, Batches, write_tokens
    from launcher.data.sources import run_data
    from launcher.plan import engine_plan

    write(tmp_path / "chat", conversations(), long="truncate")
    tokens = np.random.default_rng(0).integers(0, 256, 20_000).astype(np.uint32)
    write_tokens(str(tmp_path / "plain"), [tokens], HEADER, ["noise"])
    blend = (f"data.sources=[{{path: {tmp_path}/chat.bin, weight: 0.5}}, "
             f"{{path: {tmp_path}/plain.bin, weight: 0.5}}]")  # fmt: skip
    cfg = compose_config([blend])
    assert not engine_plan(cfg).errors
    data = run_data(cfg.data, cfg.train.seq_len)
    assert data.masked
    batches = Batches(data.train, 64, 64, 0, 1, 0, True, data.blend)
    ((x, y),) = batches.at(0)
    chat = [i for i in range(64) if batches.locate(i)[0] is data.train[0]]
    plain = [i for i in range(64) if i not in chat]
    assert chat and plain
    assert (y[chat] == IGNORE).any() and not (y[plain] == IGNORE).any()
    assert (y[plain] == x[plain].roll(-1, 1))[:, :-1].all()
    assert batches.trained_tokens(0) == int((y != IGNORE).sum())
    mtp = engine_plan(compose_config(["model=deepseek_debug", "model.mtp_depth=1", blend]))
    assert any("model.mtp_depth=1 with a chat set" in str(p) for p in mtp.errors), mtp.errors


def test_the_data_and_the_models_skip_the_same_target():
    from launcher.data.batches import IGNORE
    from launcher.models import layers

    assert IGNORE == layers.IGNORE == -100  # F.cross_entropy's ignore_index


def test_a_chat_set_as_a_named_validation_set_is_packed_and_masked(tmp_path):
    """data.val_sources may name a chat set: all of its windows, whole conversations, masked
    (evaluated as the mean over their trained tokens: tests/parallel/test_chat_parity.py)."""
    from chat_data import conversations, write
    from conftest import compose_config

    from launcher.data.batches import IGNORE, Batches, Packed
    from launcher.data.sources import run_data
    from launcher.plan import engine_plan

    write(tmp_path / "val", conversations()[:100], long="truncate")
    cfg = compose_config([f"data.val_sources={{chat: {tmp_path}/val.bin}}"])
    assert not engine_plan(cfg).errors
    data = run_data(cfg.data, cfg.train.seq_len)
    assert not data.masked and isinstance(data.named["chat"], Packed)
    batches = Batches(data.named["chat"], 16, 16, 0, 1, 0, False)
    ((_, y),) = batches.micro_batches(0)
    assert batches.masked and (y == IGNORE).any() and (y != IGNORE).any()
