"""The Hugging Face mapping in one process: config.json fields, the RoPE row permutation
(against the formula of transformers' own conversion script), sliced reads, tied embeddings,
and the names and shapes checked before a run starts."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file, save_file

import models
from hf import hf_models
from launcher.hf.config import mismatches, model_fields, to_hf_config, unsupported
from launcher.hf.names import Source, check, sources
from launcher.hf.weights import Reader, from_hf, to_interleaved, to_rotate_half


def hf_config(family: str, **changes) -> dict:
    """config.json as transformers writes it."""
    return hf_models.build(family, **changes).config.to_dict()


def test_fields_from_transformers_config():
    fields = model_fields(hf_config("llama"))
    assert fields["family"] == "llama"
    shape = [fields[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads")]
    assert shape == [128, 4, 8, 4]
    assert (fields["head_dim"], fields["ffn_dim"], fields["vocab_size"]) == (16, 384, 320)
    assert fields["rope_scaling_factor"] == 8.0 and fields["rope_original_max_seq_len"] == 16
    mix = model_fields(hf_config("mixtral"))
    assert (mix["n_routed_experts"], mix["top_k"], mix["moe_ffn_dim"]) == (4, 2, 256)
    assert mix["rope_scaling_factor"] == 1.0


def test_transformers_4_spelling_reads_the_same():
    v5 = hf_config("llama")
    v4 = {k: v for k, v in v5.items() if k != "rope_parameters"}
    v4["rope_theta"] = 10000.0
    v4["rope_scaling"] = {k: v for k, v in v5["rope_parameters"].items() if k != "rope_theta"}
    assert model_fields(v4) == model_fields(v5)
    older = {k: v for k, v in v4.items() if k not in ("num_key_value_heads", "head_dim")}
    assert model_fields(older)["n_kv_heads"] == 8 and model_fields(older)["head_dim"] == 16


def test_our_config_json_round_trips():
    for family in ("llama", "mixtral"):
        fields = model_fields(hf_config(family))
        assert model_fields(to_hf_config(fields, "float32")) == fields
        assert mismatches(to_hf_config(fields, "float32"), fields) == []


def test_mismatches_and_unsupported_name_each_field():
    ours = model_fields(hf_config("llama"))
    theirs = hf_config("llama", num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True)
    assert mismatches(theirs, ours) == [
        "num_key_value_heads=2 but model.n_kv_heads=4",
        "vocab_size=512 but model.vocab_size=320",
        "tie_word_embeddings=True but model.tie_embeddings=False",
    ]
    scaled = {**ours, "rope_scaling_factor": 1.0}
    assert "rope_parameters.factor=8.0 but model.rope_scaling_factor=1.0" in mismatches(
        hf_config("llama"), scaled
    )
    assert mismatches(hf_config("mixtral"), ours) == ["model_type=mixtral but model.family=llama"]
    bad = unsupported({**hf_config("llama"), "hidden_act": "gelu", "mlp_bias": True})
    assert bad == ["hidden_act=gelu (only silu)", "mlp_bias=true (no biases)"]


def test_permutation_matches_the_conversion_script():
    heads, e, d = 4, 8, 6
    w = torch.randn(heads * e, d)
    # transformers' convert_llama_weights_to_hf.py, permute(): Meta (interleaved) -> HF.
    script = w.view(heads, e // 2, 2, d).transpose(1, 2).reshape(heads * e, d)
    assert torch.equal(to_rotate_half(w, heads), script)
    assert torch.equal(to_interleaved(script, heads), w)


@pytest.mark.parametrize("rows", [(0, 32), (5, 19), (8, 16), (13, 14), (31, 32)])
def test_sliced_read_starts_and_ends_inside_heads(tmp_path, rows):
    heads, e, d = 4, 8, 6
    ours = torch.randn(heads * e, d)
    save_file({"q": to_rotate_half(ours, heads)}, str(tmp_path / "model.safetensors"))
    reader = Reader(tmp_path)
    a, b = rows
    got = reader.read(Source(("q",), (heads * e, d), heads), (slice(a, b), slice(1, 4)))
    assert torch.equal(got, ours[a:b, 1:4])
    # Whole heads around the rows, never more.
    assert reader.elements == (-(-b // e) - a // e) * e * 3


def test_tied_embeddings(tmp_path):
    """Llama 3.2 1B/3B tie the output to the embedding: no lm_head in the files."""
    model = hf_models.build("llama", tie_word_embeddings=True)
    src = hf_models.save(model, tmp_path)
    fields = model_fields(model.config.to_dict())
    assert fields["tie_embeddings"] and "output.weight" not in sources(fields)
    assert check(src, fields) == []
    ours = models.build("llama", fields)
    ours.load_state_dict(from_hf(src, fields))
    assert ours.output.weight is ours.tok_embeddings.weight
    x = torch.randint(0, 320, (2, 16))
    with torch.no_grad():
        hf_models.assert_close(ours(x), hf_models.logits(model, x), "tied")


def test_check_names_missing_and_misshapen_tensors(tmp_path):
    model = hf_models.build("mixtral")
    src = hf_models.save(model, tmp_path, shard="10MB")
    fields = model_fields(model.config.to_dict())
    assert check(src, fields) == []
    state = load_file(str(src / "model.safetensors"))
    del state["model.layers.2.block_sparse_moe.experts.3.w2.weight"]
    state["model.norm.weight"] = torch.ones(64)
    save_file(state, str(src / "model.safetensors"))
    problems = check(src, fields)
    assert "lacks tensors: model.layers.2.block_sparse_moe.experts.3.w2.weight" in problems[0]
    assert "model.norm.weight [64], expected [128]" in problems[1]
