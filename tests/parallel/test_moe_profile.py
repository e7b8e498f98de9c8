"""A profiled training step of an MoE model with 16 experts in bf16_mixed, on one process (autocast
over fp32 weights), under ZeRO-1 (autocast, sharded optimizer) and under FSDP (bf16 parameters):
the experts run as the grouped kernel, no expert stack is indexed per expert (no `select` under
autograd, whose backward copies a whole stack per expert), and the step allocates a stack's
size a bounded number of times per stack, not E times."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from jobs import train_job

from launcher.runtime.profiling import step_dir

pytestmark = pytest.mark.dist

EXPERTS, DIM, FFN, MOE_LAYERS = 16, 128, 256, 4  # mixtral_debug with 16 experts
RUN = (
    "model=mixtral_debug",
    f"model.n_routed_experts={EXPERTS}",
    "precision=bf16_mixed",
    "train.steps=2",
    "train.global_batch_size=4",
    "train.micro_batch_size=2",
    "train.seq_len=64",
    "train.eval_interval=0",
    "logging.wandb.mode=disabled",
    "profile.steps=[2]",
    "profile.memory=true",
)
LAYOUTS = {
    "one process": ["hardware.devices_per_node=1"],
    "zero1 dp=2": ["hardware.devices_per_node=2", "data_parallel=zero1"],
    "fsdp dp=2": ["hardware.devices_per_node=2", "data_parallel=fsdp"],
}
JOBS = {name: train_job([*RUN, *lay], f"moe profile, {name}") for name, lay in LAYOUTS.items()}


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=pytest.mark.jobs(job), id=n) for n, job in JOBS.items()]
)
def test_experts_run_grouped_with_a_bounded_number_of_stack_copies(name, group):
    job = JOBS[name]
    out = step_dir(group.result(job), 2)
    stack = EXPERTS * FFN * DIM  # elements of one expert stack (w1, w2 or w3 of a layer)
    stacks = 3 * MOE_LAYERS
    for rank in range(job.nproc):
        events = json.loads((out / f"rank_{rank}.json").read_text())["traceEvents"]
        ops = Counter(e.get("name") for e in events)
        assert ops["aten::_grouped_mm"] > 0, f"rank {rank}: no grouped kernel"
        selects = [n for n in ops if n and re.search(r"(^|: )SelectBackward\d", n)]
        assert not selects, f"rank {rank}: {selects}"
        # Allocations of a whole stack's bytes, fp32 or bf16 (the cast, the gradients, FSDP's
        # gathered copy, the optimizer's temporaries): a few per stack (measured: up to 4.5
        # per stack and micro-batch, update included), where indexing the stacks per expert
        # made E = 16 more per stack and micro-batch.
        sizes = Counter(
            e["args"]["Bytes"]
            for e in events
            if e.get("name") == "[memory]" and e["args"].get("Bytes", 0) > 0
        )
        copies = sizes[4 * stack] + sizes[2 * stack]
        micro = 4 // (2 * job.nproc)  # global batch 4, micro-batch 2, dp = the processes
        bound = stacks * (4 * micro + 4)  # 4 per stack and micro-batch, 4 for the step's update
        assert copies <= bound, f"rank {rank}: {copies} stack-sized allocations, over {bound}"
        # And the count is of what it says: every stack's gradient at least is one of them (a
        # profile that recorded no allocation, or another size, would pass the bound).
        assert copies >= stacks, f"rank {rank}: {copies} stack-sized allocations, under {stacks}"
