"""The recipe: one typed description of a run, from a laptop smoke test to a SLURM cluster.

Every section is a pydantic model that rejects unknown keys, coerces and checks types, and
checks ranges that need no other field. Rules that relate fields of different sections (heads
divisible by tp, d <= m <= sequence length, ...) live in `validation.py`, where the recipe is
seen whole. The same recipe means the same thing under both engines; only `engine` picks which
one runs it, and only `launch` says where.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
)

from setdiff_megatron.core.masked_diffusion import masked_decoding_policy
from setdiff_megatron.core.orders import Block, OrderError, OrderPolicy, Staggered, make_order_policy
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.lora import TARGETS, LoraSpec
from setdiff_megatron.recipes.decoding import DecodingSection, given
from setdiff_megatron.sampling.decoding import DecodingConfig

__all__ = [
    "BUILTIN_CORPORA",
    "Recipe",
    "ModelSection",
    "LoraSection",
    "MethodSection",
    "DatasetSpec",
    "SupervisedSection",
    "DataSection",
    "ParallelSection",
    "TrainSection",
    "CheckpointSection",
    "EvalSection",
    "WandbSection",
    "LogSection",
    "SlurmSection",
    "LaunchSection",
    "RLSection",
]


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_assignment=True)


class LoraSection(Section):
    """LoRA (models/lora.py, docs/recipes.md "LoRA"): low-rank adapters on the frozen weights of
    model.init_from, W = W0 + (alpha / rank) B @ A. Only the adapters are trained and saved; a
    checkpoint is read (sampling, evaluation, serving, export, init_from) with them merged."""

    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    """The adapters' term is scaled by alpha / rank."""
    targets: list[Literal[TARGETS]] = Field(default_factory=lambda: list(TARGETS))
    """Which linear layers of every transformer layer are adapted: qkv (one adapter on the fused
    query, key and value projection), attention_output, mlp_input (gate and up), mlp_output."""

    @field_validator("targets")
    @classmethod
    def _targets_named_once(cls, value: list[str]) -> list[str]:
        if not value or len(set(value)) != len(value):
            raise ValueError(f"name each of {', '.join(TARGETS)} at most once, and at least one")
        return value

    def spec(self) -> LoraSpec:
        return LoraSpec(self.rank, self.alpha, tuple(self.targets))


@dataclass(kw_only=True)
class ModelSection(ModelConfig):
    """The model config of `models/config.py`, plus how to build and initialise it."""

    backend: Literal["local", "te"] = "local"
    """Layers of the megatron body: plain PyTorch ('local') or Transformer Engine ('te', GPU only)."""
    init_from: str | None = None
    """A checkpoint to start from (a Hugging Face directory once imports land); None: random init."""
    lora: LoraSection | None = None
    """Set to train LoRA adapters on the frozen init_from weights instead of every weight."""

    def to_model_config(self, *, vocab_size: int, mask_token_id: int) -> ModelConfig:
        values = {f.name: getattr(self, f.name) for f in fields(ModelConfig)}
        values["vocab_size"] = self.vocab_size or vocab_size
        values["mask_token_id"] = self.mask_token_id if self.mask_token_id is not None else mask_token_id
        return ModelConfig(**values).resolved()


class MethodSection(Section):
    """The model family, its order policy or noise, and the loss (docs/method.md, "Order policies",
    "Loss" and "The baselines")."""

    family: Literal["set_diffusion", "mdlm", "bd3lm"] = "set_diffusion"
    """'set_diffusion' (this project's method, under `order`); the paper's baselines as the
    reference trains them: 'mdlm' (masked diffusion, one noise level per row, bidirectional) or
    'bd3lm' (block diffusion over blocks of `block_size`, x0 (+) xt). `order`, d, m, k and b are
    set diffusion's: the baselines ignore them."""
    order: Literal["staggered", "left_to_right", "uniform", "block"] = "staggered"
    d: PositiveInt = 4
    """Desired set size of the staggered schedule; d = 1 is autoregression."""
    m: PositiveInt | None = None
    """Maximum set size; None means 2 * d. d = m = seq_len gives a uniform order."""
    k: PositiveFloat | None = None
    """Override of the Beta(1, k) shape (exclusive with b); None derives it from d and m."""
    b: PositiveFloat | None = None
    """Override of the window width (exclusive with k)."""
    block_size: PositiveInt | None = None
    """Block size of set diffusion's 'block' order, or of BD3-LM's blocks (family bd3lm)."""
    noise: Literal["linear"] = "linear"
    """The masked-diffusion noise schedule (mdlm, bd3lm): alpha_t = 1 - t, the one every recipe
    of the reference trains with."""
    antithetic: bool = False
    """Masked diffusion: the noise levels of the global batch's rows drawn from one stratified
    draw (the reference's LM1B BD3-LM); off elsewhere, as the reference."""
    keep_clean_bos: bool = False
    """Pin a BOS at position 0 first in every order and leave it out of the loss."""

    @property
    def masked_diffusion(self) -> bool:
        return self.family != "set_diffusion"

    def order_policy(self) -> OrderPolicy:
        """The order law this section names; core/orders.py checks its rules (OrderError)."""
        if self.masked_diffusion:
            raise OrderError("family", f"the {self.family} family has no generation order; it trains on noise levels")
        if self.order == "staggered":
            return Staggered(d=self.d, m=self.m, k=self.k, b=self.b)
        if self.order == "block":
            if self.block_size is None:
                raise OrderError("block_size", "the block order needs a block size")
            return Block(size=self.block_size)
        return make_order_policy(self.order)

    def decoding_policy(self) -> dict:
        """The paper's default decoding settings for a model of this section (core/orders.py and
        core/masked_diffusion.py `decoding_policy`)."""
        if self.masked_diffusion:
            return masked_decoding_policy(self.block_size if self.family == "bd3lm" else None)
        return self.order_policy().decoding_policy()


BUILTIN_CORPORA = ("stdlib", "reasoning", "reasoning-chains")
"""Dataset paths that name a corpus every machine builds itself (data/builtin.py)."""
SUPERVISED_CORPORA = ("reasoning",)
"""The built-in corpora that also hold supervised records."""


class DatasetSpec(Section):
    path: str
    """Prefix of a megatron indexed dataset (without .bin/.idx), or a built-in corpus: 'stdlib'
    (the Python standard library's sources), 'reasoning' (generated multi-step arithmetic) or
    'reasoning-chains' (its + and - solutions without the expression line, for infilling)."""
    weight: PositiveFloat = 1.0
    format: Literal["pretraining", "supervised"] = "pretraining"
    """'pretraining': documents packed into windows; 'supervised': prompt/response records
    (`setdiff preprocess --supervised`; the 'reasoning' corpus has both), the prompt pinned as
    clean context and only the response (plus EOS) in the loss. Every entry of a blend has the
    same format."""


class SupervisedSection(Section):
    """How supervised records fill the rows of data.seq_len (data/supervised.py)."""

    layout: Literal["padded", "packed"] = "padded"
    """'padded': one record per row, padded to data.seq_len (the reference's format); 'packed':
    consecutive records share a row, each attended to, positioned and ordered as if alone, and
    padding only at the row's end."""
    max_prompt_tokens: PositiveInt | None = None
    """Keep the first tokens of a longer prompt (BOS and a prompt EOS count); None: whole prompts,
    and one that leaves no room for a response is an error."""
    max_response_tokens: PositiveInt | None = None
    """Keep the first tokens of a longer response (its EOS counts); responses are also cut to the
    room the row leaves, and the cut ones are counted at start-up."""
    force_eos: bool = False
    """A cut response still ends with EOS (the reference's CNN/DailyMail targets), so the model
    learns to stop within the length; otherwise it is simply cut."""
    prompt_eos: bool = False
    """End every prompt with EOS (the reference's CNN/DailyMail source: BOS + article + EOS)."""


class DataSection(Section):
    datasets: list[DatasetSpec] = Field(default_factory=lambda: [DatasetSpec(path="stdlib")])
    """Blended training datasets; weights are normalised."""
    tokenizer: str | None = None
    """A tokenizer directory; None trains a byte-level BPE on the built-in corpus."""
    vocab_size: PositiveInt = 4096
    """Vocabulary of the BPE trained when `tokenizer` is None."""
    seq_len: PositiveInt = 256
    """Training sequence length L (the model sees 2L tokens)."""
    supervised: SupervisedSection = Field(default_factory=SupervisedSection)
    """Rows of supervised datasets (format: supervised); unused by pretraining data."""
    document_mask: bool = False
    """Keep attention within documents: a packed window holds several (each ends with the
    tokenizer's EOD token), and by default every token attends across their boundaries. The
    order still runs over the whole window."""
    split: str = "969,30,1"
    """Train/valid/test proportions, megatron style."""
    cache_dir: str | None = None
    """Where sample indices and prepared corpora go; None: <checkpoint.dir>/data."""
    num_workers: NonNegativeInt = 0


class ParallelSection(Section):
    tp: PositiveInt = 1
    """Tensor-parallel size."""
    pp: PositiveInt = 1
    """Pipeline-parallel size."""
    vpp: PositiveInt | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None: plain 1F1B."""
    cp: PositiveInt = 1
    """Context-parallel size (megatron engine): each sequence's two streams split over cp ranks in
    zigzag chunks, set-causal ring attention between them; data.seq_len must divide by 2 x cp."""
    ep: PositiveInt = 1
    """Expert-parallel size (megatron engine, MoE models): each MoE layer's experts are spread over
    ep ranks carved out of the data-parallel ones, tokens exchanged by all-to-all."""
    sequence_parallel: bool = False
    micro_batch_size: PositiveInt = 4
    global_batch_size: PositiveInt = 8
    distributed_optimizer: bool = False
    """Shard optimizer state over data-parallel ranks (megatron); ZeRO-1 in DeepSpeed terms."""
    zero_stage: Literal[0, 1, 2, 3] = 0
    """DeepSpeed ZeRO stage; ignored by the megatron engine."""
    offload_optimizer: bool = False
    """DeepSpeed: keep the optimizer state (fp32 master weights, Adam moments, fp32 gradients) in
    host memory and step it on the CPU; needs zero_stage >= 1."""


class SpikePolicy(Section):
    """A loss more than `threshold` robust deviations above the median of the last `window`
    losses (training/spikes.py) is a spike. `warn` logs it; `skip` drops the step's update;
    `rollback` reloads the newest checkpoint and goes on with the data after the spike's batch,
    and a spike again before the run is past the step that caused a rollback stops the run."""

    action: Literal["warn", "skip", "rollback"] = "warn"
    window: PositiveInt = 100
    threshold: PositiveFloat = 6.0
    min_history: PositiveInt = 20
    """Losses seen before any is judged."""
    max_rollbacks: PositiveInt = 3
    """Rollbacks in one run before a spike stops it; the data has this many checkpoint intervals of
    spare samples."""


class TrainSection(Section):
    steps: PositiveInt | None = 1000
    """Optimizer steps; exactly one of steps and tokens is set."""
    tokens: PositiveInt | None = None
    """Training tokens, converted to steps with the global batch and sequence length."""
    optimizer: Literal["adamw", "decoupled_adamw", "sgd"] = "adamw"
    """'adamw': megatron-core's Adam, whose weights shrink by lr_t x weight_decay a step, norms and
    biases undecayed; 'decoupled_adamw': composer's DecoupledAdamW (the reference's), whose weights
    shrink by (lr_t / lr) x weight_decay a step, every parameter decayed (docs/training.md)."""
    lr: PositiveFloat = 3e-4
    min_lr: NonNegativeFloat = 0.0
    betas: tuple[float, float] = (0.9, 0.98)
    eps: PositiveFloat = 1e-8
    weight_decay: NonNegativeFloat = 0.0
    loss_normalization: Literal["per_token", "per_row"] = "per_token"
    """'per_token': the global batch's summed NLL over its target tokens (megatron's); 'per_row':
    each row's NLL over its own target tokens, then the mean over the global batch's rows (the
    reference's; a packed supervised row counts each record as a row). Validation follows it."""
    ema_decay: float | None = None
    """An exponential moving average of the weights, updated after every optimizer step with this
    decay (the reference's 0.9999), kept in checkpoints and used for validation, sampling and
    export; None or 0: no average."""
    schedule: Literal["cosine", "constant", "linear", "wsd"] = "cosine"
    warmup_steps: NonNegativeInt = 100
    decay_fraction: float = Field(default=0.2, gt=0.0, le=1.0)
    """WSD: the fraction of steps spent decaying at the end."""
    clip_grad: NonNegativeFloat = 1.0
    """Global gradient-norm clip; 0 disables it."""
    precision: Literal["fp32", "bf16", "fp16"] = "bf16"
    fp8: Literal["e4m3", "hybrid"] | None = None
    """FP8 GEMMs through Transformer Engine (GPU, backend 'te'): every linear layer's tokens per
    rank must be a multiple of 8 (recipe validation says which sizes to change)."""
    fp8_recipe: Literal["delayed", "tensorwise"] = "delayed"
    fp8_dot_product_attention: bool = False
    """Set-causal attention in FP8 too (megatron-core's fp8_dot_product_attention, TE's fp8_dpa;
    off as there): with fp8_recipe 'delayed' and model.attention_impl 'te' (or 'auto' where it
    picks TE), on sm90 at head dim 128 (sm100+: head dim <= 128; elsewhere an error under 'te',
    BF16 under 'auto')."""
    seed: NonNegativeInt = 1234
    recompute: Literal["none", "selective", "full"] = "none"
    compile: bool = False
    """torch.compile the model (deepspeed engine), after a compilation of a minute or more at
    start; the losses are those of eager mode. On a 2-core CPU it did not pay for this model
    (`python -m benchmarks.train_throughput --compile`, benchmarks/PERFORMANCE.md): it is there
    for GPUs, where fusing the norms, rotary and SwiGLU saves memory traffic. Parameter names,
    and so checkpoints, do not change."""
    nan_policy: Literal["stop", "skip"] = "stop"
    """On a NaN/Inf loss: stop the run, or skip the step and report it."""
    spike_policy: SpikePolicy = Field(default_factory=SpikePolicy)
    hang_timeout_s: NonNegativeFloat = 1800.0
    """A rank whose training step makes no progress for this long logs where it is stuck and exits
    with code 76, on which torchrun restarts the job (launch.max_restarts). The other phases have
    their own timeouts below, by default scaled from this one; 0 leaves steps unwatched, and every
    phase whose own key is unset (training/watchdog.py)."""
    save_timeout_s: NonNegativeFloat | None = None
    """The same for a checkpoint save (a synchronous one, or the part of a background one the loop
    waits for) and a spike rollback's reload; unset: 4 x hang_timeout_s. 0: unwatched."""
    eval_timeout_s: NonNegativeFloat | None = None
    """The same for an evaluation; unset: hang_timeout_s x eval.batches (each a global batch, a
    step's micro-batches run forward only). 0: unwatched."""
    startup_timeout_s: NonNegativeFloat | None = None
    """The same for the start-up (process groups, data, model build, resume) and the first step
    after it (warm-up, compilation, first collectives); unset: 4 x hang_timeout_s. 0: unwatched."""
    straggler_factor: NonNegativeFloat = 1.5
    """At each log step, one line names a rank whose own compute time (forward-backward less its
    waits in the gradient and loss reductions) is this many times the other ranks' median or more; 0
    turns the warning off (the per-rank times are logged regardless)."""

    @field_validator("ema_decay")
    @classmethod
    def _ema_decay_in_range(cls, value: float | None) -> float | None:
        if value is not None and value != 0 and not 0 < value < 1:
            raise ValueError("the EMA decay must be in (0, 1), e.g. 0.9999; 0 or null turns the EMA off")
        return value or None

    @property
    def ema(self) -> bool:
        return self.ema_decay is not None


class CheckpointSection(Section):
    dir: str = "runs/default"
    """Checkpoints, logs and the resolved recipe go here."""
    interval: PositiveInt = 1000
    keep_last_n: PositiveInt | None = 3
    keep_every_n_steps: PositiveInt | None = None
    resume: str = "auto"
    """'auto' (newest valid checkpoint, if any), 'none', or a checkpoint path."""
    allow_model_change: bool = False
    """Resume from a checkpoint whose model config differs from the recipe's (e.g. another
    attention_impl); refused by default."""
    async_save: bool = False
    """Write checkpoints in the background while training goes on (megatron engine: megatron-core's
    async dist_checkpointing). At most one save is in flight; it is published (manifest, atomic
    rename, `latest`) only once every rank's files are on disk, so a crash at any moment leaves
    the newest complete checkpoint resumable."""


class EvalSection(Section):
    interval: PositiveInt = 200
    batches: PositiveInt = 8
    """The validation set: this many global batches of held-out samples, the same samples with the
    same orders and noise under every layout, engine and micro-batch size."""
    showcase_problems: NonNegativeInt = 250
    """Held-out problems `setdiff train` decodes at the end of a run on the built-in reasoning corpus
    for its accuracy line (evaluation/showcase.py); 250 give about +-3 points. 0: no accuracy line."""


class WandbSection(Section):
    project: str = "setdiff-megatron"
    entity: str | None = None
    mode: Literal["offline", "online", "disabled"] = "offline"


class LogSection(Section):
    interval: PositiveInt = 10
    console: bool = True
    tensorboard: bool = True
    wandb: WandbSection | None = None
    """Set to log to Weights & Biases (offline by default)."""


class SlurmSection(Section):
    """How `setdiff launch RECIPE --slurm` submits the run. Settings a recipe leaves unset come
    from the cluster file (slurm/README.md), so a recipe names no partition and still runs
    unchanged on another cluster."""

    partition: str | None = None
    account: str | None = None
    time: str | None = None
    """Time limit (sbatch --time), e.g. '48:00:00'; None: the cluster file's, else 01:00:00."""
    qos: str | None = None
    setup: list[str] = Field(default_factory=list)
    """Lines run before the job starts (module loads, container activation); after the cluster file's."""
    cluster_file: str | None = None
    """A YAML file with cluster-specific settings, so recipes stay portable. None: $SETDIFF_CLUSTER_FILE,
    else ~/.config/setdiff/cluster.yaml if it exists."""
    launcher: Literal["srun", "torchrun"] = "srun"
    """'srun': SLURM starts every process (one task per GPU or CPU process); 'torchrun': one task
    per node runs torchrun, which starts that node's processes."""
    cpus_per_task: PositiveInt | None = None
    """CPU cores per srun task; None: the cluster file's, else SLURM's default."""
    requeue: bool = True
    """Requeue the job when training stops with exit code 75 (it checkpointed on SIGUSR1/SIGTERM)."""
    signal_lead_s: PositiveInt = 300
    """Seconds before the time limit at which the job gets SIGUSR1 to checkpoint and requeue."""
    sbatch_args: list[str] = Field(default_factory=list)
    """More sbatch options, e.g. ['--exclusive', '--constraint=h100']; after the cluster file's."""
    srun_args: list[str] = Field(default_factory=list)
    """More srun options for the training step (e.g. a pyxis --container-image); after the cluster file's."""
    log_dir: str | None = None
    """Where the job's output goes; None: <checkpoint.dir>/slurm, beside the rendered script."""


class LaunchSection(Section):
    nnodes: PositiveInt = 1
    nproc_per_node: PositiveInt = 1
    """Processes per node: GPUs per node on GPU machines, CPU processes otherwise."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """'cpu' runs on CPUs over gloo even where GPUs exist (a SLURM job then asks for no GPUs);
    'auto' under SLURM means cuda unless the cluster file says gpus_per_node: 0."""
    env: dict[str, str] = Field(default_factory=dict)
    max_restarts: NonNegativeInt = 0
    """torchrun restarts of the whole job after a process dies or the hang watchdog ends it; the
    restarted processes resume from the newest complete checkpoint (checkpoint.resume: auto)."""
    check_memory: bool = True
    """On GPUs, a run whose plan (`setdiff plan`, docs/scaling.md; either engine) does not fit
    the device's memory is refused before any process starts; false launches it anyway."""
    slurm: SlurmSection = Field(default_factory=SlurmSection)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


class RLSection(Section):
    """Reinforcement learning from the model's own decodes: GRPO with exact trajectory
    likelihoods (docs/rl.md). Each step samples `group_size` completions of `prompts_per_step`
    supervised prompts with the cached sampler under the model's decoding policy at `temperature`,
    scores them, and takes `epochs` clipped-ratio steps on them against a frozen copy of the
    starting weights."""

    group_size: PositiveInt = 4
    """Completions a prompt (G); their rewards are normalised within the group."""
    prompts_per_step: PositiveInt = 8
    """Prompts of a step, over all data-parallel ranks: parallel.global_batch_size must be
    prompts_per_step x group_size (the completions of a step)."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature of the rollouts (and of the log-probabilities in the ratio)."""
    max_new_tokens: PositiveInt = 64
    reward: str = "gsm8k"
    """'gsm8k': 1 when the completion's final answer (#### answer) equals the record's, else 0;
    or 'module:function', called with the record (prompt and reference text) and the completion's
    text, returning a float."""
    step_reward: NonNegativeFloat = 0.0
    """Added reward per token decoded per step above one: a push towards fewer decode steps."""
    kl_coef: NonNegativeFloat = 0.02
    """beta of the KL penalty to the reference (k3 estimator, per token)."""
    clip: PositiveFloat = 0.2
    """epsilon of the clipped ratio."""
    epochs: PositiveInt = 1
    """Optimizer steps on each step's rollouts (train.steps counts rollout steps)."""
    likelihood: Literal["exact", "one_step"] = "exact"
    """'exact': each token's log-probability as the decode step that committed it saw it (the
    replay of sampling/trajectory.py); 'one_step': diffu-GRPO's estimate, every completion token
    from the prompt alone (for comparison)."""


class Recipe(Section):
    name: str = "unnamed"
    description: str = ""
    engine: Literal["megatron", "deepspeed"] = "megatron"
    model: ModelSection = Field(default_factory=ModelSection)
    method: MethodSection = Field(default_factory=MethodSection)
    data: DataSection = Field(default_factory=DataSection)
    parallel: ParallelSection = Field(default_factory=ParallelSection)
    train: TrainSection = Field(default_factory=TrainSection)
    checkpoint: CheckpointSection = Field(default_factory=CheckpointSection)
    eval: EvalSection = Field(default_factory=EvalSection)
    log: LogSection = Field(default_factory=LogSection)
    launch: LaunchSection = Field(default_factory=LaunchSection)
    rl: RLSection | None = None
    """Set to train by reinforcement learning from the model's decodes instead of its data's
    targets (docs/rl.md)."""
    decoding: DecodingSection = Field(default_factory=DecodingSection)
    """How the trained model decodes where it departs from its order's paper default (a window of
    d at threshold 0.9 for the staggered schedule, one token per step for AR, its blocks for a
    block order): every door (sample, eval, serve, lm-eval, the HF export) starts from it."""

    def decoding_policy(self) -> DecodingConfig:
        """The model's own decoding policy: its order's paper default, with `decoding` over it."""
        return DecodingConfig(**{**self.method.decoding_policy(), **given(self.decoding)})
