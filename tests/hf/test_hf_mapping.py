"""The Hugging Face mapping in one process: config.json fields, the RoPE row permutation
(against the formula of transformers' own conversion script), sliced reads, tied embeddings,
and the names and shapes checked before a run starts."""

from __future__ import annotations

import pytest
import torch
from conftest import compose_config
from safetensors.torch import load_file, save_file

from hf import hf_models
from launcher import models
from launcher.hf.config_json import (
    HFConfigError,
    mismatches,
    model_fields,
    to_hf_config,
    unsupported,
)
from launcher.hf.names import Source, check, sources
from launcher.hf.weights import Reader, from_hf, to_interleaved, to_rotate_half
from launcher.models.families import FAMILIES


def hf_config(family: str, **changes) -> dict:
    """config.json as transformers writes it."""
    return hf_models.build(family, **changes).config.to_dict()


def test_every_families_hugging_face_type_has_a_reference_model_here():
    """The logits and round-trip rows (tests/hf/) run a transformers model of each type a
    family's record maps to: a family registered with a type no reference model covers fails
    here rather than going untested."""
    types = {t.model_type for f in FAMILIES.values() for t in f.hf}
    assert types == set(hf_models.RUN)


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
    for kind in ("llama", "mixtral", "deepseek_v3", "deepseek_v2"):
        fields = model_fields(hf_config(kind))
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


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_logits_equal_transformers(tmp_path, kind):
    """DeepseekV3ForCausalLM (q latent, sigmoid + bias routing in groups, YaRN's softmax
    temperature) and DeepseekV2ForCausalLM (queries straight from dim, softmax greedy
    routing, YaRN scaling the rotated parts too), saved by transformers, imported by the
    run's preset overrides: the same logits, fp32."""
    model = hf_models.build(kind)
    src = hf_models.save(model, tmp_path)
    fields = vars(compose_config(hf_models.RUN[kind]).model)
    assert mismatches(model.config.to_dict(), fields) == []
    assert check(src, fields) == []
    ours = models.build("deepseek", fields)
    ours.load_state_dict(from_hf(src, fields))
    x = torch.randint(0, 320, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        hf_models.assert_close(ours.eval()(x), hf_models.logits(model, x), kind)


def test_deepseek_fields_and_names():
    """config.json fields, the per-expert names save_pretrained writes, and the V3 expert
    bias (a buffer) among the sources; V2 has no bias and no q latent."""
    v3 = model_fields(hf_config("deepseek_v3"))
    assert v3 == {**v3, "family": "deepseek", "score_func": "sigmoid", "head_dim": None}
    routing = [v3[k] for k in ("n_group", "topk_group", "norm_topk_prob", "routed_scaling_factor")]
    assert routing == [4, 2, True, 2.5]
    assert (v3["rope_yarn_factor"], v3["rope_yarn_original_max_seq_len"]) == (4.0, 128)
    assert (v3["rope_yarn_mscale"], v3["rope_yarn_mscale_all_dim"]) == (1.0, 1.0)
    table = sources(v3)
    assert table["layers.1.feed_forward.router.expert_bias"].names == (
        "model.layers.1.mlp.gate.e_score_correction_bias",
    )
    experts = table["layers.3.feed_forward.experts.w1"]
    assert experts.names[7] == "model.layers.3.mlp.experts.7.gate_proj.weight"
    assert experts.shape == (64, 128) and len(experts.names) == 8
    assert table["layers.0.feed_forward.w2.weight"].names == (
        "model.layers.0.mlp.down_proj.weight",
    )
    assert table["layers.0.attention.wkv_a.weight"].shape == (32 + 8, 128)
    assert not any(s.heads for s in table.values())  # interleaved RoPE rows, as ours
    v2 = model_fields(hf_config("deepseek_v2"))
    assert v2["score_func"] == "softmax" and v2["q_lora_rank"] == 0  # null: no q latent
    assert v2["n_group"] == 1 and v2["norm_topk_prob"] is False
    table = sources(v2)
    assert "layers.1.feed_forward.router.expert_bias" not in table
    assert table["layers.1.attention.wq.weight"].names == (
        "model.layers.1.self_attn.q_proj.weight",
    )
    assert "layers.1.attention.wq_a.weight" not in table


def test_deepseek_mismatches_and_unsupported():
    v3 = hf_config("deepseek_v3")
    ours = model_fields(v3)
    assert mismatches(v3, {**ours, "score_func": "softmax"}) == [
        "model_type=deepseek_v3 (a sigmoid router) but model.score_func=softmax"
    ]
    assert mismatches(v3, {**ours, "rope_yarn_mscale_all_dim": 0.707}) == [
        "rope_parameters.mscale_all_dim=1.0 but model.rope_yarn_mscale_all_dim=0.707"
    ]
    assert mismatches(v3, {**ours, "n_group": 1}) == ["n_group=4 but model.n_group=1"]
    assert unsupported({**v3, "rope_interleave": False}) == [
        "rope_interleave=false (DeepSeek's interleaved RoPE rows only)"
    ]
    v2 = hf_config("deepseek_v2")
    grouped = {**v2, "norm_topk_prob": True, "topk_method": "group_limited_greedy", "n_group": 2}
    assert unsupported(grouped) == [
        "topk_method=group_limited_greedy (greedy top-k only)",
        "norm_topk_prob=true (transformers' DeepseekV2 ignores it)",
    ]
    llama_yarn = {**hf_config("llama"), "rope_parameters": v3["rope_parameters"]}
    assert unsupported(llama_yarn) == ["rope_parameters.rope_type=yarn (default or llama3 only)"]
    renormalised = {**model_fields(v2), "norm_topk_prob": True}
    with pytest.raises(HFConfigError, match="norm_topk_prob=true .transformers' DeepseekV2 ig"):
        to_hf_config(renormalised, "float32")  # a model no transformers class computes
    gpt = compose_config(["model=gpt_debug"]).model
    with pytest.raises(HFConfigError, match="model.family=gpt has no Hugging Face mapping"):
        to_hf_config(vars(gpt), "float32")


@pytest.mark.parametrize("kind", ["deepseek_v3", "deepseek_v2"])
def test_deepseek_preset_is_the_run_model(kind):
    """model-config's YAML, read into the schema, has every field the run overrides give
    (the balance-loss settings, training-only, are not in config.json). transformers writes
    num_nextn_predict_layers=1 into every DeepSeek-V3 config.json and saves no such layer: the
    command counts the depths the directory holds (names.held_depths; test_convert's
    prediction-depth row), as this model's, none."""
    from omegaconf import OmegaConf

    from launcher.config import ModelConfig
    from launcher.hf.config_json import preset_yaml

    hf = hf_config(kind)
    assert hf.get("num_nextn_predict_layers", 0) == (1 if kind == "deepseek_v3" else 0)
    yaml = preset_yaml("tiny", "/tmp/tiny", hf, {**model_fields(hf), "mtp_depth": 0})
    preset = OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(yaml))
    run = compose_config(hf_models.RUN[kind]).model
    for field in model_fields(hf):
        assert getattr(preset, field) == getattr(run, field), field
