"""Sample text from a checkpoint: `python -m launcher.generate CKPT_OR_RUN_DIR --prompt TEXT`.

    python -m launcher.generate outputs/llama3_debug --prompt "The list type" --max-new-tokens 80
    python -m launcher.generate RUN_DIR/checkpoints/step_00000200 --prompt "def " --temperature 0

One process, CPU (or one GPU with --device cuda), any family. The model comes from the
checkpoint's meta.json and weights (any layout saved it); the tokenizer is the one the run was
trained with: byte-level for the embedded corpus and byte-level token files, the Hugging Face
tokenizer.json named in the token file's header otherwise (--tokenizer FILE when it has
moved). Decoding keeps each layer's keys and values (a KV cache: every attention core is
wrapped by CachedCore), so a new token costs one token's forward, not the whole sequence's.
Sampling: greedy at --temperature 0, else softmax(logits / T) restricted to the smallest set
of tokens whose probability reaches --top-p; --seed makes it repeatable. It stops at the
tokenizer's EOS, after --max-new-tokens, or at the model's max_seq_len.

--chat: the prompt is a user's turn, rendered with the chat template beside the tokenizer (the
one a chat set was prepared with: launcher/data/chat.py) and its generation prompt; it also
stops at the template's end of turn, and prints the answer alone.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from launcher import models
from launcher.checkpoint.store import CheckpointError
from launcher.cli import USAGE_ERROR, fail
from launcher.convert import newest, run_tokenizer
from launcher.data.batches import ByteTokenizer, read_header
from launcher.data.sources import first_token_file
from launcher.runtime.scratch import command


class CachedCore:
    """An attention core (models.layers.AttentionCore) that keeps the keys and values it has
    seen. q, k, v (B, H|K, S, E) of the new tokens at `positions` (S,): each query attends to
    every cached key at a position not after its own."""

    def __init__(self):
        self.k = self.v = self.kpos = None

    def __call__(self, q, k, v, positions, documents=None):  # a prompt is one document
        import torch
        import torch.nn.functional as F

        if self.k is not None:
            k, v = torch.cat([self.k, k], dim=2), torch.cat([self.v, v], dim=2)
            kpos = torch.cat([self.kpos, positions])
        else:
            kpos = positions
        self.k, self.v, self.kpos = k, v, kpos
        mask = positions[:, None] >= kpos[None, :]  # (Sq, Sk)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def with_kv_cache(model) -> None:
    """Replace every attention core's forward by a CachedCore of its own (in place)."""
    from launcher.models.layers import AttentionCore  # torch: loaded once the arguments are checked

    for module in model.modules():
        if isinstance(module, AttentionCore):
            module.forward = CachedCore()


def sample(logits, temperature: float, top_p: float, generator) -> int:
    """One token id from logits (V,): argmax at temperature 0, else nucleus sampling."""
    import torch

    if temperature == 0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1:
        sorted_probs, order = probs.sort(descending=True)
        before = sorted_probs.cumsum(0) - sorted_probs  # mass of the more likely tokens
        sorted_probs[before >= top_p] = 0  # the most likely token always stays
        probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
    return int(torch.multinomial(probs / probs.sum(), 1, generator=generator))


def generate(
    model,
    prompt: list[int],
    max_new: int,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: int = 0,
    eos: int | set | None = None,
    vocab: int | None = None,
) -> list[int]:
    """The new token ids after `prompt` (a model with_kv_cache, in eval mode), up to the first
    of `eos` (an id, or a set of them). Only ids below `vocab` are sampled (the model's
    vocabulary may be padded past the tokenizer's)."""
    stops = eos if isinstance(eos, set) else {eos}
    import torch

    device = next(model.parameters()).device
    generator = torch.Generator(device="cpu").manual_seed(seed)
    limit = min(max_new, model.args.max_seq_len - len(prompt))
    tokens = torch.tensor([prompt], device=device)
    positions = torch.arange(len(prompt), device=device)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(limit):
            logits = model(tokens, positions=positions)[0, -1].cpu()
            if vocab is not None:
                logits = logits[:vocab]
            token = sample(logits, temperature, top_p, generator)
            out.append(token)
            if token in stops:
                break
            tokens = torch.tensor([[token]], device=device)
            positions = positions[-1:] + 1
    return out


def load_model(entry, device: str):
    """The checkpoint's model, fp32 (bf16 on CUDA), its weights loaded, in eval mode. Built on
    the meta device and allocated once on `device`, then filled one tensor at a time from the
    checkpoint's shards: the model in memory once, plus its largest tensor."""
    # torch and what needs it: loaded once the arguments are checked
    import torch

    from launcher.checkpoint import reader, stream
    from launcher.parallel.materialize import to_empty

    config = ((entry.meta or {}).get("config") or {}).get("model")
    if not config:
        fail(f"{entry.path}/meta.json holds no model config")
    damaged = reader.checkpoint_damage(entry)  # files, checksums, the metadata's allow-list
    if damaged:
        fail(f"{entry.path} is damaged: {'; '.join(damaged)}")
    tensors = stream.model_tensors(entry)
    # Multi-token prediction's depths train only: built without them, their tensors unread.
    ahead = {f"mtp.{k}." for k in range(config.get("mtp_depth") or 0)}
    tensors = {k: m for k, m in tensors.items() if not k.startswith(tuple(ahead))}
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    with torch.device("meta"):
        model = models.build(config["family"], {**config, "dropout": 0.0, "mtp_depth": 0})
    # Its buffers (RoPE tables, routers' counters) come from the config; a tied weight is
    # loaded under either of its names.
    to_empty(model.to(dtype), device)
    model.init_buffers()
    held = model.state_dict(keep_vars=True)
    loaded = {id(held[k]) for k in tensors if k in held}
    missing = [k for k in held if id(held[k]) not in loaded]
    unexpected = [k for k in tensors if k not in held]
    if missing or unexpected:
        fail(
            f"{entry.path} does not hold model={config['name']}'s weights: missing "
            f"{missing[:5] or 'none'}, unexpected {unexpected[:5] or 'none'}"
        )
    wrong = [
        f"{k} {list(m.size)} (the model's {list(held[k].shape)})"
        for k, m in tensors.items()
        if tuple(m.size) != tuple(held[k].shape)
    ]
    if wrong:
        fail(f"{entry.path} holds tensors of other shapes than model={config['name']}: {wrong[:5]}")
    with torch.no_grad():
        for name, meta in tensors.items():
            held[name].copy_(stream.read_tensor(entry, name, meta))
    return model.eval(), config


def tokenizer_of(entry, explicit: Path | None):
    """(encode, decode, EOS id, vocabulary size, what it is, its tokenizer.json or None for
    byte-level) of the run's tokenizer."""
    if explicit is None:
        found = run_tokenizer(entry.meta or {})
        data = first_token_file(((entry.meta or {}).get("config") or {}).get("data") or {})
        if found is None and data:
            try:
                kind = read_header(data).get("tokenizer", "bytes")
            except (OSError, ValueError):
                fail(
                    f"the run was trained on {data}, whose header is gone or unreadable, so its "
                    "tokenizer is unknown: pass --tokenizer tokenizer.json"
                )
            if kind != "bytes":
                fail(
                    f"the run was trained on {data}, whose tokenizer is not where its header "
                    "says (or has changed): pass --tokenizer tokenizer.json"
                )
        explicit = found[0] if found else None
    if explicit is None:
        tok = ByteTokenizer()
        return tok.encode, tok.decode, tok.eos_id, 257, "byte-level", None
    from tokenizers import Tokenizer

    try:
        hf = Tokenizer.from_file(str(explicit))
    except Exception as e:  # noqa: BLE001 (tokenizers raises its own Exception type)
        fail(f"--tokenizer {explicit}: not a tokenizer.json ({str(e)[:200]})")
    eos = None
    for name in ("<|end_of_text|>", "<|endoftext|>", "</s>", "<|eot_id|>"):
        if hf.token_to_id(name) is not None:
            eos = hf.token_to_id(name)
            break
    return (
        lambda text: hf.encode(text).ids,
        lambda ids: hf.decode(ids),
        eos,
        hf.get_vocab_size(),
        f"Hugging Face {explicit}",
        explicit,
    )


def chat_prompt(tokenizer: Path | None, text: str) -> tuple[list[int], int | None]:
    """--chat: the ids of `text` as a user's turn with the template's generation prompt, and
    the id of its end of turn (None: it names none)."""
    from launcher.data import chat  # jinja2: only for --chat

    if tokenizer is None:
        fail("--chat needs a Hugging Face tokenizer with a chat template; this run's is byte-level")
    try:
        template = chat.template_of(tokenizer)
        rendered = template.render([{"role": "user", "content": text}], generation_prompt=True)
    except chat.ChatError as e:
        fail(f"--chat: {e}")
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(tokenizer))
    turn = template.variables.get("eos_token")
    return hf.encode(rendered, add_special_tokens=False).ids, hf.token_to_id(turn) if turn else None


@command("no text was generated")
def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m launcher.generate",
        description=__doc__.split("\n\n")[0],
        epilog="The newest complete checkpoint of a run directory is used.",
    )
    parser.add_argument("path", type=Path, help="a run directory or a step_NNNNNNNN checkpoint")
    parser.add_argument("--prompt", required=True, help="the text to continue")
    parser.add_argument(
        "--chat", action="store_true", help="the prompt is a user's turn of the chat template"
    )
    parser.add_argument("--max-new-tokens", type=int, default=100)
    parser.add_argument("--temperature", type=float, default=0.8, help="0: greedy")
    parser.add_argument("--top-p", type=float, default=0.95, help="nucleus mass, (0, 1]")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer.json, if the run's has moved")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:
        return USAGE_ERROR if e.code else 0
    if args.max_new_tokens < 1:
        fail(f"--max-new-tokens={args.max_new_tokens} must be >= 1")
    if not args.temperature >= 0:
        fail(f"--temperature={args.temperature} must be >= 0 (0: greedy)")
    if not 0 < args.top_p <= 1:
        fail(f"--top-p={args.top_p} must be in (0, 1]")
    if not 0 <= args.seed < 2**63:
        fail(f"--seed={args.seed} must be in 0 .. 2**63 - 1 (torch's generator seed)")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        fail("--device cuda: no CUDA device here (this torch sees none); use --device cpu")
    try:
        entry = newest(args.path)
    except CheckpointError as e:
        fail(str(e))
    encode, decode, eos, vocab, what, tokenizer = tokenizer_of(entry, args.tokenizer)
    stops = {eos}
    if args.chat:
        prompt, turn = chat_prompt(tokenizer, args.prompt)
        stops.add(turn)
    else:
        prompt = encode(args.prompt)
    model, config = load_model(entry, args.device)
    if not prompt:
        fail("--prompt is empty once tokenized")
    if len(prompt) >= config["max_seq_len"]:
        limit = config["max_seq_len"]
        fail(f"--prompt is {len(prompt)} tokens; the model's max_seq_len is {limit}")
    with_kv_cache(model)
    new = generate(
        model, prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed, stops, vocab
    )
    print(
        f"{entry.path} (step {entry.step}, {config['name']}), {what} tokenizer; "
        f"{len(prompt)} prompt + {len(new)} new tokens",
        file=sys.stderr,
    )
    print(decode(new) if args.chat else args.prompt + decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
