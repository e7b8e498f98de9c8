"""Tensor (+ sequence) parallelism for the llama and gpt families (Megatron layout).

Column-parallel Q/K/V and gate/up (fc1) projections, row-parallel output and down (fc2)
projections: each block needs one all-reduce forward and one backward per sublayer. With
sequence parallelism the norms, dropout and residual stream are sharded along the sequence
(Shard(1)) and each all-reduce becomes a reduce-scatter + all-gather of the same volume.
The embedding is vocab-parallel; with loss parallelism the output projection leaves the logits
sharded over the vocabulary and the loss is computed without gathering them.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)


def apply_tp(
    model: nn.Module, mesh: DeviceMesh, family: str, sequence_parallel: bool, loss_parallel: bool
) -> None:
    """Shard `model` in place over the 1-D tp mesh."""
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()  # layout of the residual stream between blocks
    root: dict[str, object] = {}
    if family == "gpt":
        # Token and position embeddings are summed, so the vocab-parallel lookup hands back a
        # replicated tensor and the sum is then cut along the sequence.
        root["embed.tok"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())
        if sp:
            root["embed"] = PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1)
            )
    else:
        root["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)
    if sp:
        root["norm"] = SequenceParallel()
    root["output"] = ColwiseParallel(
        input_layouts=residual,
        output_layouts=Shard(-1) if loss_parallel else Replicate(),
        use_local_output=not loss_parallel,
    )
    parallelize_module(model, mesh, root)
    model.tie_weights()  # tied halves are now the same vocab-sharded DTensor

    for block in model.layers.values():
        plan: dict[str, object] = {
            "attention.wq": ColwiseParallel(),
            "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(),
            "attention.wo": RowwiseParallel(output_layouts=residual),
        }
        # llama's attention takes (x, rope, positions); gpt's takes (x, positions).
        extra = (None, None) if family != "gpt" else (None,)
        if sp:
            plan["attention_norm"] = SequenceParallel()
            plan["ffn_norm"] = SequenceParallel()
            plan["attention"] = PrepareModuleInput(
                input_layouts=(Shard(1), *extra), desired_input_layouts=(Replicate(), *extra)
            )
        up, down = ("fc1", "fc2") if family == "gpt" else ("w1", "w2")
        plan[f"feed_forward.{up}"] = ColwiseParallel()
        plan[f"feed_forward.{down}"] = RowwiseParallel(output_layouts=residual)
        if family != "gpt":
            plan["feed_forward.w3"] = ColwiseParallel()
        if sp:
            plan["feed_forward"] = PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)
            )
        parallelize_module(block, mesh, plan)
