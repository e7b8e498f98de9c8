"""The benchmarks' code at a tiny size, so that it cannot rot (`make bench` and
`python -m launcher.bench.gpu` measure; nothing here is timed)."""

from __future__ import annotations

import json

import pytest
import torch
from rich.console import Console

from launcher import models
from launcher.bench import __main__ as bench
from launcher.bench import gpu
from launcher.bench.peers import bare, engine, hugging_face
from launcher.bench.timing import interleaved, least_disturbed
from launcher.plan.search import with_overrides

TINY = [
    "train.seq_len=32",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.seed=3",
]


def test_bare_loop_does_the_engines_work(tmp_path):
    """The overhead ratio compares like with like: the bare loop's model, batch and first
    update equal the engine's step 1, down to the loss and the updated parameters."""
    step, w, plan = engine(TINY, str(tmp_path))
    assert w.tokens == 4 * 32 and len(w.micro) == 2
    engine_loss = step()
    # Step 1 runs at the warmup learning rate; the bare loop's AdamW takes the one it is given.
    w.train.lr = w.train.lr / w.train.warmup_steps
    bare_step = bare(w)
    bare_loss = bare_step()
    torch.testing.assert_close(bare_loss, engine_loss, rtol=1e-6, atol=0)
    theirs = dict(bare_step.model.named_parameters())
    for name, p in step.model.named_parameters():
        torch.testing.assert_close(theirs[name], p, rtol=1e-6, atol=1e-7, msg=name)


def test_transformers_contender_has_the_same_shape(tmp_path):
    _, w, _ = engine(TINY, str(tmp_path))
    ours = sum(p.numel() for p in models.build(w.model["family"], w.model).parameters())
    step = hugging_face(w)
    assert type(step.model).__name__ == "LlamaForCausalLM"
    assert sum(p.numel() for p in step.model.parameters()) == ours
    first, later = step(), [step() for _ in range(3)][-1]
    assert later < first  # it trains


def test_interleaved_rotates_the_order_and_times_every_step():
    calls = []

    def contender(name):
        def step():
            calls.append(name)
            return torch.zeros(())

        return step

    times = interleaved(
        {n: contender(n) for n in "abc"}, rounds=3, steps=2, warmup=1, device=torch.device("cpu")
    )
    assert calls[:3] == ["a", "b", "c"]  # warm-up
    timed = calls[3:]
    assert timed[0:6] == ["a", "a", "b", "b", "c", "c"]
    assert timed[6:12] == ["b", "b", "c", "c", "a", "a"]
    assert timed[12:18] == ["c", "c", "a", "a", "b", "b"]
    assert all(len(r) == 2 and all(t > 0 for t in r) for rounds in times.values() for r in rounds)
    assert least_disturbed([[3.0, 2.0], [1.5, 4.0]]) == 1.5


def test_cpu_comparison_tables(tmp_path):
    threads = torch.get_num_threads()
    r = bench.cpu_comparison(TINY, rounds=2, steps=1, warmup=1, threads=1, progress=lambda _: 0)
    assert torch.get_num_threads() == threads  # restored
    assert set(r["best"]) == {bench.ENGINE, bench.BARE, bench.AGAIN, bench.HF}
    assert r["overhead"] == r["best"][bench.ENGINE] / r["best"][bench.BARE]
    assert r["noise_floor"] == r["best"][bench.AGAIN] / r["best"][bench.BARE]
    assert r["transformers_ratio"] == r["best"][bench.HF] / r["best"][bench.ENGINE]
    console = Console(record=True, width=120)
    for t in bench.comparison_tables(r):
        console.print(t)
    text = console.export_text()
    assert "engine / bare loop (engine overhead)" in text and "<= 1.03" in text
    assert "transformers / engine" in text and f"{r['overhead']:.3f}" in text
    assert "this run's noise" in text
    json.dumps(r)


def test_gpu_benchmark_runs_on_cpu_at_a_tiny_size(tmp_path):
    overrides = ["model=llama3_debug", "hardware=cpu", "train.compile=false", *TINY]
    r = gpu.run(
        overrides, steps=2, warmup=1, peers=["transformers"], progress=lambda _: 0, profile=True
    )
    # --profile: one more step's kernels, the matmuls named as such (which kernel leads is a
    # timing: attention did, once, on a loaded machine).
    summary, header, *rows = r["profile"].splitlines()
    assert summary.startswith("one step") and "matmul" in summary and "attention" in summary
    assert any(len(x.split()) > 3 and x.split()[3] == "matmul" and "::mm" in x for x in rows)
    # The defaults that were not overridden stay: bf16 autocast on CPU, as on the GPU.
    assert r["dtype"] == "bfloat16" and r["device"] == "cpu" and r["seq_len"] == 32
    assert "model=llama3_2_1b" not in r["overrides"]
    for name in ("engine", "transformers"):
        f = r["contenders"][name]
        assert f["tokens_per_s"] > 0 and f["mfu"] == pytest.approx(
            f["tokens_per_s"] * r["flops_per_token"] / (r["peak_tflops"] * 1e12)
        )
    assert r["planner"]["memory_gib"] > r["planner"]["memory_without_reserve_gib"] > 0
    console = Console(record=True, width=160)
    console.print(gpu.table(r))
    text = console.export_text()
    assert "planner (engine's layout)" in text and "n/a (cpu)" in text
    json.dumps(r)


def test_gpu_benchmark_gpt_workload_at_a_tiny_size(tmp_path):
    """The GPT workload keeps its keys (8 micro-batches of 2, attention as published) under a
    tiny model; torchtitan has no GPT, so its peer is a row that says so."""
    tiny = ["model=gpt_debug", "hardware=cpu", "train.compile=false", "train.seq_len=32"]
    r = gpu.run(
        tiny, steps=1, warmup=0, peers=["torchtitan"], progress=lambda _: 0, workload="gpt_1_7b"
    )
    assert r["workload"] == "gpt_1_7b" and r["model"] == "gpt_debug"
    assert r["micro_batches"] == 8 and r["tokens_per_step"] == 16 * 32
    assert r["contenders"]["engine"]["tokens_per_s"] > 0
    assert "failed" in r["contenders"]["torchtitan"] or "skipped" in r["contenders"]["torchtitan"]


def test_gpu_benchmark_merges_overrides_and_refuses_unknown_peers(capsys):
    assert with_overrides(["a=1", "b=2"], ["b=3", "c=4"]) == ["a=1", "b=3", "c=4"]
    with pytest.raises(SystemExit) as e:
        gpu.main(["--peers", "megatron"])
    assert e.value.code == 2
    assert "unknown megatron" in capsys.readouterr().err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["model=llama3_debug", "hardware=cpu", "parallel.tp=3"], "tp=3"),
        (["model=llama3_debug", "hardware=cpu", "train.sq_len=64"], "train.sq_len"),
    ],
)
def test_bad_config_exits_2_naming_it(argv, message, capsys):
    for main in (gpu.main, bench.main):
        with pytest.raises(SystemExit) as e:
            main([*argv, "--peers", ""] if main is gpu.main else argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error:") and message in err and "Traceback" not in err


def test_prepare_comparison_runs_both_on_the_same_files(monkeypatch):
    """The prepare table's two contenders, on a small corpus, one round (timed by make bench)."""
    from launcher.bench import prepare_speed as prepare

    monkeypatch.setattr(prepare, "TARGET_BYTES", 1 << 20)
    monkeypatch.setattr(prepare, "FILES", 2)
    r = prepare.prepare_throughput(workers=2, rounds=1, progress=lambda *_: None)
    assert r["bytes"] > 500_000 and set(r["seconds"]) == {"library", "prepare"}
    assert r["ratio"] == r["seconds"]["library"] / r["seconds"]["prepare"] > 0


def test_calibrate_refits_from_the_benchmarks_json(tmp_path, capsys):
    """`launcher.bench.gpu --json` files are runs `calibrate --from DIR` refits from (how the
    h200 preset's measured runs in docs/measured are read)."""
    from launcher.plan import calibrate

    overrides = ["model=llama3_debug", "hardware=cpu", "train.compile=false", *TINY]
    r = gpu.run(overrides, steps=2, warmup=1, peers=[], progress=lambda _: 0)
    (tmp_path / "tiny.json").write_text(json.dumps(r))
    (tmp_path / "other.json").write_text(json.dumps({"device": "not a benchmark"}))
    (tmp_path / "broken.json").write_text("{not json")
    calibrate.main(["--from", str(tmp_path)])
    out = capsys.readouterr().out
    assert "1 measured run(s)" in out and "tiny" in out
    after = float(out.split("before, ")[1].split("%")[0])
    assert after < 1.0  # one run, one constant: the refit lands on it


def test_cuda_paths_checks_judge_what_they_are_given():
    """The CUDA-path checks (launcher.bench.cuda_paths) on CPU: the grouped experts against the
    loop and fp32, and the resume verdicts on metrics that agree or differ."""
    from launcher.bench import cuda_paths

    for model, r in cuda_paths.grouped_mm_checks("cpu").items():
        assert r["grouped_mm_reached"] and r["ok"], model
        assert 0 < max(r["grouped_vs_fp32"].values()) < 2e-2  # bf16's rounding, seen
    for name, r in cuda_paths.cp_block_checks("cpu").items():  # CPU's flash kernel here
        assert r["fused_reached"] and r["ok"], name
        assert max(r["rel_err"].values()) > 0  # two kernels, bf16: not the same computation
    rows = [{"step": s, "loss": 5.0 - s, "grad_norm": 1.0, "peak_memory_gib": 0.1} for s in (1, 2)]
    rows += [{"step": s, "loss": 5.0 - s, "grad_norm": 1.0, "peak_memory_gib": 0.1} for s in (3, 4)]
    resumed = [dict(r) for r in rows[2:]]
    got = {"source": rows, "control": rows, "recompute": rows, "resumed": resumed}
    verdict = cuda_paths.rng_checks(got)
    assert verdict["rng_resume"]["bitwise"] and verdict["recompute_dropout"]["loss_equal"]
    resumed[0]["loss"] += 1e-6  # another dropout mask at step 3
    verdict = cuda_paths.rng_checks(got)
    assert not verdict["rng_resume"]["step3_loss_equal"] and not verdict["rng_resume"]["bitwise"]
