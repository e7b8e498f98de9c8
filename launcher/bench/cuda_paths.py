"""`python -m launcher.bench.cuda_paths [--device cuda] [--json F]`: the code paths that only a
CUDA device reaches, each by the smallest run that reaches it (docs/speed.md).

- rng_resume: gpt_debug with dropout 0.1 on one process, fp32, 4 steps checkpointing at 2;
  a second run resumes from step 2. The checkpoint holds the CUDA generator's state (dropout
  masks are drawn on the device), so the resumed step 3 must draw the same masks: its loss
  equal to the uninterrupted run's. "bitwise" also asks for equal gradient norms and step 4;
  a second uninterrupted run (control) says whether the device's backward is itself
  deterministic, so a difference there is not charged to the checkpoint.
- recompute_dropout: the same model with recompute=full: the recomputed forward must redraw
  the same masks (the checkpointed blocks restore the CUDA generator), so every loss equals
  the run without recompute.
- peak_memory: metrics.jsonl's peak_memory_gib (torch.cuda.max_memory_allocated): above 0 and
  below the device's memory.
- grouped_mm: the MoE experts of mixtral_debug and deepseek_debug in bf16, F.grouped_mm against
  the per-expert loop, forward and gradients (bf16 tolerance).
- cp_block: context parallelism's block kernel, CUDA's flash (returning the log-sum-exp) against
  the matmul form, forward and backward, own and other blocks, GQA and not (within 1e-2).
- compiled_bf16: llama3_debug, mixtral_debug and deepseek_debug in bf16, compiled blocks
  against eager, 4 steps each: losses within 2%.

The training runs are `python -m launcher.train` processes, started together (small models
share the device). On CPU the same runs go through the CPU paths (the CUDA-only parts are
marked not reached); that is how its test runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path
from unittest.mock import patch

import torch

from launcher import configs
from launcher.models import moe
from launcher.parallel import context_parallel as cp

BASE = [
    "train.steps=4",
    "train.warmup_steps=2",
    "train.eval_interval=0",
    "train.global_batch_size=8",
    "train.micro_batch_size=2",
    "train.seq_len=128",
    "logging.wandb.mode=disabled",
    "hardware.devices_per_node=1",
    "hardware.nodes=1",
]
DROPOUT = ["model=gpt_debug", "model.dropout=0.1", "precision=fp32"]
SAVE = ["checkpoint.interval=2", "checkpoint.keep=0"]
MOE_MODELS = ("mixtral_debug", "deepseek_debug")
COMPILED_MODELS = ("llama3_debug", *MOE_MODELS)


def hardware(device: str) -> list[str]:
    return ["hardware=h100_80g"] if device == "cuda" else ["hardware=cpu"]


def runs(device: str) -> dict[str, list[str]]:
    """Every training run's overrides, by name (the resumed run is started after its source)."""
    hw = [*hardware(device), *BASE]
    out = {
        "source": [*hw, *DROPOUT, *SAVE],
        "control": [*hw, *DROPOUT],
        "recompute": [*hw, *DROPOUT, "recompute=full"],
    }
    for model in COMPILED_MODELS:
        for compiled in (False, True):
            name = f"{model} {'compiled' if compiled else 'eager'}"
            out[name] = [*hw, f"model={model}", "precision=bf16_mixed", f"train.compile={compiled}"]
    return out


def start(name: str, overrides: list[str], root: Path, log) -> tuple[subprocess.Popen, Path]:
    run_dir = root / name.replace(" ", "_")
    args = [sys.executable, "-m", "launcher.train", *overrides, f"hydra.run.dir={run_dir}"]
    log(f"start {name}: {' '.join(overrides)}")
    with open(root / f"{run_dir.name}.log", "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT), run_dir


def metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


def finish(started: dict, root: Path, timeout: float) -> dict[str, list[dict]]:
    out = {}
    for name, (proc, run_dir) in started.items():
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
        out[name] = metrics(run_dir)
        if proc.returncode != 0:
            tail = (root / f"{run_dir.name}.log").read_text()[-2000:]
            out[name] = {"failed": f"exit {proc.returncode}", "log_tail": tail}
    return out


def by_step(rows: list[dict], key: str) -> dict[int, float]:
    return {r["step"]: r[key] for r in rows}


def rng_checks(got: dict) -> dict:
    src, ctl, res, rec = (got.get(k) for k in ("source", "control", "resumed", "recompute"))
    if not all(isinstance(x, list) and x for x in (src, ctl, res, rec)):
        return {"failed": {k: got.get(k) for k in ("source", "control", "resumed", "recompute")}}
    loss, norm = by_step(src, "loss"), by_step(src, "grad_norm")
    r_loss, r_norm = by_step(res, "loss"), by_step(res, "grad_norm")
    c_loss, c_norm = by_step(ctl, "loss"), by_step(ctl, "grad_norm")
    return {
        "rng_resume": {
            "step3_loss_equal": r_loss.get(3) == loss.get(3),
            "bitwise": r_loss == {s: loss[s] for s in r_loss}
            and r_norm == {s: norm[s] for s in r_norm},
            "control_bitwise": c_loss == loss and c_norm == norm,
            "source": {"loss": loss, "grad_norm": norm},
            "resumed": {"loss": r_loss, "grad_norm": r_norm},
            "control": {"loss": c_loss, "grad_norm": c_norm},
        },
        "recompute_dropout": {
            "loss_equal": by_step(rec, "loss") == c_loss,
            "max_grad_norm_rel": max(
                abs(by_step(rec, "grad_norm")[s] - c_norm[s]) / c_norm[s] for s in c_norm
            ),
            "loss": by_step(rec, "loss"),
        },
        "peak_memory": {
            "gib": max(r["peak_memory_gib"] for r in src),
            "reached": any(r["peak_memory_gib"] > 0 for r in src),
        },
    }


def compiled_checks(got: dict) -> dict:
    out = {}
    for model in COMPILED_MODELS:
        eager, comp = got.get(f"{model} eager"), got.get(f"{model} compiled")
        if not (isinstance(eager, list) and eager and isinstance(comp, list) and comp):
            out[model] = {"failed": {"eager": eager, "compiled": comp}}
            continue
        e, c = by_step(eager, "loss"), by_step(comp, "loss")
        rel = max(abs(c[s] - e[s]) / abs(e[s]) for s in e)
        out[model] = {"max_loss_rel": rel, "ok": rel <= 0.02, "eager": e, "compiled": c}
    return out


def grouped_mm_checks(device: str) -> dict:
    """Each debug MoE model's experts on bf16 tokens routed unevenly (one expert gets none),
    grouped matmul against the loop; returns the largest relative errors."""
    import yaml

    out = {}
    dev = torch.device(device)
    for model in MOE_MODELS:
        shape = yaml.safe_load(configs.options("model")[model].read_text())
        experts, dim, ffn = shape["n_routed_experts"], shape["dim"], shape["moe_ffn_dim"]
        gen = torch.Generator().manual_seed(0)
        counts = torch.randint(1, 64, (experts,), generator=gen)
        counts[1] = 0
        x = torch.randn(int(counts.sum()), dim, generator=gen).to(dev, torch.bfloat16)
        ws = [
            (torch.randn(experts, *s, generator=gen) * dim**-0.5).to(dev, torch.bfloat16)
            for s in ((ffn, dim), (dim, ffn), (ffn, dim))
        ]
        grad = torch.randn(x.shape[0], dim, generator=gen).to(dev, torch.bfloat16)
        reached = moe.expert_kernel(dev.type, torch.bfloat16) is None
        results = []
        for grouped in (True, False, None):  # None: the loop in fp32, the reference
            dtype = torch.float32 if grouped is None else torch.bfloat16
            leaves = [t.detach().to(dtype).requires_grad_() for t in (x, *ws)]
            with nullcontext() if grouped else patch.object(moe, "expert_kernel", looping):
                y = moe.grouped_swiglu(leaves[0], counts.to(dev), *leaves[1:])
                y.backward(grad.to(dtype))
            results.append([y.detach().float(), *(t.grad.float() for t in leaves)])

        grouped, loop, fp32 = results
        errors = rel(EXPERT_GRADIENTS, grouped, fp32)
        out[model] = {
            "grouped_mm_reached": reached,
            "kernels": kernels(device, x, counts, ws) if reached else [],
            "grouped_vs_loop": rel(EXPERT_GRADIENTS, grouped, loop),
            "grouped_vs_fp32": errors,
            "loop_vs_fp32": rel(EXPERT_GRADIENTS, loop, fp32),
            "rows_unaligned": unaligned(x, counts.to(dev), ws, grad, grouped),
            "ok": max(errors.values()) < 2e-2,
        }
    return out


def unaligned(x, counts, ws, grad, aligned: list) -> dict:
    """The grouped kernel with each expert's rows where they fall (align=1) against the
    default (on CUDA, rows aligned to 16 bytes): whether the kernel needs the padding."""

    leaves = [t.detach().requires_grad_() for t in (x, *ws)]
    try:
        y = moe.grouped_swiglu(leaves[0], counts, *leaves[1:], align=1)
        y.backward(grad)
    except RuntimeError as e:
        return {"failed": str(e)[:300]}
    got = [y.detach().float(), *(t.grad.float() for t in leaves)]
    return rel(EXPERT_GRADIENTS, got, aligned)


EXPERT_GRADIENTS = ("out", "dx", "dw1", "dw2", "dw3")
BLOCK_GRADIENTS = ("out", "lse", "dq", "dk", "dv")


def never(*args) -> bool:
    """A stand-in for a "does the fused kernel run" test: the reference form runs instead."""
    return False


def looping(*args) -> str:
    """A stand-in for models.moe.expert_kernel: no grouped kernel, the per-expert loop runs."""
    return "the per-expert loop (check)"


def rel(names: tuple[str, ...], one: list, other: list) -> dict[str, float]:
    """Each tensor's relative error against the reference `other`, by name."""
    return {
        n: float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12))
        for n, a, b in zip(names, one, other, strict=True)
    }


def kernels(device: str, x, counts, ws) -> list[str]:
    """The device kernels one grouped forward launches (that the grouped kernel ran)."""
    from torch.profiler import ProfilerActivity, profile

    if device != "cuda":
        return []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        moe.grouped_swiglu(x, counts.to(x.device), *ws)
        torch.cuda.synchronize()
    return sorted({e.key[:80] for e in prof.key_averages() if e.device_type.name == "CUDA"})


def cp_block_checks(device: str) -> dict:
    """Context parallelism's block kernel (launcher/parallel/context_parallel.py): the fused
    flash kernel, CUDA's in bf16 (CPU's on CPU), against the matmul form, for this rank's own
    block (causal) and another's (unmasked), with GQA and without; one block is the whole
    attention here, so its output and log-sum-exp are the merged ones backward takes."""

    out = {}
    dev = torch.device(device)
    for heads, kv_heads, e in ((8, 2, 128), (4, 4, 64)):
        for own in (True, False):
            gen = torch.Generator().manual_seed(0)
            shapes = ((2, heads, 512, e), (2, kv_heads, 512, e), (2, kv_heads, 512, e))
            q, k, v, do = (
                torch.randn(*s, generator=gen).to(dev, torch.bfloat16) for s in (*shapes, shapes[0])
            )
            mask = torch.ones(512, 512, dtype=torch.bool, device=dev).tril() if own else None
            runs = []
            for fused in (True, False):
                with nullcontext() if fused else patch.object(cp, "_fused", never):
                    reached = cp._fused(q, v, mask, own)
                    o, lse = cp._block_forward(q, k, v, cp.Masking(mask, own))
                    grads = cp._block_backward(
                        q, k, v, do, o.to(q.dtype), lse, cp.Masking(mask, own)
                    )
                runs.append((reached, [o, lse, *grads]))
            errors = rel(BLOCK_GRADIENTS, runs[0][1], runs[1][1])
            name = f"H{heads} K{kv_heads} E{e} {'own' if own else 'other'} block"
            out[name] = {
                "fused_reached": runs[0][0],
                "rel_err": errors,
                "ok": max(errors.values()) < 1e-2,
            }
    return out


def run(device: str, root: Path, timeout: float, log=print) -> dict:
    plan = runs(device)
    source = start("source", plan.pop("source"), root, log)
    started = {name: start(name, o, root, log) for name, o in plan.items()}
    got = finish({"source": source}, root, timeout)
    resumed = [
        *runs(device)["control"],
        f"checkpoint.initial_load_path={source[1] / 'checkpoints' / 'step_00000002'}",
    ]
    started["resumed"] = start("resumed", resumed, root, log)
    log("grouped_mm")
    result = {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu"}
    result["grouped_mm"] = grouped_mm_checks(device)
    result["cp_block"] = cp_block_checks(device)
    got.update(finish(started, root, timeout))
    result.update(rng_checks(got))
    result["compiled_bf16"] = compiled_checks(got)
    return result


def main(argv: list[str] | None = None) -> None:
    import argparse

    p = argparse.ArgumentParser(
        prog="python -m launcher.bench.cuda_paths",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dir", help="where the runs go (default: a new temporary directory)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per training run")
    p.add_argument("--json", help="also write the results to this file")
    args = p.parse_args(argv)
    root = Path(args.dir or tempfile.mkdtemp(prefix="cuda-paths-"))
    root.mkdir(parents=True, exist_ok=True)
    result = run(args.device, root, args.timeout)
    text = json.dumps(result, indent=1, default=str)
    print(text)
    if args.json:
        Path(args.json).write_text(text)


if __name__ == "__main__":
    main()
