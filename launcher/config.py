"""Typed schema of a run. YAML under conf/ and recipes/ only composes and overrides these.

Every group is a dataclass registered in Hydra's ConfigStore, so an unknown key or a value of the
wrong type is an error at composition time, before any planning or process group.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING

from launcher.models.config import ModelConfig


class DType(str, Enum):
    fp32 = "fp32"
    bf16 = "bf16"
    fp16 = "fp16"


class Float8Scaling(str, Enum):
    """precision.fp8: the block linears' matmuls in float8 (torchao.float8; launcher/parallel/
    float8.py) with one scale per tensor or per row; none keeps them in the compute dtype."""

    none = "none"
    tensorwise = "tensorwise"  # one dynamic scale per tensor (torchao's default recipe)
    rowwise = "rowwise"  # one per row of each operand: finer, a little slower


class DeviceType(str, Enum):
    cpu = "cpu"
    cuda = "cuda"


class ContextMethod(str, Enum):
    allgather = "allgather"  # Llama 3: all-gather K/V, each rank attends with its queries
    ring = "ring"  # ring attention: K/V blocks passed around, overlapped with compute


class Recompute(str, Enum):
    none = "none"
    selective = "selective"  # recompute attention core and element-wise ops, keep matmul inputs
    full = "full"  # keep only each block's input, recompute the block in backward
    op = "op"  # keep block inputs, matmul, attention and reduction outputs; recompute the rest


class OpMatmuls(str, Enum):
    """Under recompute=op, which matmul outputs a block keeps."""

    all = "all"  # every one
    # The 1st, 3rd, 5th, ... in forward order; the others recomputed (torchtitan's op policy:
    # a Llama block keeps q, v, w1, w2 and recomputes k, wo, w3).
    alternate = "alternate"


class AdamWImpl(str, Enum):
    """How torch's AdamW steps the parameters (launcher/training/optim.py). The same update, in
    a different number of kernels: fused is one kernel per group of tensors, foreach a few
    multi-tensor kernels, for_loop a handful per parameter (torch's reference form)."""

    auto = "auto"  # fused on a GPU where the moments are the master weights' dtype; else torch's
    fused = "fused"
    foreach = "foreach"
    for_loop = "for_loop"


class OptimizerName(str, Enum):
    adamw = "adamw"  # AdamW for every parameter (launcher/training/optim.py)
    # Muon for the blocks' weight matrices and expert stacks, AdamW for the embeddings, the
    # output head, norms, biases and routers (launcher/training/muon.py).
    muon = "muon"


class NSDType(str, Enum):
    bf16 = "bf16"
    fp32 = "fp32"


class MuonScale(str, Enum):
    """The learning rate of a Muon matrix's orthogonalised update (A x B)."""

    # lr x 0.2 sqrt(max(A, B)): the update's RMS matches AdamW's, so AdamW's lr and weight
    # decay carry over (Moonlight, Kimi K2).
    match_rms_adamw = "match_rms_adamw"
    original = "original"  # lr x sqrt(max(1, A / B)) (Keller Jordan's Muon)


class LRSchedule(str, Enum):
    """After the linear warmup, from train.lr to train.min_lr at the last step (optim.DECAY)."""

    cosine = "cosine"
    linear = "linear"
    constant = "constant"  # train.lr throughout (min_lr unused)
    wsd = "wsd"  # warmup-stable-decay: train.lr, then linear over the last decay_fraction


class Resume(str, Enum):
    auto = "auto"  # start from the newest complete checkpoint in checkpoint.dir, if any
    never = "never"  # start from step 0 (refused if checkpoint.dir holds checkpoints)


class LoadFormat(str, Enum):
    dcp = "dcp"  # a checkpoint of this launcher (a step_NNNNNNNN directory)
    hf = "hf"  # a Hugging Face model directory: config.json + *.safetensors (weights only)


class PlanFormat(str, Enum):
    text = "text"
    json = "json"


class SelftestFault(str, Enum):
    """A collective launcher.selftest corrupts, to show that its rows catch a broken axis."""

    none = "none"
    all_to_all = "all_to_all"  # expert parallelism's dispatch and combine
    send = "send"  # point to point: the pipeline's activations and gradients, CP's ring


class WandbMode(str, Enum):
    online = "online"
    offline = "offline"
    disabled = "disabled"


@dataclass
class HardwareConfig:
    name: str = "cpu"
    # The device as sold (power, memory type): the part the preset's figures were fitted on.
    part: str = ""
    # What launcher.selftest measured the preset's fitted figures on (when, which world and
    # backend); the plan shows it. Empty: the figures are the preset's own.
    fitted: str = ""
    nodes: int = 1
    devices_per_node: int = 2
    device_type: DeviceType = DeviceType.cpu
    memory_gib: float = 8.0  # per device
    peak_tflops: float = 0.1  # dense peak of the compute dtype, per device
    peak_tflops_fp8: float = 0.0  # dense float8 peak per device; 0: the part has no FP8 units
    intra_node_gbps: float = 100.0  # GB/s per device inside a node
    inter_node_gbps: float = 10.0  # GB/s per device across nodes
    storage_gbps: float = 2.0  # GB/s per node written to the checkpoint storage
    memory_gbps: float = 20.0  # GB/s of the device's own memory (HBM), for memory-bound work
    # The collective model (launcher/plan/comm.py): a collective costs collective_latency_us,
    # plus one hop per step of its algorithm (intra_node_hop_us inside a node,
    # inter_node_hop_us across nodes), plus its bytes over the bandwidth of the level it crosses.
    collective_latency_us: float = 100.0
    intra_node_hop_us: float = 50.0
    inter_node_hop_us: float = 100.0
    # Host time per operator the engine launches (Python, dispatch, kernel launch), per op.
    op_overhead_us: float = 10.0
    # Time per micro-batch outside the kernels and launches counted (the step's loop between
    # micro-batches: the device waits), measured per part and engine: 0, nothing measured.
    microbatch_overhead_us: float = 0.0
    # Fraction of peak_tflops the engine's compute achieves, as measured for the run as
    # configured (compile included), from `python -m launcher.plan.calibrate --from SWEEP_DIR`.
    # 0: the GEMM curve fitted to the Megatron-LM A100 table (EFFICIENCY_MAX x w / (w +
    # EFFICIENCY_DIM) in launcher/plan/kernels.py), times efficiency_scale, times
    # compile_factor under train.compile (docs/planner.md, "Calibration").
    efficiency: float = 0.0
    # The share of that curve the kernels reach on this part, relative to its own peak: 1 is
    # Megatron-LM's on A100; each GPU preset's is fitted to runs on its own part (this engine's
    # where there are some, else torchtitan's: `python -m launcher.plan.calibrate --hopper`).
    efficiency_scale: float = 1.0
    # What compiled blocks' kernels gain over eager ones on this part, beyond the fused
    # memory-bound work and the fewer launches the planner counts (launcher/plan/kernels.py);
    # fitted with efficiency_scale. 1: none (nothing measured compiled on the part).
    compile_factor: float = 1.0
    # Under precision.fp8: the share of the same curve a float8 GEMM reaches relative to
    # peak_tflops_fp8 (torchao's tensorwise kernels; rowwise at kernels.FP8_ROWWISE of it),
    # fitted per part to FP8 runs on it (`python -m launcher.plan.calibrate --hopper`). 1: as
    # the part's bf16 GEMMs (nothing measured in FP8 on the part).
    efficiency_scale_fp8: float = 1.0
    # Fraction of peak_tflops the fused attention core sustains, forward and backward at long
    # sequence, counted as the planner counts it (causal: 3 x seq x heads x (d_qk + d_v) per
    # token and layer), from the kernel's published figures on the part (the presets say
    # which). Not scaled by compile: the kernel is the same compiled or not. 0: as the part's
    # widest GEMM (EFFICIENCY_MAX x efficiency_scale, x compile_factor under train.compile).
    attention_efficiency: float = 0.0


@dataclass
class ParallelConfig:
    """Degrees, one per axis. Their product is the world size."""

    # true: at every start, plan for the world the run actually has (torchrun's or SLURM's,
    # else hardware.*) and train the fastest layout launcher.train runs; a degree set on the
    # command line beside it is kept. The model, batch, sequence and optimizer stay the run's.
    auto: bool = False
    dp_replicate: int = 1
    dp_shard: int = -1  # -1: whatever is left of nodes x devices_per_node
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1


@dataclass
class DataParallelConfig:
    """How the data-parallel axis holds model states (ZeRO stage over the dp_shard group).

    0: DDP (replicated), 1: optimizer states sharded, 2: + gradients sharded (parameters kept
    unsharded between forward and backward), 3: FSDP (parameters sharded too). With
    dp_replicate > 1 the states are replicated across dp_replicate (HSDP for stages 2 and 3).
    """

    name: str = "fsdp"
    zero_stage: int = 3


@dataclass
class TensorConfig:
    sequence_parallel: bool = False  # shard norms and the residual stream over tp too
    loss_parallel: bool = False  # vocab-parallel loss without gathering the logits


@dataclass
class PipelineConfig:
    schedule: str = "1f1b"  # one of layout.SCHEDULES (a string: "1f1b" is no enum name)
    microbatches: int = 0  # per step and pipeline; 0: global batch / (micro x dp)
    stages_per_rank: int = 1  # virtual stages (interleaved: >= 2, V schedules: exactly 2)
    # The split of layers over the pp x stages_per_rank stages. Default: as even as possible,
    # extra layers to the middle stages. first/last_stage_layers fix the ends (0: even) and
    # the rest is split evenly; layers_per_stage gives every stage's count explicitly.
    first_stage_layers: int = 0
    last_stage_layers: int = 0
    layers_per_stage: list[int] = field(default_factory=list)
    # FSDP / ZeRO-2 under a pipeline: torch keeps each stage's parameters gathered and its
    # gradients unreduced from the first micro-batch to the last. true: reshard and
    # reduce-scatter after every micro-batch's backward (less memory, a gather and a
    # reduce-scatter per micro-batch). Schedules with a full backward only.
    reshard_each_microbatch: bool = False


@dataclass
class ContextConfig:
    method: ContextMethod = ContextMethod.allgather
    load_balance: bool = True  # zig-zag chunks so every rank gets the same causal work


@dataclass
class RecomputeConfig:
    mode: Recompute = Recompute.none
    every: int = 1  # recompute blocks 0, k, 2k, ... only (the others keep everything)
    matmuls: OpMatmuls = OpMatmuls.all  # under op: keep all matmul outputs, or alternate ones


@dataclass
class PrecisionConfig:
    name: str = "fp32"
    compute_dtype: DType = DType.fp32  # matmuls and activations
    param_dtype: DType = DType.fp32  # unsharded parameters used by forward/backward
    grad_dtype: DType = DType.fp32  # gradient reduction
    master_dtype: DType = DType.fp32  # the copy the optimizer updates
    optimizer_dtype: DType = DType.fp32  # Adam moments
    # The transformer blocks' linear layers in float8 (embeddings, output head, norms, the
    # router and grouped experts stay in the compute dtype); emulated on CPU.
    fp8: Float8Scaling = Float8Scaling.none


@dataclass
class OptimizerConfig:
    """optimizer=adamw|muon. Both take train.lr (scheduled), train.weight_decay (decoupled)
    and, for AdamW's parameters, train.beta1/beta2; Muon's matrices keep one momentum each,
    in the parameters' dtype."""

    name: OptimizerName = OptimizerName.adamw
    momentum: float = 0.95  # Muon's (Moonlight, Kimi K2 publish 0.95)
    nesterov: bool = True
    ns_steps: int = 5  # Newton-Schulz iterations
    # Their dtype: bf16 as published (torch.optim.Muon's); fp32 for runs compared bit by bit
    # (the parity tests: bf16 rounds two layouts' last-bit gradient differences apart).
    ns_dtype: NSDType = NSDType.bf16
    scale: MuonScale = MuonScale.match_rms_adamw
    # QK-clip's threshold tau (Kimi K2's MuonClip: 100): after each step, a head whose largest
    # attention logit passed it has its query and key weights scaled down to bring it back
    # (launcher/training/qk_clip.py); 0 turns it off. With either optimizer.
    qk_clip: float = 0.0


@dataclass
class TrainConfig:
    steps: int = 200
    seed: int = 0
    global_batch_size: int = 16  # sequences per optimizer step
    micro_batch_size: int = 4  # sequences per forward/backward on one data-parallel rank
    seq_len: int = 128
    lr: float = 3e-3
    warmup_steps: int = 20
    min_lr: float = 3e-4
    lr_schedule: LRSchedule = LRSchedule.cosine
    decay_fraction: float = 0.2  # wsd: the share of the steps after warmup that decays
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 turns clipping off
    adamw: AdamWImpl = AdamWImpl.auto
    eval_interval: int = 50  # 0 turns evaluation off
    eval_batches: int = 4  # global batches of the held-out split per evaluation
    compile: bool = False  # torch.compile each block (inductor; needs a C compiler on CPU)
    # With compile: the loss too (its fp32 cast and log-softmax fused: 2 x the compute dtype per
    # logit at its peak instead of 12 bytes). Off under loss parallelism either way.
    compile_loss: bool = True
    save_final: bool = False  # write DIR/final_model.pt, the gathered full state dict
    # Local launches: torchrun restarts every rank this many times after one fails; each
    # restart resumes from the newest complete checkpoint.
    max_restarts: int = 0
    # A step whose loss or gradient norm is not finite is never applied. 0: the run stops
    # there (exit status 3, naming the step); N: up to N such steps in a row are skipped and
    # logged, the N+1-th stops the run.
    max_skipped_steps: int = 0
    # Seconds a collective (or a stop: the current step plus its checkpoint) may wait for the
    # other ranks before the run fails, naming the rank and what it was doing.
    timeout_s: float = 600.0


@dataclass
class CheckpointConfig:
    """Sharded checkpoints (torch.distributed.checkpoint) in DIR/step_NNNNNNNN."""

    interval: int = 0  # save every N steps; 0: only at the end of the run and on a stop
    dir: str | None = None  # None: RUN_DIR/checkpoints
    keep: int = 3  # newest complete checkpoints kept; 0 keeps all
    async_save: bool = False  # write in the background while training goes on
    resume: Resume = Resume.auto
    # Start from this checkpoint when checkpoint.dir has none (a restart resumes its own).
    initial_load_path: str | None = None
    initial_load_format: LoadFormat = LoadFormat.dcp
    initial_load_weights_only: bool = False  # take the model only (fine-tuning); hf always is


class Attention(str, Enum):
    auto = "auto"  # document for a chat set among the training sources, else causal
    causal = "causal"  # every token sees every earlier one of its sequence
    document = "document"  # ... of its own document: no query sees across an EOS


@dataclass
class SourceConfig:
    path: str = MISSING  # a token file, a directory of token files (shards) or a glob
    weight: float = 1.0  # share of the sampled sequences (the weights are normalised)


@dataclass
class DataConfig:
    # None: the embedded default corpus (Python's documentation, byte-level tokens).
    # Otherwise a token file written by `python -m launcher.prepare`.
    path: str | None = None
    # A weighted blend instead of data.path (launcher/data/sources.py), e.g.
    # 'data.sources=[{path: web/, weight: 0.7}, {path: code/*.bin, weight: 0.3}]'.
    sources: list[SourceConfig] = field(default_factory=list)
    val_fraction: float = 0.05  # tail of each source's stream held out for evaluation
    # Named validation sets, each evaluated at train.eval_interval as eval/<name> (then the
    # held-out tails are not); e.g. 'data.val_sources={wiki: val/wiki.bin}'.
    val_sources: dict[str, str] = field(default_factory=dict)
    attention: Attention = Attention.auto


@dataclass
class WandbConfig:
    mode: WandbMode = WandbMode.online  # online falls back to offline without an API key
    project: str = "llm-launcher"
    entity: str | None = None


@dataclass
class LoggingConfig:
    wandb: WandbConfig = field(default_factory=WandbConfig)
    # Steps between the progress lines that stay (a 200-step run writes 10, with a line at
    # each evaluation and at the end); on a terminal one line also rewrites itself every step.
    log_interval: int = 20
    tensorboard: bool = False  # also TensorBoard event files in RUN_DIR/tensorboard


@dataclass
class LaunchConfig:
    """How the launcher starts a run on several nodes without SLURM: one launcher per node,
    each starting torchrun with a c10d rendezvous."""

    # HOST:PORT where every node's launcher meets, the same on every node. Empty: one node
    # (torchrun --standalone). The launcher on HOST that finds nothing listening there starts
    # the rendezvous store in a process of its own, which outlives any node's torchrun.
    rendezvous: str = ""
    # Elastic: the run goes on with as few as this many of hardware.nodes nodes (with a
    # rendezvous torchrun --nnodes=MIN:MAX: a node that leaves or joins restarts the group;
    # under hydra/launcher=slurm a job of --nodes=MIN-MAX, requeued onto what is free), which
    # re-plans (parallel.auto=true) and resumes from the newest complete checkpoint. 0: all.
    min_nodes: int = 0


@dataclass
class ProfileConfig:
    """torch.profiler on chosen steps: RUN_DIR/profile/step_N/rank_R.json, one Chrome / Perfetto
    trace per rank (chrome://tracing, ui.perfetto.dev)."""

    steps: list[int] = field(default_factory=list)  # e.g. [5, 10]; empty: no profiling
    # Also a memory timeline of those steps: rank_R_memory.json (CPU: the profiler's memory
    # timeline); on CUDA rank_R_memory.pickle, the allocator's snapshot that
    # pytorch.org/memory_viz draws.
    memory: bool = False


@dataclass
class PlanConfig:
    """Options of `python -m launcher.plan`."""

    format: PlanFormat = PlanFormat.text
    dry_run: bool = False  # build the real mesh and sharded meta model over a fake group
    search: bool = False  # enumerate layouts for this model, hardware and batch
    top_k: int = 5
    # plan.search: also rank the layouts the planner models but launcher.train does not run
    # yet (each marked, with the limitation that refuses it).
    planner_only: bool = False
    # k >= 0: train the k-th fastest layout of plan.search that launcher.train runs (0 the
    # fastest) instead of the layout the config describes; sweep it to try the best few:
    # `python -m launcher.train -m "plan.candidate=range(3)" ...`. -1: off.
    candidate: int = -1
    draw: str = ""  # FILE.png/.svg/.pdf: draw the pipeline schedule (ranks x time, bubble shaded)


@dataclass
class SelftestConfig:
    """Options of `python -m launcher.selftest`."""

    steps: int = 3  # optimizer steps of each correctness row and of its one-process reference
    # The rows started within this many seconds of the first run; the others are reported as
    # not run (the budget), never left out silently.
    budget_s: float = 300.0
    # A test switch: this collective's results are corrupted on every rank (the rows that use
    # it must fail, the others pass). none: the engine as it is.
    fault: SelftestFault = SelftestFault.none
    # Only the rows that exercise one of these mesh dimensions (dp_replicate, dp_shard, tp,
    # pp, cp, ep), e.g. [pp,cp]; empty: every row that fits the world.
    axes: list[str] = field(default_factory=list)
    fabric: bool = True  # also time the collectives and fit a preset (false: the rows only)
    # The hardware preset written with the fabric's fitted collective figures: NAME.yaml in
    # the first of the user's config directories' hardware/ (else RUN_DIR/conf/hardware/).
    # Empty: HARDWARE_selftest after the preset the self-test ran on.
    preset: str = ""


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    hardware: HardwareConfig = field(default_factory=HardwareConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    data_parallel: DataParallelConfig = field(default_factory=DataParallelConfig)
    tensor: TensorConfig = field(default_factory=TensorConfig)
    pipeline: PipelineConfig = field(default_factory=PipelineConfig)
    context: ContextConfig = field(default_factory=ContextConfig)
    recompute: RecomputeConfig = field(default_factory=RecomputeConfig)
    precision: PrecisionConfig = field(default_factory=PrecisionConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    data: DataConfig = field(default_factory=DataConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    selftest: SelftestConfig = field(default_factory=SelftestConfig)


def register_configs() -> None:
    """Register the schema; conf/config.yaml names it first in its defaults list. Once per
    process: storing it builds the structured config again (0.05 s, a quarter of a composition)."""
    cs = ConfigStore.instance()
    if "base_config.yaml" not in cs.repo:
        cs.store(name="base_config", node=Config)
