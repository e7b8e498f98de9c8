"""The contenders of the speed benchmarks, each one optimizer step on the same work.

A Workload is what every contender trains: the model's config fields, one rank's
micro-batches already on the device, the optimizer settings, the compute dtype and whether
blocks are compiled. `engine` builds this project's trainer on one process and takes its
workload from it; `bare`, `hugging_face` (and `titan.torchtitan`) build their own model of the
same shape and return a step that does what a plain training loop does:

    for x, y in micro: cross_entropy(model(x), y) / len(micro) -> backward
    clip the global gradient norm; AdamW step; zero the gradients

Each builder returns `step() -> loss` (a detached device tensor: the timing decides when to
synchronise, the step never does) with the model it trains as `step.model`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from launcher import models
from launcher.cli import compose
from launcher.config import TrainConfig
from launcher.hf.config_json import to_hf_config
from launcher.parallel.data_parallel import DTYPES
from launcher.parallel.float8 import quiet_torchao
from launcher.plan import engine_plan
from launcher.plan.report import problems_message
from launcher.runtime import distributed
from launcher.train import check_devices
from launcher.training.optim import param_groups
from launcher.training.trainer import Trainer

Step = Callable[[], torch.Tensor]


@dataclass
class Workload:
    model: dict  # ModelConfig fields
    micro: list[tuple[torch.Tensor, torch.Tensor]]  # (B, S) inputs and targets, on device
    train: TrainConfig  # lr, betas, weight decay, clipping, seed
    device: torch.device
    compute_dtype: torch.dtype  # autocast to this unless it is fp32
    compile: bool  # torch.compile each block, as train.compile does

    @property
    def tokens(self) -> int:
        """Tokens per step."""
        return sum(x.numel() for x, *_ in self.micro)

    def autocast(self):
        if self.compute_dtype == torch.float32:
            return nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)


def engine(overrides: list[str], run_dir: str | None = None):
    """This project's trainer on one process for `overrides`: (step, workload, plan).

    Exactly what `python -m launcher.train` runs per step (Trainer.train_step: the batch
    for the step, forward/backward, clipping, AdamW, the step's metrics), minus the logger.
    """

    cfg = compose(["hardware.devices_per_node=1", "hardware.nodes=1", *overrides])
    plan = engine_plan(cfg)
    if not plan.valid:
        raise ValueError(problems_message(plan))
    check_devices(cfg.hardware.device_type.value, 1)
    d = distributed.init(cfg.hardware.device_type.value, plan.layout, cfg.train.timeout_s)
    run_dir = run_dir or tempfile.mkdtemp(prefix="bench-")
    trainer = Trainer(cfg, plan, run_dir, OmegaConf.structured(cfg), d)
    counter = iter(range(1, 1 << 62))

    def step() -> torch.Tensor:
        return torch.tensor(trainer.train_step(next(counter))["loss"])

    step.model = trainer.parts[0]

    workload = Workload(
        model=dict(vars(cfg.model)),
        micro=trainer.prepare(trainer.train_batches.at(0)),
        train=cfg.train,
        device=d.device,
        compute_dtype=DTYPES[cfg.precision.compute_dtype.value],
        compile=cfg.train.compile,
    )
    return step, workload, plan


def plain_loop(model: nn.Module, w: Workload, forward: Callable | None = None) -> Step:
    """A plain training loop's step over `model` (AdamW on decayed matrices and undecayed
    vectors, as the engine groups them; torch's own global-norm clipping)."""
    forward = forward or model

    t = w.train
    params = [p for p in model.parameters() if p.requires_grad]
    groups = param_groups(model, t.weight_decay)
    opt = torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), eps=1e-8)

    def step() -> torch.Tensor:
        total = torch.zeros((), device=w.device)
        for x, y, *_ in w.micro:  # (documents, if any: the bare loop is causal)
            with w.autocast():
                logits = forward(x)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())
            (loss / len(w.micro)).backward()
            total += loss.detach()
        if t.grad_clip > 0:
            nn.utils.clip_grad_norm_(params, t.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return total / len(w.micro)

    step.model = model
    return step


def bare(w: Workload) -> Step:
    """This project's model class in a plain loop: what the engine adds is the difference."""

    torch.manual_seed(w.train.seed)
    model = models.build(w.model["family"], w.model)
    model.init_weights(w.train.seed)
    model.to(w.device)
    if w.compile:
        for block in model.layers.values():
            block.compile()
    return plain_loop(model, w)


def hugging_face(w: Workload) -> Step:
    """transformers' model of the same shape (LlamaForCausalLM, MixtralForCausalLM,
    DeepseekV3ForCausalLM or DeepseekV2ForCausalLM), random init, SDPA attention, in a plain
    loop; with compile, each decoder layer compiled."""
    with quiet_torchao():  # transformers imports it, where installed, with its model classes
        import transformers

        hf = to_hf_config(w.model, "float32")
        config = transformers.AutoConfig.for_model(**hf)  # model_type picks the class
        torch.manual_seed(w.train.seed)
        model_cls = getattr(transformers, hf["architectures"][0])
        model = model_cls._from_config(config, attn_implementation="sdpa").to(w.device)
    model.train()
    if w.compile:
        for layer in model.model.layers:
            layer.compile()

    def forward(x: torch.Tensor) -> torch.Tensor:
        return model(input_ids=x, use_cache=False).logits

    return plain_loop(model, w, forward)
