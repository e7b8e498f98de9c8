"""Conversations for fine-tuning (`python -m launcher.prepare --chat`): read, rendered with the
tokenizer's own chat template, tokenized, and a loss mask beside the tokens.

A conversation is a JSON-lines record or a Parquet row holding either `messages` (a list of
{"role": ..., "content": ...}) or a `prompt` and a `completion` (a user turn and the
assistant's answer). The mask is 1 on the tokens the model must learn to produce (each
assistant turn: its content and its end-of-turn tokens, as the template writes them) and 0 on
the rest (the system and user turns, each assistant turn's header).

Which characters an assistant turn adds is read from the template itself: the conversation up
to that turn rendered with the generation prompt (what a model is given when it answers), and
up to and with that turn; what the second adds to the first is the answer. A template that
does not render an earlier turn the same way as a prefix of the whole (one that drops an
earlier turn's reasoning, say) is refused: the mask would not be what the model sees.

The template is rendered as transformers' apply_chat_template renders it (a sandboxed Jinja
environment, trim_blocks and lstrip_blocks, raise_exception, tojson, strftime_now, the
tokenizer's special tokens as variables): tests/test_chat.py holds them equal.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

import numpy as np

ROLES = ("system", "user", "assistant")  # what every template is taken to know
EXTRA_ROLES = ("tool", "ipython", "function", "developer")  # known where a template names them
TRAINED = "assistant"  # the role whose turns the loss is taken on
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")  # the template's variables


class ChatError(Exception):
    """A conversation, or a tokenizer's template, that cannot be prepared: one line, exit 2."""


@dataclass
class Template:
    """A tokenizer's chat template, where it came from, and what it renders with."""

    text: str
    source: Path
    variables: dict[str, str] = field(default_factory=dict)  # bos_token, eos_token, ...

    def __post_init__(self) -> None:
        self.compiled = compile_template(self.text, self.source)
        # Roles beyond ROLES a template names as strings (tool, ipython): those it knows too.
        named = set(re.findall(r"""['"]([a-z_]+)['"]""", self.text)) & set(EXTRA_ROLES)
        self.roles = (*ROLES, *(r for r in EXTRA_ROLES if r in named))

    def render(self, messages: list[dict], generation_prompt: bool) -> str:
        import jinja2

        try:
            return self.compiled.render(
                messages=messages, add_generation_prompt=generation_prompt, **self.variables
            )
        except jinja2.TemplateError as e:
            raise ChatError(f"the chat template of {self.source} refuses it: {e}") from None


def compile_template(text: str, source: Path):
    """The template compiled as transformers compiles it (chat_template_utils)."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except jinja2.TemplateSyntaxError as e:
        raise ChatError(f"the chat template of {source} is not a Jinja template: {e}") from None


def token_text(value) -> str | None:
    """A special token of tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def template_of(tokenizer: Path) -> Template:
    """The chat template beside a tokenizer.json: chat_template.jinja (what transformers 5
    saves), else tokenizer_config.json's chat_template (a string, or a list of named ones: the
    "default"); its special tokens from tokenizer_config.json."""
    config_path = tokenizer.parent / "tokenizer_config.json"
    config = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except ValueError as e:
            raise ChatError(f"{config_path} is not JSON: {e}") from None
        if not isinstance(config, dict):
            raise ChatError(f"{config_path} is not a JSON object")
    variables = {k: v for k in SPECIAL if (v := token_text(config.get(k))) is not None}
    jinja = tokenizer.parent / "chat_template.jinja"
    if jinja.is_file():
        return Template(jinja.read_text(encoding="utf-8"), jinja, variables)
    text = config.get("chat_template")
    if isinstance(text, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in text if isinstance(t, dict)}
        text = named.get("default")
    if not isinstance(text, str) or not text.strip():
        raise ChatError(
            f"{tokenizer} has no chat template: neither chat_template.jinja nor a chat_template "
            f"in {config_path.name} beside it (--chat renders conversations with it)"
        )
    return Template(text, config_path, variables)


def messages_of(record, where: str, roles: tuple[str, ...]) -> list[dict]:
    """A record's conversation as messages: its `messages`, or its `prompt` and `completion`;
    refused (naming `where`, FILE:LINE) unless every turn has a known role and text content
    and one of them is the assistant's."""
    if not isinstance(record, dict):
        raise ChatError(f"{where}: a JSON {type(record).__name__}, not an object")
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not messages:
            raise ChatError(f"{where}: messages must be a non-empty list of turns")
    elif "prompt" in record and "completion" in record:
        messages = [
            {"role": "user", "content": record["prompt"]},
            {"role": TRAINED, "content": record["completion"]},
        ]
    else:
        fields = ", ".join(list(record)[:8]) or "none"
        raise ChatError(
            f"{where}: a conversation holds messages, or a prompt and a completion (fields: "
            f"{fields})"
        )
    for i, turn in enumerate(messages):
        if not isinstance(turn, dict) or not isinstance(turn.get("role"), str):
            raise ChatError(f"{where}: turn {i} is not an object with a role")
        if turn["role"] not in roles:
            raise ChatError(
                f"{where}: turn {i} has role {turn['role']!r}, which the chat template does "
                f"not know (it knows {', '.join(roles)})"
            )
        if not isinstance(turn.get("content"), str):
            raise ChatError(f"{where}: turn {i} ({turn['role']}) has no text content")
    if not any(t["role"] == TRAINED for t in messages):
        raise ChatError(f"{where}: no assistant turn, so nothing to train on")
    return messages


def answer_spans(template: Template, messages: list[dict], where: str) -> tuple[str, list]:
    """The rendered conversation and the character spans of its assistant turns."""
    whole = template.render(messages, generation_prompt=False)
    spans = []
    for i, turn in enumerate(messages):
        if turn["role"] != TRAINED:
            continue
        asked = template.render(messages[:i], generation_prompt=True)
        answered = template.render(messages[: i + 1], generation_prompt=False)
        if not (answered.startswith(asked) and whole.startswith(answered)):
            raise ChatError(
                f"{where}: the chat template of {template.source} does not render turn {i} as "
                "a prefix of the whole conversation, so the tokens of each answer cannot be told"
            )
        if len(answered) > len(asked):
            spans.append((len(asked), len(answered)))
    return whole, spans


def masked_ids(tok, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
    """The text's token ids (the template writes the special tokens: none added) and the
    mask: 1 on each token that starts inside an answer's span."""
    enc = tok.encode(text, add_special_tokens=False)
    starts = np.array([a for a, _ in enc.offsets], dtype=np.int64)
    mask = np.zeros(len(enc.ids), dtype=np.uint8)
    for a, b in spans:
        mask[(starts >= a) & (starts < b)] = 1
    return np.array(enc.ids, dtype=np.uint32), mask


@dataclass
class Counts:
    """What the prepare summary says of the conversations."""

    conversations: int = 0
    trained_tokens: int = 0
    truncated: int = 0
    dropped: int = 0
    longest: int = 0  # tokens of the longest conversation written


def conversations(
    template: Template,
    tok,
    records: Iterator[tuple[object, str]],
    eos_id: int,
    max_tokens: int | None,
    long: str,
    counts: Counts,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids, mask) of each conversation, each ended by EOS (not trained on: the template's end
    of turn is), after --long's rule for one over --max-tokens."""
    for record, where in records:
        messages = messages_of(record, where, template.roles)
        text, spans = answer_spans(template, messages, where)
        ids, mask = masked_ids(tok, text, spans)
        if (inside := np.flatnonzero(ids[:-1] == eos_id)).size:
            raise ChatError(
                f"{where}: the end-of-document token (id {eos_id}) is inside the rendered "
                f"conversation (token {int(inside[0])}), where it would split it in two: pass "
                "--eos with the tokenizer's end-of-text token"
            )
        if not (ids.size and ids[-1] == eos_id):
            ids, mask = np.append(ids, np.uint32(eos_id)), np.append(mask, np.uint8(0))
        if max_tokens is not None and ids.size > max_tokens:
            if long == "refuse":
                raise ChatError(
                    f"{where}: {ids.size:,} tokens, over --max-tokens {max_tokens:,} (--long "
                    "refuse; truncate keeps its first tokens, drop leaves it out)"
                )
            if long == "drop":
                counts.dropped += 1
                continue
            ids = np.append(ids[: max_tokens - 1], np.uint32(eos_id))  # still a document
            mask = np.append(mask[: max_tokens - 1], np.uint8(0))
            counts.truncated += 1
            if not mask.any():
                counts.dropped += 1  # cut before its first answer: nothing left to train on
                counts.truncated -= 1
                continue
        counts.conversations += 1
        counts.trained_tokens += int(mask.sum())
        counts.longest = max(counts.longest, int(ids.size))
        yield ids, mask
