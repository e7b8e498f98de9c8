"""The training loop: one loop for every model family and layout.

Receives a validated Plan; builds the model identically on every rank (same seed), applies the
layout, then trains: micro-batches with gradient accumulation, global-norm clipping, AdamW with
warmup + cosine, periodic eval on the held-out split, metrics from the rank that holds the loss.
"""

from __future__ import annotations

import os
import time
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.elastic.multiprocessing.errors import record
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

import models
from launcher import distributed
from launcher.data import Batches, load_tokens, split
from launcher.metrics import MetricsLogger
from launcher.optim import build_optimizer, clip_grad_norm, lr_at, set_lr
from launcher.parallel import parallelize, pipeline
from launcher.parallel.data_parallel import DTYPES, grad_sync
from launcher.plan import Plan

# Testing hook for failure handling: "RANK:STEP" raises on that rank at that step.
FAULT_ENV = "LAUNCHER_FAULT_INJECT"


def build_model(cfg, seed: int) -> torch.nn.Module:
    """The family's model from config, initialised from `seed` (identical on every rank)."""
    model = models.build(cfg.model.family, vars(cfg.model))
    model.init_weights(seed)
    return model.to(DTYPES[cfg.precision.master_dtype.value])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; logits (B, S, V), targets (B, S)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def local(x: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor loss as a plain tensor."""
    return x.full_tensor() if isinstance(x, DTensor) else x


def save_full_state_dict(parts: list[torch.nn.Module], d: distributed.Dist, path: Path) -> None:
    """Gather every shard (FSDP, TP) and every pipeline stage into one full state dict;
    rank 0 writes it."""
    # Not cpu_offload: that hands the full tensors to global rank 0 only, and every pipeline
    # stage's first rank needs its own to pass on.
    options = StateDictOptions(full_state_dict=True)
    state: dict = {}
    for part in parts:
        state.update({k: v.cpu() for k, v in get_model_state_dict(part, options=options).items()})
    if d.mesh is not None and d.mesh["pp"].size() > 1:
        pp = d.mesh["pp"]
        gathered = [None] * pp.size() if pp.get_local_rank() == 0 else None
        dist.gather_object(state, gathered, group=pp.get_group(), group_dst=0)
        if gathered is not None:
            state = {k: v for part in gathered for k, v in part.items()}
    if d.rank == 0:
        torch.save(state, path)


def check_fault(rank: int, step: int) -> None:
    spec = os.environ.get(FAULT_ENV)
    if spec and spec == f"{rank}:{step}":
        raise RuntimeError(f"injected fault on rank {rank} at step {step} ({FAULT_ENV}={spec})")


@record
def run(cfg, plan: Plan, run_dir: str, dcfg: DictConfig) -> None:
    """Train the planned layout; every rank calls this."""
    d = distributed.init(cfg.hardware.device_type.value, plan.degrees)
    train(cfg, plan, run_dir, dcfg, d)
    # Only after a clean finish: the model (DDP's reducer, FSDP's hooks) is gone by now, and
    # every rank leaves together. After a crash the launcher ends the other ranks instead.
    distributed.shutdown()


def train(cfg, plan: Plan, run_dir: str, dcfg: DictConfig, d: distributed.Dist) -> None:
    t = cfg.train
    torch.manual_seed(t.seed)
    if d.device.type == "cpu" and "OMP_NUM_THREADS" in os.environ:
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

    base = build_model(cfg, t.seed).to(d.device)
    pp = plan.degrees["pp"]
    if pp > 1:
        # Each pipeline rank keeps its stages of the identically seeded whole model.
        v, schedule_name = cfg.pipeline.stages_per_rank, cfg.pipeline.schedule
        stages = pipeline.split(
            base, d.mesh["pp"].get_local_rank(), pp, v, schedule_name, plan.layout.stage_layers
        )
        stages = [(index, parallelize(module, plan, d)) for index, module in stages]
        parts = [module for _, module in stages]
        first = any(index == 0 for index, _ in stages)
        last = any(index == pp * v - 1 for index, _ in stages)
    else:
        parts, first, last = [parallelize(base, plan, d)], True, True
    del base
    model = parts[0]
    container = torch.nn.ModuleList(parts)
    optimizer = build_optimizer(container, plan, d)
    params = [p for p in container.parameters() if p.requires_grad]
    # FSDP casts to param_dtype itself; replicated models compute under autocast instead.
    autocast = cfg.precision.compute_dtype != cfg.precision.master_dtype and not isinstance(
        model, FSDPModule
    )
    compute_dtype = DTYPES[cfg.precision.compute_dtype.value]

    tokens, _ = load_tokens(cfg.data.path)
    train_split, val_split = split(tokens, t.seq_len, cfg.data.val_fraction)
    dp_rank, dp = d.dp_rank, plan.dp
    train_batches = Batches(
        train_split, t.global_batch_size, t.micro_batch_size, dp_rank, dp, t.seed, shuffle=True
    )
    val_batches = Batches(
        val_split, t.global_batch_size, t.micro_batch_size, dp_rank, dp, t.seed, shuffle=False
    )

    # With loss parallelism the logits stay sharded over the vocabulary; cross-entropy (and its
    # backward) must then run under loss_parallel(), which reduces across the tp ranks.
    vocab_parallel = plan.degrees["tp"] > 1 and cfg.tensor.loss_parallel

    def loss_context():
        return loss_parallel() if vocab_parallel else nullcontext()

    def forward_loss(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        with torch.autocast(d.device.type, dtype=compute_dtype, enabled=autocast):
            return loss_fn(model(x.to(d.device)), y.to(d.device))

    if pp > 1:
        schedule = pipeline.build_schedule(
            stages,
            pp * v,
            schedule_name,
            plan.layout.microbatches,
            loss_fn,
            d.mesh["pp"],
            d.device,
            reshard_each_microbatch=plan.layout.reshard_each_microbatch,
        )

    def run_pipeline(micro) -> torch.Tensor | None:
        """The schedule runs every micro-batch; only the last stage sees losses (their mean,
        as each micro-batch holds the same number of tokens)."""
        x = torch.cat([x for x, _ in micro]).to(d.device)
        y = torch.cat([y for _, y in micro]).to(d.device)
        losses: list[torch.Tensor] = []
        args = (x,) if first else ()
        kwargs = {"target": y, "losses": losses} if last else {}
        with loss_context():
            schedule.step(*args, **kwargs)
        return torch.stack([local(x.detach()) for x in losses]).mean() if last else None

    def train_step(micro) -> torch.Tensor | None:
        """Forward and backward of this rank's share of a global batch; its mean loss."""
        if pp > 1:
            return run_pipeline(micro)
        total = torch.zeros((), device=d.device)
        for i, (x, y) in enumerate(micro):
            with grad_sync(model, sync=i == len(micro) - 1), loss_context():
                loss = forward_loss(x, y)
                # Each micro-batch holds the same number of tokens: the mean of the
                # micro-batch means is the mean over this rank's share of the batch.
                (loss / len(micro)).backward()
            total += local(loss.detach())
        return total / len(micro)

    @torch.no_grad()
    def eval_loss(micro) -> torch.Tensor | None:
        with loss_context():
            if pp > 1:
                out = [
                    pipeline.forward_only(
                        dict(stages),
                        pp * v,
                        schedule_name,
                        d.mesh["pp"],
                        x.to(d.device),
                        y.to(d.device),
                        loss_fn,
                    )
                    for x, y in micro
                ]
                return torch.stack([local(o) for o in out]).mean() if last else None
            return torch.stack([local(forward_loss(x, y)) for x, y in micro]).mean()

    def evaluate() -> float | None:
        for part in parts:
            part.eval()
        losses = [eval_loss(val_batches.micro_batches(k)) for k in range(t.eval_batches)]
        for part in parts:
            part.train()
        return global_mean(losses)

    def global_mean(losses: list) -> float | None:
        """Mean over the data-parallel ranks of the last stage (None elsewhere)."""
        if not last:
            return None
        return distributed.all_reduce_mean(torch.stack(losses).mean(), d.dp_mesh).item()

    # The loss lives on the last pipeline stage: its first data- and tensor-parallel rank logs.
    tp_rank = d.mesh["tp"].get_local_rank() if d.mesh is not None else 0
    logger = MetricsLogger(
        run_dir,
        enabled=last and dp_rank == 0 and tp_rank == 0,
        total_steps=t.steps,
        log_interval=cfg.logging.log_interval,
        wandb_cfg=cfg.logging.wandb,
        run_name=Path(run_dir).name,
        config=OmegaConf.to_container(dcfg, resolve=True, enum_to_str=True),
    )
    tokens_per_step = t.global_batch_size * t.seq_len
    peak = cfg.hardware.peak_tflops * 1e12
    ok = False
    try:
        for step in range(1, t.steps + 1):
            start = time.perf_counter()
            lr = lr_at(step - 1, t)
            set_lr(optimizer, lr)
            check_fault(d.rank, step)
            loss = train_step(train_batches.micro_batches(step - 1))
            pp_group = d.mesh["pp"].get_group() if pp > 1 else None
            grad_norm = clip_grad_norm(params, t.grad_clip, pp_group)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step_loss = global_mean([loss])
            elapsed = time.perf_counter() - start
            tps = tokens_per_step / elapsed / d.world_size
            metrics = {
                "loss": step_loss,
                "lr": lr,
                "grad_norm": grad_norm.item(),
                "tokens_per_s": tps,
                "mfu": tps * plan.flops_per_token / peak,
                "step_time_s": elapsed,
            }
            if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
                metrics["eval_loss"] = evaluate()
            logger.log(step, metrics)
        if t.save_final:
            save_full_state_dict(parts, d, Path(run_dir) / "final_model.pt")
        ok = True
    finally:
        logger.close(ok)
