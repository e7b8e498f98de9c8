"""`checkpoint export` and `convert to-hf` stream: a checkpoint whose model is larger than the
exporting process may map (RLIMIT_AS) exports and converts, and round-trips.

The checkpoint holds a llama-shaped model of ~400 MB in fp32, saved as DCP (as a run or
`convert from-hf` saves it); the commands run in a process capped at what it maps after its
imports plus 180 MB (under half the model). Loading the exported file whole under that cap fails
(so the cap is real); the exported file and the Hugging Face files equal the saved model, tensor
for tensor.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import cli_env, compose_config
from safetensors import safe_open

from launcher.checkpoint.store import seal, step_dir
from launcher.hf.names import sources
from launcher.hf.weights import to_hf
from launcher.training.trainer import build_model

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
]

HERE = Path(__file__).resolve().parent
HEADROOM = 180 * 2**20
MODEL = [
    "model=llama3_debug",
    "model.dim=1024",
    "model.n_heads=8",
    "model.n_kv_heads=8",
    "model.ffn_dim=4096",
    "model.n_layers=6",
]


def saved_checkpoint(directory: Path) -> tuple[Path, dict, dict]:
    """A complete weights-only checkpoint of the model; (its path, its state, model config)."""
    import torch.distributed.checkpoint as dcp

    cfg = compose_config(MODEL)
    state = build_model(cfg, seed=3).state_dict()
    model = {k: v for k, v in vars(cfg.model).items()}
    final = step_dir(directory, 0)
    partial = final.with_name(final.name + ".partial")
    dcp.save({"model": state}, checkpoint_id=str(partial), no_dist=True)
    meta = {"step": 0, "samples": 0, "weights_only": True, "layout": {}}
    seal(partial, final, {**meta, "config": {"model": model}})
    return final, state, model


def test_export_and_to_hf_stream_under_a_memory_cap(tmp_path):
    ckpt, state, model = saved_checkpoint(tmp_path / "checkpoints")
    whole = sum(t.numel() * t.element_size() for t in state.values())
    assert whole > 2 * HEADROOM, f"the model ({whole / 2**20:.0f} MiB) must exceed the cap"
    out_pt, out_hf = tmp_path / "model.pt", tmp_path / "hf"
    # One malloc arena, and every allocation of 1 MiB or more its own mapping, unmapped when
    # freed: what the process maps then follows what it holds (with glibc's dynamic threshold,
    # a freed tensor's pages stay in the heap and the next tensors' land beside them).
    malloc = {"MALLOC_ARENA_MAX": "1", "MALLOC_MMAP_THRESHOLD_": str(2**20)}
    env = cli_env({**malloc, "OMP_NUM_THREADS": "1"})
    args = [str(ckpt), str(out_pt), str(out_hf), str(HEADROOM)]
    result = subprocess.run(
        [sys.executable, str(HERE / "limited_export.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    assert outcome == {"export": 0, "to_hf": 0, "whole": "refused"}, outcome
    exported = torch.load(out_pt, weights_only=True)
    assert exported.keys() == state.keys()
    assert all(torch.equal(exported[k], v) for k, v in state.items())
    files = sorted(out_hf.glob("*.safetensors"))
    assert len(files) > 5, "to-hf was to write files of at most 20 MB"
    hf = {}
    for path in files:
        assert path.stat().st_size < 21e6, path
        with safe_open(str(path), framework="pt") as f:
            hf.update({k: f.get_tensor(k) for k in f.keys()})  # noqa: SIM118
    table = sources(model)
    want = {k: v for name in table for k, v in to_hf(state[name], table[name])}
    assert hf.keys() == want.keys()
    assert all(torch.equal(hf[k], v) for k, v in want.items())
