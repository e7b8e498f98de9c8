"""`python -m launcher.convert` and the checks before a run starts from Hugging Face weights,
against transformers' own models (built from config objects, saved with save_pretrained)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import compose_config, read_metrics, run_cli
from omegaconf import OmegaConf
from safetensors import safe_open

from hf import hf_models
from launcher import models
from launcher.config import ModelConfig

pytestmark = pytest.mark.e2e


def tensors(directory) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    return out


def train_from_hf(src, run_dir, *overrides: str):
    """launcher.train on the llama debug shape, started from the Hugging Face directory."""
    return run_cli(
        "launcher.train",
        *hf_models.LLAMA_RUN,
        *overrides,
        "logging.wandb.mode=disabled",
        f"checkpoint.initial_load_path={src}",
        "checkpoint.initial_load_format=hf",
        f"hydra.run.dir={run_dir}",
    )


def convert(*args) -> str:
    result = run_cli("launcher.convert", *map(str, args))
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def convert_here(*args) -> None:
    """launcher.convert's `main` in this process: the round trips below test the conversion,
    and spare a Python, torch and transformers start-up per call; the tests after them run the
    command itself."""
    from launcher.convert import main

    assert main([str(a) for a in args]) == 0


# Every Hugging Face model type a family's record maps to (hf_models.RUN), in fp32, and one in
# bf16.
@pytest.mark.parametrize(
    ("kind", "dtype"), [*((kind, None) for kind in hf_models.RUN), ("llama", torch.bfloat16)]
)
def test_round_trip_is_bitwise(tmp_path, kind, dtype):
    """HF -> from-hf -> to-hf: the same tensor names, dtypes and bytes, and a config.json that
    transformers builds the same model from (DeepSeek: V3's expert biases, a buffer, too)."""
    family = "deepseek" if kind.startswith("deepseek") else kind
    model = hf_models.build(kind)
    if dtype is not None:
        model = model.to(dtype)
    src = hf_models.save(model, tmp_path / "hf")
    convert_here("from-hf", src, tmp_path / "ours")
    meta = json.loads((tmp_path / "ours" / "meta.json").read_text())
    assert meta["weights_only"] and meta["config"]["model"]["family"] == family
    convert_here("to-hf", tmp_path / "ours", tmp_path / "back", "--max-shard-size", "200KB")
    before, after = tensors(src), tensors(tmp_path / "back")
    assert before.keys() == after.keys()
    for name, t in before.items():
        assert after[name].dtype == t.dtype, name
        assert torch.equal(after[name].view(torch.uint8), t.view(torch.uint8)), name
    assert (tmp_path / "back" / "model.safetensors.index.json").is_file()

    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(src).eval()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    assert type(again) is type(model)
    x = torch.randint(0, 320, (2, 20))
    assert torch.equal(hf_models.logits(again, x), hf_models.logits(original, x))


def with_prediction_depth(src, seed: int = 1) -> dict[str, torch.Tensor]:
    """Add DeepSeek-V3's multi-token-prediction layer to a saved deepseek_v3 directory, as the
    released checkpoint holds it (model.layers.61 there: the layer after the last): a block
    shaped as an MoE layer (layer 1's tensors, perturbed), its own norms and eh_proj, and
    copies of the token table and the head. Returns the tensors added."""
    from safetensors.torch import save_file

    before = tensors(src)
    layers = json.loads((src / "config.json").read_text())["num_hidden_layers"]
    g = torch.Generator().manual_seed(seed)

    def noise(t: torch.Tensor) -> torch.Tensor:
        return t + 0.1 * torch.randn(t.shape, generator=g, dtype=t.dtype)

    at = f"model.layers.{layers}."
    added = {
        at + k.removeprefix("model.layers.1."): noise(t)
        for k, t in before.items()
        if k.startswith("model.layers.1.")
    }
    dim = before["model.norm.weight"].shape[0]
    for norm in ("enorm", "hnorm", "shared_head.norm"):
        added[f"{at}{norm}.weight"] = 1 + 0.2 * torch.randn(dim, generator=g)
    added[f"{at}eh_proj.weight"] = 0.05 * torch.randn(dim, 2 * dim, generator=g)
    added[f"{at}embed_tokens.weight"] = before["model.embed_tokens.weight"].clone()
    added[f"{at}shared_head.head.weight"] = before["lm_head.weight"].clone()
    save_file(added, str(src / "mtp.safetensors"), metadata={"format": "pt"})
    index = json.loads((src / "model.safetensors.index.json").read_text())
    index["weight_map"].update(dict.fromkeys(added, "mtp.safetensors"))
    (src / "model.safetensors.index.json").write_text(json.dumps(index))
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return added


def test_deepseek_v3_prediction_depth_loads_and_exports_bitwise(tmp_path):
    """A DeepSeek-V3-shaped directory whose checkpoint holds its multi-token-prediction layer:
    from-hf reads it as model.mtp_depth=1 (each tensor where the model keeps it, the copies of
    the token table and the head left unread), to-hf writes every tensor back bit for bit,
    and transformers still builds the model (without the layer) with the same logits. A run
    may leave the depth out (model.mtp_depth=0 starts from the same directory)."""
    from launcher.hf.names import check

    src = hf_models.save(hf_models.build("deepseek_v3"), tmp_path / "hf")
    added = with_prediction_depth(src)
    convert_here("from-hf", src, tmp_path / "ours")
    meta = json.loads((tmp_path / "ours" / "meta.json").read_text())
    assert meta["config"]["model"]["mtp_depth"] == 1
    convert_here("to-hf", tmp_path / "ours", tmp_path / "back")
    before, after = tensors(src), tensors(tmp_path / "back")
    assert before.keys() == after.keys() and set(added) <= after.keys()
    for name, t in before.items():
        assert torch.equal(after[name].view(torch.uint8), t.view(torch.uint8)), name
    back = json.loads((tmp_path / "back" / "config.json").read_text())
    assert back["num_nextn_predict_layers"] == 1

    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(src).eval()
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "back").eval()
    x = torch.randint(0, 320, (2, 20))
    assert torch.equal(hf_models.logits(again, x), hf_models.logits(original, x))

    # The layer's tensors are where the model reads them: its first depth's logits against
    # the report's formula evaluated with transformers' own decoder layer holding them.
    from launcher.hf.weights import from_hf

    model = dict(meta["config"]["model"])
    ours = models.build("deepseek", model)
    ours.load_state_dict(from_hf(src, model), strict=False)  # the RoPE table is derived
    # transformers loads the layer's block as a fifth layer (its experts fused as it holds them).
    longer = AutoModelForCausalLM.from_pretrained(src, num_hidden_layers=5).eval()
    layer, at = longer.model.layers[4], "model.layers.4."
    tokens = torch.randint(0, 320, (2, 21))
    x, y = tokens[:, :-1], tokens[:, 1:]

    def rms(t, name):  # DeepSeek's RMSNorm, eps as config.json's
        eps = original.config.rms_norm_eps
        return t * torch.rsqrt(t.pow(2).mean(-1, keepdim=True) + eps) * added[at + name]

    with torch.no_grad():
        h = original.model(x).last_hidden_state  # after the final norm
        joined = torch.cat([rms(original.model.embed_tokens(y), "enorm.weight"),
                            rms(h, "hnorm.weight")], dim=-1)  # fmt: skip
        inner = joined @ added[at + "eh_proj.weight"].T
        positions = torch.arange(x.shape[1])[None]
        rope = original.model.rotary_emb(inner, positions)
        out = layer(inner, position_ids=positions, position_embeddings=rope)
        expected = original.lm_head(rms(out, "shared_head.norm.weight"))
        h, table = ours.features(x)
        depth = ours.mtp["0"]
        got = ours.output(depth(h, ours.tok_embeddings(y), table)[1])
    hf_models.assert_close(got, expected, "the prediction depth's logits")
    # launcher.generate builds the model without its depth and reads everything else.
    from launcher.convert import newest
    from launcher.generate import load_model

    served, _ = load_model(newest(tmp_path / "ours"), "cpu")
    assert not len(served.mtp) and not any(k.startswith("mtp.") for k in served.state_dict())
    with torch.no_grad():
        assert torch.equal(served(x), ours.eval()(x))

    assert check(src, model) == []
    assert check(src, {**model, "mtp_depth": 0}) == []  # the depth left out
    wrong = check(src, {**model, "mtp_depth": 2})
    assert wrong and "num_nextn_predict_layers=1 but model.mtp_depth=2" in wrong[0]


def test_trained_run_exports_to_transformers(tmp_path):
    """Start from HF on 2 processes, train 3 steps, to-hf: transformers' logits equal our
    final model's (gathered by train.save_final, run on one process)."""
    src = hf_models.save(hf_models.build("llama"), tmp_path / "hf")
    run_dir = tmp_path / "run"
    result = train_from_hf(
        src,
        run_dir,
        "hardware.devices_per_node=2",
        "train.steps=3",
        "train.eval_interval=0",
        "train.save_final=true",
        "precision=fp32",
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "starting from the Hugging Face weights" in result.stdout
    assert len(read_metrics(run_dir)) == 3
    out = convert("to-hf", run_dir, tmp_path / "exported")
    assert "from step 3" in out

    from transformers import AutoModelForCausalLM

    theirs = AutoModelForCausalLM.from_pretrained(tmp_path / "exported").eval()
    config = json.loads((tmp_path / "exported" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_scaling"]["rope_type"] == "llama3"
    cfg = OmegaConf.to_object(
        OmegaConf.merge(
            OmegaConf.structured(ModelConfig),
            OmegaConf.load(run_dir / ".hydra" / "config.yaml").model,
        )
    )
    ours = models.build("llama", vars(cfg))
    ours.load_state_dict(torch.load(run_dir / "final_model.pt"))
    x = torch.randint(0, 320, (2, 24))
    with torch.no_grad():
        hf_models.assert_close(ours.eval()(x), hf_models.logits(theirs, x), "exported")
        start = hf_models.logits(hf_models.build("llama"), x)
        assert not torch.allclose(hf_models.logits(theirs, x), start)  # it did train


def test_mismatched_config_is_refused_before_any_process(tmp_path):
    src = hf_models.save(
        hf_models.build("llama", num_key_value_heads=8, rms_norm_eps=1e-6), tmp_path / "hf"
    )
    result = train_from_hf(src, tmp_path / "run", "hardware.devices_per_node=2")
    assert result.returncode == 2, result.stderr[-2000:]
    assert "num_key_value_heads=8 but model.n_kv_heads=4" in result.stderr
    assert "rms_norm_eps=1e-06 but model.norm_eps=1e-05" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_unusable_directories_are_refused(tmp_path):
    hf = hf_models.save(hf_models.build("llama", attention_bias=True), tmp_path / "biased")
    result = run_cli("launcher.convert", "from-hf", str(hf), str(tmp_path / "out"))
    assert result.returncode == 2
    assert "attention_bias=true" in result.stderr and "Traceback" not in result.stderr
    result = run_cli("launcher.convert", "model-config", str(tmp_path / "nothing"))
    assert result.returncode == 2 and "is not a directory" in result.stderr
    # A shard missing from an indexed directory is named before anything loads.
    good = hf_models.save(hf_models.build("llama"), tmp_path / "good")
    gone = sorted(good.glob("model-*.safetensors"))[-1]
    gone.unlink()
    result = train_from_hf(good, tmp_path / "run", "hardware.devices_per_node=1")
    assert result.returncode == 2 and gone.name in result.stderr, result.stderr[-2000:]
    # Nothing is overwritten.
    result = run_cli("launcher.convert", "from-hf", str(hf), str(good))
    assert result.returncode == 2 and "already exists" in result.stderr


def test_model_config_makes_a_preset(tmp_path):
    """model-config's YAML, read into the schema, is the model the run overrides describe."""
    src = hf_models.save(hf_models.build("mixtral"), tmp_path / "Mixtral-Tiny")
    yaml = convert("model-config", src)
    assert yaml.splitlines()[2] == "name: mixtral_tiny"
    preset = OmegaConf.to_object(
        OmegaConf.merge(OmegaConf.structured(ModelConfig), OmegaConf.create(yaml))
    )

    expected = compose_config(hf_models.MIXTRAL_RUN).model
    fields = ["family", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "top_k"]
    fields += ["n_routed_experts", "moe_ffn_dim", "rope_theta", "norm_eps", "max_seq_len"]
    for field in fields:
        assert getattr(preset, field) == getattr(expected, field), field
