"""The family records (launcher/models/families.py) against the models they describe.

Tensor parallelism skips a record's block entry that a block does not have (MLA's wq_b without
a q latent, the dense MLP of an MoE layer), so a misspelt name would leave a projection
replicated without a word: every name must be found in some block of some variant of the
family, and every projection with an output wider than a head must be named.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from conftest import compose_config
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from launcher import models
from launcher.models.families import FAMILIES, TP_ROUTED, family
from launcher.models.layers import future_tokens
from launcher.parallel.tensor_parallel import _find
from launcher.plan.model_size import flops_per_token

# The debug presets, and what else a family's blocks may hold (MLA without a q latent).
VARIANTS = {
    **{name: [[f"model={f.debug}"]] for name, f in FAMILIES.items()},
    "deepseek": [["model=deepseek_debug"], ["model=deepseek_debug", "model.q_lora_rank=0"]],
}
# Replicated on purpose: MLA's latent down-projections (every rank computes the small latents,
# tensor_parallel.py), routers' gates and experts (expert parallelism's, not tp's), and the
# layers the record's embedding and the head are.
REPLICATED = ("wq_a", "wkv_a", "router.gate")


# Multi-token prediction's depths (their blocks numbered after the model's).
MTP = [["model=deepseek_debug", "model.mtp_depth=2"], ["model=deepseek_v3", "model.mtp_depth=1"]]


def built(overrides: list[str]) -> nn.Module:
    cfg = compose_config(overrides)
    with torch.device("meta"):
        return models.build(cfg.model.family, vars(cfg.model))


def test_every_family_names_a_debug_preset_of_its_own():
    """The tests of "every family" run each record's debug preset: it must be that family's."""
    for name, fam in FAMILIES.items():
        assert compose_config([f"model={fam.debug}"]).model.family == name, fam.debug


@pytest.mark.parametrize("name", list(FAMILIES))
def test_tp_plan_names_modules_the_model_has(name):
    fam = family(name)
    variants = [built(o) for o in VARIANTS[name]]
    assert all(v.__class__ is fam.classes()[0] for v in variants)
    for model in variants:
        assert isinstance(_find(model, fam.tp_embedding), nn.Embedding)
        if fam.tp_embedding_sum:
            assert _find(model, fam.tp_embedding_sum) is not None
    blocks = [b for m in variants for b in m.layers.values()]
    named = [*fam.tp_block, *fam.tp_shared, *fam.tp_local_input]
    missing = [n for n in named if all(_find(b, n) is None for b in blocks)]
    assert not missing, f"{name}: the TP plan names no module of any block: {missing}"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_dense_projection_of_a_block_is_in_the_tp_plan(name):
    fam = family(name)
    for model in (built(o) for o in VARIANTS[name]):
        for index, block in model.layers.items():
            for path, module in block.named_modules():
                if not isinstance(module, nn.Linear) or path.endswith(REPLICATED):
                    continue
                plan = {**fam.tp_block, **TP_ROUTED}  # an MoE's shared experts: TP_ROUTED
                assert path in plan, f"{name} layer {index}: {path} is not in tp_block"


@pytest.mark.parametrize(
    "overrides",
    [
        *(o for variants in VARIANTS.values() for o in variants),
        ["model=llama3_debug", "model.tie_embeddings=true"],
        *([f"model={name}"] for name in ("llama3_8b", "gpt_175b", "mixtral_8x7b", "deepseek_v3")),
        *MTP,
    ],
    ids=" ".join,
)
def test_a_records_parameters_are_the_models(overrides):
    """The family's parameters as data (launcher/models/shapes.py, which the planner counts) are the
    built model's, name for name, shape for shape, in order; and so the planner's count."""
    from launcher.plan.model_size import shape

    cfg = compose_config(overrides)
    model = built(overrides)
    params = {k: tuple(p.shape) for k, p in model.named_parameters()}
    listed = family(cfg.model.family).tensors(cfg.model)
    assert list(listed.items()) == list(params.items())
    assert shape(cfg.model).total == sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_a_family_declares_which_fields_it_reads_and_no_default(name):
    """Each model field is declared once, with its default, in launcher/models/config.py; a family's
    Args name the ones its model reads, with no default of their own to contradict it."""
    _, args = family(name).classes()
    fields = dataclasses.fields(args)
    assert {f.name for f in fields} <= models.FIELDS
    with_default = [f.name for f in fields if f.default is not dataclasses.MISSING]
    assert with_default == []


def test_build_refuses_a_field_no_model_has_and_fills_one_left_out():
    fields = vars(compose_config(["model=llama3_debug"]).model)
    with pytest.raises(ValueError, match="kv_lora: not model config fields"):
        models.build("llama", {**fields, "kv_lora": 512})
    older = {k: v for k, v in fields.items() if k != "rope_high_freq_factor"}
    with torch.device("meta"):
        model = models.build("llama", older)  # a checkpoint saved before the field
    assert model.layers["0"].attention.wq.weight.shape == (fields["dim"], fields["dim"])


def _grouped_mm_flops(a, b, *args, out_shape=None, **kwargs) -> int:
    """torch's FlopCounterMode has no formula for the experts' grouped matmul: 2 multiply-adds
    per output element and reduced index, the output (rows, N) of tokens against their
    experts' (K, N), or a weight gradient (E, K, N) summed over each expert's rows."""
    per_expert = math.prod(out_shape) // (out_shape[0] if len(out_shape) == 3 else 1)
    return 2 * per_expert * a[-1]


@pytest.mark.parametrize(
    "overrides", [*([f"model={f.debug}"] for f in FAMILIES.values()), MTP[0]], ids=" ".join
)
def test_planner_flops_are_the_models(overrides):
    """The planner's training FLOPs per token (launcher/plan/model_size.py: 6 x the matrices a
    token is multiplied by, the attention's scores and weighted sum) equal torch's count of a
    forward and backward of the family's debug model (unfused attention, counted without the
    causal mask; the routed experts counted by the formula above, each token's top_k copies as
    the router sent them; multi-token prediction's depths in training, as the trainer runs
    them)."""
    cfg = compose_config([*overrides, "model.flash_attention=false", "model.dropout=0.0"])
    m = cfg.model
    model = models.build(m.family, vars(m))
    model.init_weights(0)
    batch, seq = 2, 64
    tokens = torch.randint(
        0, m.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)
    )
    ahead = {"future": future_tokens(tokens, m.mtp_depth)} if m.mtp_depth else {}
    mapping = {torch.ops.aten._grouped_mm: _grouped_mm_flops}
    with FlopCounterMode(display=False, custom_mapping=mapping) as counter:
        model(tokens, **ahead).sum().backward()
    counted = counter.get_total_flops() / (batch * seq)
    assert flops_per_token(m, seq, causal=False) == pytest.approx(counted, rel=1e-9)
