"""AdamW per model part (ZeRO-1: states sharded over dp_shard; moments optionally in bf16 beside
fp32 master weights), warmup + cosine schedule, global-norm clipping.

torch.distributed.checkpoint (state dicts) is imported where it is used: a run reaches its
first step without it.
"""

from __future__ import annotations

import math
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate

from launcher.config import AdamWImpl, OptimizerConfig, PrecisionConfig, TrainConfig
from launcher.layout import Layout
from launcher.models import shapes
from launcher.parallel.data_parallel import DTYPES
from launcher.parallel.expert_parallel import expert_params
from launcher.parallel.materialize import canonical_name
from launcher.parallel.zero import Zero1, owners
from launcher.runtime.distributed import Dist
from launcher.training.muon import Muon


def param_groups(
    model: nn.Module, weight_decay: float, skip: frozenset = frozenset()
) -> list[dict]:
    """Decay matrices (weights, embeddings); leave vectors (norm gains) undecayed. `skip`:
    parameters left out."""
    params = [p for p in model.parameters() if p.requires_grad and p not in skip]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


class MomentDtypeAdamW(torch.optim.AdamW):
    """AdamW whose exp_avg and exp_avg_sq are stored in `moment_dtype` (bf16) while the
    parameters, the master weights, keep their own dtype (fp32).

    Each parameter's update runs in the parameter's dtype: its moments are upcast, updated as
    torch's single-tensor AdamW does (same operations in the same order: with moment_dtype equal
    to the parameters' it matches torch.optim.AdamW(foreach=False) bit for bit) and rounded back.
    One parameter at a time, so the transient fp32 copies are one tensor's, never the model's.
    The state keeps torch's keys and layout (a scalar fp32 `step`; DTensor moments beside DTensor
    parameters), so the flattened and ZeRO-1 checkpoint paths and DCP resharding are unchanged.
    """

    def __init__(self, params, *, moment_dtype: torch.dtype, **kwargs):
        super().__init__(params, **kwargs)
        self.moment_dtype = moment_dtype

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every floating state to its parameter's dtype on load; store them narrow.
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(self.moment_dtype)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, eps, wd = group["lr"], group["eps"], group["weight_decay"]
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    for key in ("exp_avg", "exp_avg_sq"):
                        state[key] = torch.zeros_like(
                            p, dtype=self.moment_dtype, memory_format=torch.preserve_format
                        )
                state["step"] += 1
                step = state["step"].item()
                exp_avg = state["exp_avg"].to(p.dtype)
                exp_avg_sq = state["exp_avg_sq"].to(p.dtype)
                if wd != 0:
                    p.mul_(1 - lr * wd)
                exp_avg.lerp_(p.grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                p.addcdiv_(exp_avg, denom, value=-step_size)
                state["exp_avg"].copy_(exp_avg)
                state["exp_avg_sq"].copy_(exp_avg_sq)
        return loss


def moment_dtype(opt: torch.optim.Optimizer, p: torch.Tensor) -> torch.dtype:
    """The dtype `opt` keeps p's Adam moments in."""
    return getattr(opt, "moment_dtype", p.dtype)


class Optimizers:
    """One AdamW per model part (pipeline stage), stepped together.

    Checkpoint keys are `state.<parameter>.<exp_avg|exp_avg_sq|step>` and
    `param_groups.<parameter>.<option>` with the model's own parameter names, which stages
    keep: they do not depend on the pipeline layout, the sharding or the wrappers. Under
    ZeRO-1 each rank gives the entries of the parameters it owns and takes them back the same
    way: DCP reshards them like any other tensor.
    """

    def __init__(self, pairs: list[tuple[nn.Module, torch.optim.Optimizer]]):
        # (model part, optimizer): one per part, two under ZeRO-1 with routed experts.
        self.pairs = pairs
        self.optimizers = [opt for _, opt in pairs]
        # id(part) -> {parameter name: the name its states are saved under}.
        self.aliases: dict[int, dict[str, str]] = {}

    def alias(self, part: nn.Module, name: str, saved_as: str) -> None:
        """Save and load the states of `part`'s parameter `name` under `saved_as` (a pipeline
        stage's copy of a tied matrix keeps the states of the model's one matrix)."""
        self.aliases.setdefault(id(part), {})[name] = saved_as

    def _saved_key(self, part: nn.Module, key: str) -> str:
        """The checkpoint key of a flattened entry (`state.<name>.<what>` or
        `param_groups.<name>.<what>`) of `part`."""
        kind, _, rest = key.partition(".")
        for name, saved_as in self.aliases.get(id(part), {}).items():
            if rest.startswith(name + "."):
                return f"{kind}.{saved_as}{rest[len(name) :]}"
        return key

    def step(self) -> None:
        for opt in self.optimizers:
            opt.step()

    def zero_grad(self) -> None:
        for opt in self.optimizers:
            opt.zero_grad(set_to_none=True)

    def set_lr(self, lr: float) -> None:
        for opt in self.optimizers:
            for group in opt.param_groups:
                group["lr"] = lr

    def state_dict(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        out: dict = {}
        for part, opt in self.pairs:
            if is_zero1(opt):
                entries = zero1_entries(part, opt)
            else:
                entries = get_optimizer_state_dict(part, opt, options=flat())
            out.update({self._saved_key(part, k): v for k, v in entries.items()})
        return out

    def load_state_dict(self, state: dict) -> None:
        from torch.distributed.checkpoint.state_dict import (
            get_optimizer_state_dict,
            set_optimizer_state_dict,
        )

        for part, opt in self.pairs:
            impl = [{k: g[k] for k in IMPL_KEYS if k in g} for g in opt.param_groups]
            if is_zero1(opt):
                load_zero1(part, opt, self._entries(part, zero1_entries(part, opt), state))
            else:
                mine = get_optimizer_state_dict(part, opt, options=flat())
                ours = self._entries(part, mine, state)
                set_optimizer_state_dict(part, opt, ours, options=flat())
            keep_impl(opt, impl)

    def _entries(self, part: nn.Module, keys, state: dict) -> dict:
        """`part`'s entries of a loaded state dict, by its own keys. An aliased entry is
        copied: another part on this rank may take the same one (the V schedules hold both
        halves of a tied matrix), and torch's optimizers keep the tensors they are given."""
        out = {}
        aliased = self.aliases.get(id(part), {})
        for key in keys:
            saved = self._saved_key(part, key)
            value = state[saved]
            # Aliased to its own name too (multi-token prediction's copy of the token table is
            # named as the table): a tensor of its own, never the other part's.
            own = saved != key or any(key.partition(".")[2].startswith(n + ".") for n in aliased)
            out[key] = value.clone() if own and isinstance(value, torch.Tensor) else value
        return out


# The param-group keys that say how AdamW computes, not what: train.adamw of the run that
# loads a checkpoint, never of the run that saved it (a GPU run's fused=True resumed on CPU).
IMPL_KEYS = ("fused", "foreach")


def keep_impl(opt: torch.optim.Optimizer, impl: list[dict]) -> None:
    """Put back each group's IMPL_KEYS after a load, and a fused group's step counts on its
    parameters' device (where torch's fused kernel reads them; a loaded one arrives on CPU)."""
    for group, keys in zip(opt.param_groups, impl, strict=True):
        group.update(keys)
        if group.get("fused"):
            for p in group["params"]:
                state = opt.state.get(p, {})
                if "step" in state:
                    state["step"] = state["step"].to(p.device, torch.float32)


def flat():
    """State-dict options: one flat dict keyed by parameter name."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(flatten_optimizer_state_dict=True)


def is_zero1(opt) -> bool:
    return isinstance(opt, Zero1)


def owned(part: nn.Module, opt: Zero1):
    """(canonical name, parameter, its group in the local optimizer) for each parameter whose
    Adam states this rank keeps."""
    group_of = {p: g for g in opt.optim.param_groups for p in g["params"]}
    for name, p in part.named_parameters():
        if p in group_of:
            yield canonical_name(name), p, group_of[p]


def state_template(optim: torch.optim.Optimizer, p: torch.Tensor) -> dict[str, torch.Tensor]:
    """The states `optim` keeps for p, as zeros: what a fresh optimizer saves and loads into."""
    if isinstance(optim, Muon):
        return {"momentum_buffer": torch.zeros_like(p)}
    dtype = moment_dtype(optim, p)
    return {
        "exp_avg": torch.zeros_like(p, dtype=dtype),
        "exp_avg_sq": torch.zeros_like(p, dtype=dtype),
        "step": torch.zeros(()),
    }


def zero1_entries(part: nn.Module, opt: Zero1) -> dict:
    """This rank's share of a ZeRO-1 optimizer in the flattened layout (zeros where no step
    has made the state yet, so that a fresh optimizer is also a template to load into)."""
    out: dict = {}
    for name, p, group in owned(part, opt):
        state = opt.optim.state.get(p, {})
        for key, zeros in state_template(opt.optim, p).items():
            out[f"state.{name}.{key}"] = state.get(key, zeros)
        for key, value in group.items():
            if key != "params":
                out[f"param_groups.{name}.{key}"] = value
    return out


def load_zero1(part: nn.Module, opt: Zero1, state: dict) -> None:
    for name, p, group in owned(part, opt):
        opt.optim.state[p] = {
            key: state[f"state.{name}.{key}"].detach().clone().to(zeros.dtype)
            for key, zeros in state_template(opt.optim, p).items()
        }
        for key in group:
            if key not in ("params", *IMPL_KEYS) and f"param_groups.{name}.{key}" in state:
                group[key] = state[f"param_groups.{name}.{key}"]


def adamw_impl(t: TrainConfig, prec: PrecisionConfig, d: Dist) -> dict:
    """torch.optim.AdamW's keywords for train.adamw. auto: fused on a GPU (one kernel per group
    of tensors in place of foreach's several passes: measured in docs/speed.md) unless the
    moments are narrower than the master weights (MomentDtypeAdamW's own loop); elsewhere
    torch's default (the for-loop on CPU, which the parity tests compare bit for bit)."""
    impl = AdamWImpl(t.adamw)
    if impl == AdamWImpl.auto:
        fusable = prec.optimizer_dtype == prec.master_dtype
        impl = AdamWImpl.fused if fusable and d.device.type == "cuda" else None
    return {
        None: {},
        AdamWImpl.fused: {"fused": True},
        AdamWImpl.foreach: {"foreach": True},
        AdamWImpl.for_loop: {"foreach": False},
    }[impl]


def muon_matrix(name: str, p: torch.Tensor) -> bool:
    """Whether optimizer=muon steps a parameter with Muon: a block's weight matrix or expert
    stack; not the embeddings, the output head, norms, biases or a router (AdamW's)."""
    name = canonical_name(name)
    return name.startswith("layers.") and shapes.muon_steps(name, p.ndim)


def build_optimizers(
    parts: list[nn.Module],
    layout: Layout,
    t: TrainConfig,
    d: Dist,
    prec: PrecisionConfig,
    choice: OptimizerConfig | None = None,
) -> Optimizers:
    """AdamW per part; with ZeRO-1 its states sharded over dp_shard x cp (ranks that hold the
    same parameters). Moments in precision.optimizer_dtype: torch's own AdamW when that is the
    master weights' dtype (the parity tests compare it bit for bit), MomentDtypeAdamW otherwise.
    optimizer=muon (`choice`): per part, Muon over its block matrices (muon_matrix) beside
    AdamW over the rest. Under ZeRO-1 either optimizer steps its owners' share (whole
    matrices: each orthogonalised on one rank of its group) and broadcasts it."""
    kwargs = {"lr": t.lr, "betas": (t.beta1, t.beta2), "eps": 1e-8, **adamw_impl(t, prec, d)}
    adamw = torch.optim.AdamW
    if prec.optimizer_dtype != prec.master_dtype:
        # A partial, not a constructor keyword: ZeRO-1 would copy such a keyword into every
        # param group, and param groups are saved in checkpoints.
        adamw = partial(MomentDtypeAdamW, moment_dtype=DTYPES[prec.optimizer_dtype.value])
    muon_kwargs = {}
    if choice is not None and choice.name.value == "muon":
        muon_kwargs = dict(
            lr=t.lr, weight_decay=t.weight_decay, momentum=choice.momentum,
            nesterov=choice.nesterov, ns_steps=choice.ns_steps, adjust_lr=choice.scale.value,
            ns_dtype=choice.ns_dtype.value,
        )  # fmt: skip
    # ZeRO-1: each dp_shard x cp rank keeps the states of its share of the parameters, steps
    # them and broadcasts the result; gradients arrive whole (averaged) on every rank. Routed
    # experts differ between ep ranks: theirs are sharded over the ranks that hold the same
    # experts (the experts' dp_shard x cp x tp / ep), or not at all where that is one rank.
    zero1 = layout.zero1_enabled
    dense_group = d.shard_mesh.get_group() if zero1 else None
    expert_group = d.expert_shard_group(layout) if zero1 else None
    # Muon spreads each matrix's orthogonalisation over the ranks holding it: under DDP those
    # include the copies on the other data-parallel ranks, which the parameters do not name.
    replicas = {"dense": None, "experts": None}
    ddp = d.mesh is not None and layout.dp_cp > 1 and not layout.fsdp_enabled and not zero1
    if muon_kwargs and ddp:
        replicas["dense"] = d.dp_cp_mesh.mesh.flatten().tolist()
        experts_flat = d.experts_flat
        replicas["experts"] = (
            experts_flat.mesh.flatten().tolist() if experts_flat else replicas["dense"]
        )
    # (part, param groups, optimizer class, its options, ZeRO-1 group or None, Muon's replicas)
    specs: list[tuple] = []
    for part in parts:

        def add(groups, optimizer_class, options, group, replicas=None, part=part):
            if any(g["params"] for g in groups):
                specs.append((part, groups, optimizer_class, options, group, replicas))

        matrices = frozenset(
            p for n, p in part.named_parameters()
            if muon_kwargs and p.requires_grad and muon_matrix(n, p)
        )  # fmt: skip
        # Muon's routed experts apart always (their holders and copies are their own); AdamW's
        # under ZeRO-1 only (their states sharded over their own group).
        routed = frozenset(expert_params(part))
        experts = routed if zero1 else frozenset()
        ordered = [p for p in part.parameters() if p in matrices]
        for kind, chosen, group in (("dense", False, dense_group), ("experts", True, expert_group)):
            mine = [{"params": [p for p in ordered if (p in routed) == chosen]}]
            add(mine, Muon, muon_kwargs, group, replicas[kind])
        add(param_groups(part, t.weight_decay, skip=matrices | experts), adamw, kwargs,
            dense_group)  # fmt: skip
        rest = [p for p in part.parameters() if p in experts and p not in matrices]
        add([{"params": rest, "weight_decay": t.weight_decay}], adamw, kwargs, expert_group)
    owner = zero1_owners(specs)
    pairs = []
    for part, groups, optimizer_class, options, group, copies in specs:
        if group is None:
            opt = optimizer_class(groups, **options)
            if copies:
                opt.replicas = copies
        else:
            ranks = [owner[p] for g in groups for p in g["params"]]
            opt = Zero1(groups, optimizer_class, group, ranks, **options)
        pairs.append((part, opt))
    return Optimizers(pairs)


def zero1_owners(specs: list[tuple]) -> dict:
    """The owner of each parameter of a ZeRO-1 group, split over every optimizer and part on
    it together, largest states first (Muon's one momentum beside Adam's two moments): split
    one optimizer at a time, the embedding and head would land on ranks already even."""
    by_group: dict[int, tuple] = {}
    for _, groups, optimizer_class, _, group, _ in specs:
        if group is not None:
            states = 1 if optimizer_class is Muon else 2
            items = by_group.setdefault(id(group), (group, []))[1]
            items += [(p, states) for g in groups for p in g["params"]]
    owner: dict = {}
    for group, items in by_group.values():
        ranks = owners([p for p, _ in items], dist.get_world_size(group), [n for _, n in items])
        owner.update({p: r for (p, _), r in zip(items, ranks, strict=True)})
    return owner


# train.lr_schedule -> the share of (lr - min_lr) kept at progress p (0 at the end of the warmup,
# 1 at the last step), given train.decay_fraction: 1 at p = 0, and 0 at p = 1 but for constant.
DECAY = {
    "cosine": lambda p, f: 0.5 * (1 + math.cos(math.pi * p)),
    "linear": lambda p, f: 1 - p,
    "constant": lambda p, f: 1.0,
    # MiniCPM's warmup-stable-decay: flat, then a linear decay over the last fraction f.
    "wsd": lambda p, f: min(1.0, (1 - p) / f),
}


def lr_at(step: int, t: TrainConfig) -> float:
    """Linear warmup from lr/warmup to lr, then train.lr_schedule's decay to min_lr at the last
    step (0-based steps); a pure function of the step, so any resume gets the same value."""
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    span = max(1, t.steps - t.warmup_steps - 1)
    progress = min(1.0, (step - t.warmup_steps) / span)
    keep = DECAY[getattr(t.lr_schedule, "value", t.lr_schedule)](progress, t.decay_fraction)
    return t.min_lr + (t.lr - t.min_lr) * keep


def clip_grad_norm(
    params: list[nn.Parameter], max_norm: float, pp_group=None, copies: list[nn.Parameter] = ()
) -> torch.Tensor:
    """Global L2 norm of all gradients across every rank; scale them down to max_norm if > 0.

    Gradients may be plain (replicated) tensors or DTensors on different meshes (FSDP shards,
    TP shards, both). Each rank sums the squares of what it holds, grouped by the mesh
    dimensions the gradient is sharded over; each group is all-reduced over exactly those
    dimensions (replicated dimensions hold copies, which must be counted once); the pipeline
    stages' totals are then summed over `pp_group`. `copies` (a pipeline stage's copy of a
    tied matrix, whose gradient equals the original's) are scaled like the others but not
    counted again.
    """
    sums: dict[tuple, list] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(pl.is_partial() for pl in g.placements):
                g = g.redistribute(
                    placements=[Replicate() if pl.is_partial() else pl for pl in g.placements]
                )
            # Not is_shard(): FSDP over a TP-sharded dimension uses _StridedShard, which is not.
            dims = tuple(i for i, pl in enumerate(g.placements) if not pl.is_replicate())
            key, mesh, local = (id(g.device_mesh), dims), g.device_mesh, g.to_local()
        else:
            key, mesh, local = (None, ()), None, g
        entry = sums.setdefault(
            key, [mesh, torch.zeros((), dtype=torch.float32, device=local.device)]
        )
        entry[1] = entry[1] + local.float().pow(2).sum()
    total = None
    for (_, dims), (mesh, sq) in sums.items():
        for dim in dims:
            dist.all_reduce(sq, group=mesh.get_group(dim))
        total = sq if total is None else total + sq.to(total.device)
    if total is None:
        total = torch.zeros(())
    if pp_group is not None:  # each pipeline stage holds different parameters
        dist.all_reduce(total, group=pp_group)
    norm = total.sqrt()
    if max_norm > 0:
        # A tensor, never a Python number: reading the norm on the host would stall the step
        # until backward is done on an asynchronous device (the loss is read once, at its end).
        coef = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in [*params, *copies]:
            if p.grad is not None:
                p.grad.mul_(coef.to(p.grad.device))
    return norm
