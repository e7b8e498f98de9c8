"""The trainer: one loop for every model family and layout, in a few named steps.

prepare (a batch onto the device; under context parallelism each rank keeps its chunks of every
sequence, and the model gets their positions) -> forward_backward (local micro-batches, or the
pipeline schedule), inside train_context (loss parallelism) -> optimizer_step (learning rate,
global-norm clipping, AdamW per model part) -> the loop in `train` (resume, steps, evaluation,
checkpoints, stop on a signal). `state` is what a checkpoint holds. Every layout fact comes
from the plan's Layout.
"""

from __future__ import annotations

import math
import os
import re
import resource
import shlex
import signal
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict
from pathlib import Path
from typing import NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import DictConfig, OmegaConf
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel

from launcher import models
from launcher.checkpoint.reader import checkpoint_damage
from launcher.checkpoint.saver import Checkpointer, ModelState, RngState, TrainState
from launcher.checkpoint.store import (
    Entry,
    complete_newest_first,
    newest_complete,
    nothing_left,
    run_checkpoint_dir,
    starting_checkpoint,
    step_dir,
)
from launcher.cli import USAGE_ERROR
from launcher.data.batches import IGNORE, Batches
from launcher.data.sources import document_attention, run_data
from launcher.hf import weights as hf_weights
from launcher.layout import as_saved, describe, stage_owner
from launcher.models.layers import document_ids, future_tokens
from launcher.models.moe import expert_kernel
from launcher.parallel import build, pipeline_parallel
from launcher.parallel.context_parallel import chunk_positions
from launcher.parallel.data_parallel import DTYPES, average_grads, grad_sync, local_tensor
from launcher.parallel.expert_parallel import (
    balance_step,
    expert_params,
    moe_layers,
    sync_expert_grads,
)
from launcher.plan import Plan
from launcher.plan.context import loss_compiled
from launcher.plan.report import plan_json
from launcher.runtime import distributed, early
from launcher.runtime.failures import (
    STOPPED_FILE,
    NonFinite,
    RunEnded,
    StopRequest,
    fault,
    inject,
    restarts_left,
    resume_mode,
    timed,
    write_record,
)
from launcher.runtime.launch import hydra_quoted
from launcher.runtime.metrics import MetricsLogger
from launcher.runtime.profiling import profiled, resumed_past
from launcher.training import qk_clip
from launcher.training.optim import build_optimizers, clip_grad_norm, lr_at


class Stopped(Exception):
    """Training stopped on a signal after saving a checkpoint of the current step."""

    def __init__(self, signum: int, step: int, checkpoint: str):
        super().__init__(f"stopped by signal {signum} after step {step}")
        self.signum, self.step, self.checkpoint = signum, step, checkpoint


def build_model(cfg, seed: int) -> torch.nn.Module:
    """The family's whole model from config, initialised from `seed`, on one process: the
    values every layout's shards hold (launcher.parallel.build)."""
    model = models.build(cfg.model.family, vars(cfg.model))
    model.init_weights(seed)
    return model.to(DTYPES[cfg.precision.master_dtype.value])


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32; logits (B, S, V), targets (B, S)."""
    return F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def loss_sum(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy in fp32 over the targets that are not IGNORE (a chat
    set's prompts and padding): the trainer divides by the global batch's count of them."""
    flat = logits.flatten(0, 1).float()
    return F.cross_entropy(flat, targets.flatten(), ignore_index=IGNORE, reduction="sum")


class Micro(NamedTuple):
    """One micro-batch on a rank: inputs and targets (B, S), documents (B, S) under
    data.attention=document (models.layers.document_ids), and with multi-token prediction the
    tokens ahead (B, S, mtp_depth + 1) (models.layers.future_tokens); else None."""

    x: torch.Tensor
    y: torch.Tensor
    docs: torch.Tensor | None
    future: torch.Tensor | None = None


def unwrapped(part: torch.nn.Module) -> torch.nn.Module:
    """The model a part is (under DDP, the one it wraps)."""
    return getattr(part, "module", part)


def local(x: torch.Tensor) -> torch.Tensor:
    """A (replicated) DTensor loss as a plain tensor."""
    return x.full_tensor() if isinstance(x, DTensor) else x


class Trainer:
    def __init__(self, cfg, plan: Plan, run_dir: str, dcfg: DictConfig, d: distributed.Dist):
        self.cfg, self.plan, self.layout, self.d = cfg, plan, plan.layout, d
        self.run_dir = Path(run_dir)
        self.config = OmegaConf.to_container(dcfg, resolve=True, enum_to_str=True)
        t = cfg.train
        torch.manual_seed(t.seed)
        if d.device.type == "cpu" and "OMP_NUM_THREADS" in os.environ:
            torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
        # Compiled blocks compile the loss too (the planner's loss_compiled says when): the fp32
        # cast and the log-softmax fuse, and its backward keeps the logits and their gradient
        # in the compute dtype, 4 bytes per logit in bf16 where eager peaks at 12
        # (launcher/plan/estimate.py, loss_bytes_per_logit).
        compiled_loss = loss_compiled(cfg, self.layout)
        data = run_data(cfg.data, t.seq_len)
        # A chat set: the loss is the mean over the whole global batch's trained tokens. Each
        # micro-batch's summed loss is scaled by loss_scale (set each step: step_scale), so
        # that the micro-batch means the engine then takes (over micro-batches, the schedule's
        # gradient scaling, the data- and context-parallel average) make that mean.
        self.masked = data.masked
        fn = loss_sum if self.masked else loss_fn
        self.loss = torch.compile(fn) if compiled_loss else fn
        self.loss_scale = 1.0
        began = time.perf_counter()
        self._build_model()
        self.build_s = time.perf_counter() - began
        # Each micro-batch's balance losses weigh 1 / micro-batches, like its main loss (the
        # pipeline schedules divide every gradient by the micro-batch count themselves). Every
        # tp rank starts the same balance loss's gradient, and tp ranks' gradients add up
        # rather than average: each starts a tp-th.
        self.moe = cfg.model.n_routed_experts > 0
        micro = 1 if self.schedule else self.layout.microbatches
        for part in self.parts:
            for _, moe in moe_layers(part):
                moe.parallelize(aux_grad_scale=1.0 / (micro * self.layout.tp))
        # Multi-token prediction: its loss weighs 1 / micro-batches too, on the last stage.
        self.mtp_depth = cfg.model.mtp_depth
        if self.mtp_depth and self.last:
            model = unwrapped(self.parts[-1])
            model.mtp_grad_scale = 1.0 / micro
            if self.layout.cp > 1:  # each rank holds a part of every sequence
                model.mtp_whole = t.seq_len
        self.optimizers = build_optimizers(
            self.parts, self.layout, t, d, cfg.precision, cfg.optimizer
        )
        # QK-clip (optimizer.qk_clip): the cores record their largest logits for it.
        self.qk_clip, self.clip_stats = cfg.optimizer.qk_clip, {}
        if self.qk_clip:
            qk_clip.track(self.parts)
        self.params = [p for part in self.parts for p in part.parameters() if p.requires_grad]
        self.copies = []  # parameters whose gradient another one holds too (clipping)
        if self.tied is not None and self.tied.copy is not None:
            self.copies = [self.tied.copy]
            self.params = [p for p in self.params if p is not self.tied.copy]
            self.optimizers.alias(self.parts[-1], self.tied.names[1], self.tied.names[0])
        # FSDP casts to param_dtype itself; replicated models compute under autocast instead.
        self.autocast = cfg.precision.compute_dtype != cfg.precision.master_dtype and not (
            isinstance(self.parts[0], FSDPModule)
        )
        self.compute_dtype = DTYPES[cfg.precision.compute_dtype.value]
        loop = self.moe and expert_kernel(d.device.type, self.compute_dtype)
        if loop and d.rank == 0:
            print(f"experts: one at a time, no grouped matmul here ({loop})", flush=True)
        # MFU's denominator: the device's peak. A CPU preset's is one thread's matmul rate, and
        # a process computes on torch's intra-op threads (one per rank under torchrun, every
        # core for a run of one process).
        threads = torch.get_num_threads() if d.device.type == "cpu" else 1
        self.peak_flops = cfg.hardware.peak_tflops * 1e12 * threads
        self.eos_id, self.documents = data.eos_id, document_attention(cfg)
        lay = self.layout
        batches = (t.global_batch_size, lay.micro_batch_size, d.dp_rank, lay.dp, t.seed)
        # Context-parallel ranks share their data-parallel rank's batch and keep their own
        # chunks of each sequence (see prepare); positions (S / cp,) say where those sit.
        self.positions = (
            chunk_positions(t.seq_len, lay.cp, d.local_rank_of("cp"), cfg.context.load_balance).to(
                d.device
            )
            if lay.cp > 1
            else None
        )
        self.train_batches = Batches(data.train, *batches, shuffle=True, blend=data.blend)
        self.val_batches = Batches(data.held_out, *batches, shuffle=False, blend=data.blend)
        self.named_val = {
            name: Batches(part, *batches, shuffle=False) for name, part in data.named.items()
        }
        self.train_state = TrainState()
        ck = cfg.checkpoint
        self.checkpointer = Checkpointer(
            run_checkpoint_dir(ck.dir, run_dir),
            ck.keep,
            ck.async_save,
            d.rank,
            self.checkpoint_meta,
        )

    # -- model ---------------------------------------------------------------------------

    def _build_model(self) -> None:
        """This rank's model parts (its pipeline stages, or the whole model): built on meta,
        parallelized, then only this rank's share allocated and initialised (parallel.build)."""
        cfg, lay, d = self.cfg, self.layout, self.d
        self.tied = None  # a tied embedding split between pipeline stages
        built = build(cfg, lay, d, d.local_rank_of("pp") if lay.pp > 1 else 0)
        if lay.pp > 1:
            self.stages = built.stages
            self.parts = [m for _, m in self.stages]
            indices = [i for i, _ in self.stages]
            self.first, self.last = 0 in indices, lay.n_stages - 1 in indices
            names = built.tied
            if names is not None:
                held, last = dict(self.stages), lay.n_stages - 1
                other = stage_owner(last, lay.pp, lay.schedule)
                self.tied = pipeline_parallel.TiedEmbedding(
                    names,
                    held[0].get_parameter(names[0]) if 0 in held else None,
                    held[last].get_parameter(names[1]) if last in held else None,
                    d.pp_pair_group(0, other) if other != 0 else None,
                )
            self.schedule = pipeline_parallel.build_schedule(
                self.stages,
                lay.n_stages,
                lay.schedule,
                lay.microbatches,
                self.train_loss,
                d.mesh["pp"],
                d.device,
                reshard_each_microbatch=lay.reshard_each_microbatch,
            )
        else:
            self.stages, self.schedule = [], None
            self.parts, self.first, self.last = [built.stages[0][1]], True, True

    # -- one step, in named pieces -------------------------------------------------------

    def prepare(self, micro: list) -> list[Micro]:
        """A rank's micro-batches on its device (Micro), (B, S) each, or under context
        parallelism the (B, S / cp) tokens at this rank's positions (documents stay whole:
        every rank looks its keys' up). Each cp rank then holds the same number of tokens, so
        the mean of their mean losses is the batch's mean."""
        out = []
        for x, y in micro:
            x, y = x.to(self.d.device), y.to(self.d.device)
            docs = document_ids(x, self.eos_id) if self.documents else None
            # Of the whole sequence: the tokens ahead of a cp rank's last one are another's.
            future = future_tokens(y, self.mtp_depth) if self.mtp_depth else None
            if self.positions is not None:
                x, y = x[:, self.positions], y[:, self.positions]
                future = future[:, self.positions] if future is not None else None
            out.append(Micro(x, y, docs, future))
        return out

    def train_context(self):
        """With loss parallelism the logits stay sharded over the vocabulary; cross-entropy
        (and its backward) must run under loss_parallel(), which reduces across tp ranks."""
        return loss_parallel() if self.layout.loss_parallel else nullcontext()

    def train_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """A micro-batch's training loss: its mean, or with a chat set its sum scaled to its
        share of the global batch's mean (step_scale)."""
        loss = self.loss(logits, y)
        return loss * self.loss_scale if self.masked else loss

    def step_scale(self, position: int) -> int | None:
        """With a chat set: the trained tokens of the global batch at `position` (every rank
        counts them from the data, so no collective), and loss_scale for its micro-batches: a
        rank's micro-batch mean of sums x dp x cp / that count is its share of the batch's
        mean. None without a mask."""
        if not self.masked:
            return None
        lay = self.layout
        trained = self.train_batches.trained_tokens(position)
        self.loss_scale = lay.dp * lay.cp * lay.microbatches / max(trained, 1)
        return trained

    def forward_loss(self, x: torch.Tensor, y: torch.Tensor, docs, future=None) -> torch.Tensor:
        """A micro-batch's training loss (train_loss); with the tokens ahead (multi-token
        prediction), the prediction depths' loss is attached to the logits (models.deepseek)
        and starts in their backward."""
        ahead = {"future": future} if future is not None else {}
        with torch.autocast(self.d.device.type, dtype=self.compute_dtype, enabled=self.autocast):
            return self.train_loss(self.parts[0](x, self.positions, docs, **ahead), y)

    def mtp_weight(self, samples: int) -> None:
        """Multi-token prediction's loss weight for a step that starts after `samples`
        sequences: model.mtp_loss_weight, then mtp_loss_weight_after from the step whose
        tokens before it reach mtp_loss_weight_switch_tokens."""
        m = self.cfg.model
        if not self.mtp_depth or not self.last:
            return
        switch = m.mtp_loss_weight_switch_tokens
        late = switch and samples * self.cfg.train.seq_len >= switch
        unwrapped(self.parts[-1]).mtp_weight = (
            m.mtp_loss_weight_after if late else m.mtp_loss_weight
        )

    def mtp_step(self) -> dict:
        """Multi-token prediction's loss of the step, each depth's mean over micro-batches and
        the data- and context-parallel ranks (mtp_loss: their mean over depths)."""
        if not self.mtp_depth or not self.last:
            return {}
        model = unwrapped(self.parts[-1])
        losses = model.mtp_loss_sum / self.layout.microbatches
        model.mtp_loss_sum = torch.zeros_like(model.mtp_loss_sum)
        losses = distributed.all_reduce_mean(losses, self.d.dp_cp_mesh).tolist()
        out = {"mtp_loss": sum(losses) / len(losses), "mtp_weight": model.mtp_weight}
        if len(losses) > 1:
            out.update({f"mtp_loss/depth_{k + 1}": v for k, v in enumerate(losses)})
        return out

    def forward_backward(self, micro: list) -> torch.Tensor | None:
        """Forward and backward of this rank's share of a global batch; its mean loss (None on
        pipeline ranks without the last stage)."""
        if self.schedule is not None:
            return self._pipeline_step(micro)
        total = torch.zeros((), device=self.d.device)
        for i, batch in enumerate(micro):
            with grad_sync(self.parts[0], sync=i == len(micro) - 1), self.train_context():
                loss = self.forward_loss(*batch)
                # Each micro-batch holds the same number of tokens: the mean of the
                # micro-batch means is the mean over this rank's share of the batch (with a
                # chat set, their sums are scaled to make it so: step_scale).
                (loss / len(micro)).backward()
            total += local(loss.detach())
        return total / len(micro)

    def _pipeline_step(self, micro: list) -> torch.Tensor | None:
        """The schedule runs every micro-batch; only the last stage sees losses (their mean,
        as each micro-batch holds the same number of tokens)."""
        x = torch.cat([b.x for b in micro])
        y = torch.cat([b.y for b in micro])
        losses: list[torch.Tensor] = []
        args = (x,) if self.first else ()
        kwargs = {"target": y, "losses": losses} if self.last else {}
        # Every stage's blocks need these; the schedule splits them with the batch.
        if self.positions is not None:
            kwargs["positions"] = self.positions.expand(len(micro) * micro[0].x.shape[0], -1)
        if self.documents:
            kwargs["documents"] = torch.cat([b.docs for b in micro])
        if self.mtp_depth:  # the last stage's prediction depths read them
            kwargs["future"] = torch.cat([b.future for b in micro])
        with self.train_context():
            self.schedule.step(*args, **kwargs)
        return torch.stack([local(x.detach()) for x in losses]).mean() if self.last else None

    def optimizer_step(
        self, step: int, loss: torch.Tensor | None
    ) -> tuple[float, torch.Tensor, bool]:
        """Clip the global gradient norm and step every part's optimizer at step's lr, unless
        a rank's loss or the gradient norm is not finite; (lr, norm, whether it was applied)."""
        lr = lr_at(step - 1, self.cfg.train)
        self.optimizers.set_lr(lr)
        self.reduce_gradients()
        grad_norm = clip_grad_norm(
            self.params, self.cfg.train.grad_clip, self.d.group("pp"), self.copies
        )
        applied = self.all_finite([grad_norm, loss])
        if applied:
            self.optimizers.step()
        if self.qk_clip:  # the weights just stepped, bounded by the logits they made
            self.clip_stats = qk_clip.clip(self.parts, self.qk_clip, self.d) if applied else {}
            qk_clip.reset(self.parts)
        self.optimizers.zero_grad()
        return lr, grad_norm, applied

    def all_finite(self, tensors: list) -> bool:
        """Whether every rank's tensors (None: none here) are finite everywhere; a collective
        over the world, so that every rank takes the same branch. Reads one flag on the host."""
        bad = torch.zeros((), dtype=torch.float32, device=self.d.device)
        for t in tensors:
            if t is not None:
                bad = torch.maximum(bad, (~torch.isfinite(local_tensor(t))).any().float())
        if dist.is_initialized():
            dist.all_reduce(bad, op=dist.ReduceOp.MAX)
        return not bad.item()

    def reduce_gradients(self) -> None:
        """Where no FSDP or DDP hook did it: average the experts' gradients over the ranks
        holding the same experts, and with DDP or ZeRO-1 under a pipeline every other gradient
        over dp x cp (Layout.grads_averaged_by_trainer)."""
        if self.layout.grads_averaged_by_trainer:
            experts = {id(p) for part in self.parts for p in expert_params(part)}
            params = [*self.params, *self.copies]
            others = [p.grad for p in params if id(p) not in experts and p.grad is not None]
            average_grads(others, self.d.dp_cp_mesh.get_group())
        sync_expert_grads(self.parts)
        if self.tied is not None:
            self.tied.sync_grads()

    def balance_step(self, applied: bool) -> dict:
        """MoE models: the expert loads of the step, the bias update (on an applied step),
        their metrics."""
        if not self.moe:
            return {}
        m = self.cfg.model
        return balance_step(
            self.parts,
            m.n_layers + m.mtp_depth,
            m.n_routed_experts,
            self.layout.microbatches,
            m.bias_update_speed if applied else 0.0,
        )

    @torch.no_grad()
    def eval_loss(self, micro: list, masked: bool = False) -> torch.Tensor | None:
        """The loss of a rank's share of an evaluation batch: the mean of its micro-batches'
        means, or `masked` (a chat set, or any set of a run whose loss is a sum: self.loss)
        (the sum over its trained tokens, their count), which global_mean makes the mean over
        the whole batch's."""
        lay = self.layout
        loss = self.loss if masked == self.masked else loss_sum
        with self.train_context():
            if self.schedule is None:
                with torch.autocast(
                    self.d.device.type, dtype=self.compute_dtype, enabled=self.autocast
                ):
                    out = [
                        loss(self.parts[0](x, self.positions, docs), y) for x, y, docs, _ in micro
                    ]
            else:
                out = [
                    pipeline_parallel.forward_only(
                        dict(self.stages),
                        lay,
                        self.d.mesh["pp"],
                        x,
                        y,
                        loss,
                        self.positions,
                        docs,
                    )
                    for x, y, docs, _ in micro
                ]
            if not self.last:
                return None
            losses = torch.stack([local(o) for o in out])
            if not masked:
                return losses.mean()
            trained = sum((b.y != IGNORE).sum() for b in micro)
            return torch.stack([losses.sum(), trained.to(losses.dtype)])

    def evaluate(self) -> dict:
        """eval_loss (the training sources' held-out tails) and eval/<name> for each named
        validation set: means over the data- and context-parallel ranks (None off the last
        pipeline stage)."""
        for part in self.parts:
            part.eval()
        out = {}
        for name, batches in [("eval_loss", self.val_batches), *self.named_val.items()]:
            masked = batches.masked or self.masked  # a plain set: every target counted
            losses = [
                self.eval_loss(self.prepare(batches.micro_batches(k)), masked)
                for k in range(self.cfg.train.eval_batches)
            ]
            out[name if name == "eval_loss" else f"eval/{name}"] = self.global_mean(losses, masked)
        for part in self.parts:
            part.train()
        return out

    def global_mean(self, losses: list, masked: bool = False) -> float | None:
        """Mean over the data- and context-parallel ranks of the last stage (None elsewhere);
        `masked`: of eval_loss's (sum, count) pairs, the sum over all of them / the count."""
        if not self.last:
            return None
        if masked:
            total = distributed.all_reduce_mean(torch.stack(losses).sum(0), self.d.dp_cp_mesh)
            return (total[0] / total[1].clamp(min=1)).item()
        return distributed.all_reduce_mean(torch.stack(losses).mean(), self.d.dp_cp_mesh).item()

    def train_step(self, step: int) -> dict:
        t, d, s = self.cfg.train, self.d, self.train_state
        start = time.perf_counter()
        inject(d.rank, step)
        self.mtp_weight(s.samples)
        trained = self.step_scale(s.samples)
        with timed(f"forward/backward of step {step}", d.rank, t.timeout_s):
            loss = self.forward_backward(self.prepare(self.train_batches.at(s.samples)))
        if fault(d.rank, step) == "nan":  # this rank's share of a gradient only
            local_tensor(next(p for p in self.params if p.grad is not None).grad).fill_(math.nan)
        with timed(f"optimizer step {step}", d.rank, t.timeout_s):
            lr, grad_norm, applied = self.optimizer_step(step, loss)
            balance = self.balance_step(applied)
            ahead = self.mtp_step()
            step_loss = self.global_mean([loss])
        # A skipped step still consumes its batch: the data order stays a function of the step.
        s.step, s.samples = step, s.samples + t.global_batch_size
        elapsed = time.perf_counter() - start
        tps = t.global_batch_size * t.seq_len / elapsed / d.world_size
        skipped = {} if applied else {"skipped": True}
        return {
            "loss": step_loss,
            "lr": lr,
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tps,
            "mfu": tps * self.plan.flops_per_token / self.peak_flops,
            "step_time_s": elapsed,
            "peak_memory_gib": peak_memory_gib(d.device),
            **({} if trained is None else {"trained_tokens": trained}),
            **balance,
            **ahead,
            **self.clip_stats,
            **skipped,
        }

    # -- checkpoints ---------------------------------------------------------------------

    def state(self, weights_only: bool = False, rng: bool = True) -> dict:
        """What a checkpoint holds (DCP Stateful objects)."""
        if weights_only:
            return {"model": ModelState(self.parts)}
        out = {
            "model": ModelState(self.parts),
            "optimizer": self.optimizers,
            "train": self.train_state,
        }
        if rng:
            out[f"rng.{self.d.rank}"] = RngState()
        return out

    def checkpoint_meta(self, step: int) -> dict:
        """meta.json: readable without torch.distributed."""
        return {
            "step": step,
            "samples": self.train_state.samples,
            "world_size": self.d.world_size,
            "layout": asdict(self.layout),
            "config": self.config,
            "plan": plan_json(self.plan),
        }

    def resume(self) -> int:
        """Load the starting checkpoint, if any (every rank takes rank 0's choice); returns
        the step training continues after."""
        ck = self.cfg.checkpoint
        hf = ck.initial_load_format.value == "hf"
        choice = [None]
        if self.d.rank == 0:
            directory = self.checkpointer.directory
            dcp_path = None if hf else ck.initial_load_path
            choice = [starting_checkpoint(directory, resume_mode(ck.resume.value), dcp_path)]
        if dist.is_initialized():
            dist.broadcast_object_list(choice, src=0)
        entry, initial = self.intact(*choice[0])
        if entry is None:
            if hf and ck.initial_load_path:
                self.load_hf(ck.initial_load_path)
            return 0
        # A checkpoint converted from Hugging Face holds the model only.
        weights_only = initial and (ck.initial_load_weights_only or entry.meta.get("weights_only"))
        saved = entry.meta.get("layout")
        same = saved is not None and as_saved(saved) == as_saved(asdict(self.layout))
        state = self.state(weights_only, rng=same and not weights_only)
        with timed(f"loading {entry.path}", self.d.rank, self.cfg.train.timeout_s):
            self.checkpointer.load(entry, state)
        if self.d.rank == 0:
            what = "the weights of" if weights_only else f"step {entry.step} of"
            moved = (
                ""
                if same or not entry.meta.get("layout")
                else f", saved under {entry.layout}: resharded"
            )
            print(f"starting from {what} {entry.path}{moved}", flush=True)
        if weights_only:
            return 0
        return self.train_state.step

    def intact(self, entry: Entry | None, initial: bool) -> tuple[Entry | None, bool]:
        """The starting checkpoint once the ranks have checked its files (each rank its share
        of the checksums, rank 0 the metadata's allow-list). A damaged one in the run's own
        directory is passed over, with one warning line, for the next older complete one; a
        damaged checkpoint given by path, or a directory of nothing but damaged ones, ends the
        run (exit 2) rather than starting over."""
        d = self.d
        while entry is not None:
            mine = checkpoint_damage(entry, (d.rank, d.world_size))
            found = [mine]
            if dist.is_initialized():
                found = [None] * d.world_size
                dist.all_gather_object(found, mine)
            problems = sorted({p for f in found for p in f})
            if not problems:
                return entry, initial
            what = f"{entry.path} is damaged ({'; '.join(problems)})"
            if initial:
                raise RunEnded(USAGE_ERROR, f"error: checkpoint.initial_load_path: {what}")
            older = [e for e in complete_newest_first(entry.path.parent) if e.step < entry.step]
            if not older:
                raise RunEnded(
                    USAGE_ERROR,
                    f"error: {what}, and no older intact checkpoint is left in "
                    f"{entry.path.parent}: move the damaged ones aside to start over",
                )
            if d.rank == 0:
                print(f"warning: {what}: resuming from {older[0].path}", file=sys.stderr)
            entry = older[0]
        return None, initial

    def load_hf(self, path: str) -> int:
        """The model's weights from a Hugging Face directory; each rank reads its shards.
        Returns the number of values this rank read."""
        with timed(f"loading {path}", self.d.rank, self.cfg.train.timeout_s):
            read = hf_weights.load_into(self.parts, path, vars(self.cfg.model))
        held = [*self.params, *self.copies]
        total = sum(local_tensor(p).numel() for p in held)
        if self.d.rank == 0:
            print(
                f"starting from the Hugging Face weights in {path} (rank 0 read {read:,} "
                f"values for the {total:,} it holds)",
                flush=True,
            )
        return read

    def save(self, step: int, wait: bool = False) -> None:
        """A checkpoint of the state after `step`; never of a non-finite one (NonFinite)."""
        if not self.all_finite([*self.params, *self.copies]):
            raise self.nonfinite(step, "a parameter", 0)
        with timed(f"checkpoint of step {step}", self.d.rank, self.cfg.train.timeout_s):
            self.checkpointer.save(step, self.state(), wait=wait)

    def nonfinite(self, step: int, what: str, skipped: int) -> NonFinite:
        """The stop at a non-finite step, naming the newest checkpoint (all finite)."""
        self.checkpointer.wait()
        newest = newest_complete(self.checkpointer.directory)
        allowed = self.cfg.train.max_skipped_steps
        return NonFinite(step, what, skipped, allowed, str(newest.path) if newest else None)

    def unwritable(self, step: int, why: str | None) -> RunEnded:
        """The stop after a step whose metrics (rank 0's) could not be written: a full or
        read-only disk under the run directory; the newest checkpoint stands."""
        self.checkpointer.wait()
        newest = newest_complete(self.checkpointer.directory)
        kept = (
            f"the newest checkpoint, {newest.path}, is intact. Free space (or make "
            f"{self.run_dir} writable) and run the same command again to resume from it"
            if newest
            else f"no checkpoint was saved. Free space (or make {self.run_dir} writable) and run "
            "the same command again to start over"
        )
        return RunEnded(1, f"error: the run stopped after step {step}: {why}; {kept}")

    # -- the loop ------------------------------------------------------------------------

    def train(self, stop: StopRequest) -> None:
        t, d = self.cfg.train, self.d
        start = self.resume()
        if start >= t.steps:
            if d.rank == 0:
                print(nothing_left(start, t.steps, self.run_dir), flush=True)
            return
        skipped_profiles = resumed_past(self.cfg.profile.steps, start)
        if skipped_profiles and d.rank == 0:
            print(skipped_profiles, file=sys.stderr, flush=True)
        # The loss lives on the last pipeline stage: its first data-, context- and
        # tensor-parallel rank.
        first = d.dp_rank == 0 and d.local_rank_of("cp") == 0 and d.local_rank_of("tp") == 0
        logger = MetricsLogger(
            str(self.run_dir),
            enabled=self.last and first,
            total_steps=t.steps,
            logging=self.cfg.logging,
            run_name=self.run_dir.name,
            config=self.config,
            start_step=start,
            layout=f"{d.world_size} rank(s): {describe(asdict(self.layout))}",
        )
        interval = self.cfg.checkpoint.interval
        ok, skipped, ended = False, 0, "failed"
        started = self.started()
        try:
            for step in range(start + 1, t.steps + 1):
                with profiled(
                    step, self.cfg.profile, self.run_dir, d.rank, d.device.type == "cuda"
                ):
                    metrics = self.train_step(step)
                metrics.update(started)
                started = {}
                if t.eval_interval and (step % t.eval_interval == 0 or step == t.steps):
                    with timed(f"evaluation at step {step}", d.rank, t.timeout_s):
                        metrics.update(self.evaluate())
                logger.log(step, metrics)
                skipped = skipped + 1 if metrics.get("skipped") else 0
                if skipped > t.max_skipped_steps:
                    norm = metrics["grad_norm"]
                    what = f"the gradient norm ({norm})" if not math.isfinite(norm) else "the loss"
                    raise self.nonfinite(step, what, skipped)
                if skipped:
                    logger.skipped(step, skipped, t.max_skipped_steps)
                with timed(f"the stop check after step {step}", d.rank, t.timeout_s):
                    signum, unwritable = stop.agreed(failed=logger.failed is not None)
                if unwritable:
                    raise self.unwritable(step, logger.failed)
                if signum and step < t.steps:  # on the last step the run just finishes
                    self.save(step, wait=True)
                    stopped = Stopped(
                        signum, step, str(step_dir(self.checkpointer.directory, step))
                    )
                    self.write_stopped(stopped)
                    ok = True  # stopped cleanly: the wandb run is not failed, it will resume
                    ended = f"stopped by {signal.Signals(signum).name}"
                    raise stopped
                if step == t.steps or (interval and step % interval == 0):
                    self.save(step, wait=step == t.steps)
            if t.save_final:
                save_full_state_dict(self.parts, d, self.run_dir / "final_model.pt")
            ok, ended = True, "finished"
        except RunEnded as e:
            ended = f"ended (exit {e.status})"
            raise
        finally:
            logger.close(ok)
            if logger.enabled:
                print(self.summary(ended, logger, wait=ended != "failed"), flush=True)

    def started(self) -> dict:
        """The start, for the first step's metrics (over every rank): seconds from the
        process's start to now (torch's import, the process group, the build, any load), and
        the peak memory before the first step, the largest and the smallest of any rank; and
        the longest any rank took to build and initialise its model parts (`build_s`)."""
        peak = peak_memory_gib(self.d.device)
        figures = torch.tensor(
            [seconds_since_start(), peak, -peak, self.build_s],
            dtype=torch.float64,
            device=self.d.device,
        )
        if dist.is_initialized():
            dist.all_reduce(figures, op=dist.ReduceOp.MAX)
        seconds, peak, least, build_s = figures.tolist()
        return {
            "start_s": seconds,
            "start_peak_gib": peak,
            "start_peak_gib_least": -least,
            "build_s": build_s,
        }

    def summary(self, ended: str, logger: MetricsLogger, wait: bool) -> str:
        """The run's last lines: how it ended, where it stands and how to continue it. After
        a failure an asynchronous save in flight is not waited for (its peers may be gone)."""
        last = logger.last or {}
        step, t = last.get("step", 0), self.cfg.train
        loss = f", loss {last['loss']:.4f}" if isinstance(last.get("loss"), float) else ""
        if logger.last_eval is not None:
            loss += f", eval_loss {logger.last_eval:.4f}"
        if wait:
            self.checkpointer.wait()
        newest = newest_complete(self.checkpointer.directory)
        if ended == "failed" and (left := restarts_left()) > 0:  # not the end: say what's next
            return (
                f"run interrupted at step {step} of {t.steps}: torchrun restarts the ranks "
                f"({left} restart(s) left), which resume from {newest.path if newest else 'step 0'}"
            )
        tokens = (step - logger.start_step) * t.global_batch_size * t.seq_len
        lines = [
            f"run {ended} at step {step} of {t.steps}{loss}; {tokens:,} tokens in "
            f"{time.perf_counter() - logger.start:,.0f} s",
            f"  run directory  {self.run_dir}",
            f"  metrics        {self.run_dir / 'metrics.jsonl'}",
            f"  checkpoint     {newest.path if newest else 'none'}",
        ]
        if logger.wandb_where:
            lines.append(f"  wandb          {logger.wandb_where}")
        if step < t.steps:
            lines.append(f"  to continue    {continue_command(self.run_dir)}")
        return "\n".join(lines)

    def write_stopped(self, stopped: Stopped) -> None:
        """Tell the launcher process (if any) that the stop checkpoint is complete."""
        if self.d.rank == 0:
            record = {
                "step": stopped.step,
                "signal": stopped.signum,
                "checkpoint": stopped.checkpoint,
            }
            write_record(self.run_dir, STOPPED_FILE, record)


def continue_command(run_dir: Path) -> str:
    """The command this run was started with, run directory named: it resumes the run."""
    try:
        from hydra.core.hydra_config import HydraConfig

        given = list(HydraConfig.get().overrides.task)
    except ValueError:  # not inside a Hydra app (a test's job)
        given = []
    kept = [o for o in given if not o.startswith(("hydra.run.dir=", "hydra.output_subdir="))]
    plain = re.fullmatch(r"[\w./-]+", str(run_dir))
    args = [*kept, f"hydra.run.dir={run_dir if plain else hydra_quoted(str(run_dir))}"]
    return "python -m launcher.train " + " ".join(shlex.quote(a) for a in args)


def seconds_since_start() -> float:
    """Seconds since this process started (Linux: /proc), else since this module's import; a
    rank forked by launcher.agent on its first attempt counts from the agent's start
    (its imports are the rank's)."""
    if agent_started := os.environ.get(early.STARTED_ENV):
        return time.time() - float(agent_started)
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return uptime - ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.perf_counter() - _IMPORTED


_IMPORTED = time.perf_counter()


def peak_memory_gib(device: torch.device) -> float:
    """The most this process has held: the CUDA allocator's peak on a GPU, the peak resident
    set of the process on CPU (which includes the Python runtime and libraries)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def save_full_state_dict(parts: list[torch.nn.Module], d: distributed.Dist, path: Path) -> None:
    """Gather every shard (FSDP, TP) and every pipeline stage into one full state dict;
    rank 0 writes it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

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
