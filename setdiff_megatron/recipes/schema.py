"""The recipe: one typed description of a run, from a laptop smoke test to a SLURM cluster.

Every section is a pydantic model that rejects unknown keys, coerces and checks types, and
checks ranges that need no other field. A section's rules against the rest of the recipe (heads
divisible by tp, d <= m <= sequence length, ...) are its `rules` methods, next to its fields, and
what `engine` asks of the sections is `Recipe.engine_rules`; `validation.py` runs them all, with
the rules against the machine and the files. The same recipe means the same thing under both
engines; only `engine` picks which one runs it, and only `launch` says where.
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
from setdiff_megatron.core.orders import Block, OrderError, OrderPolicy, PaperDecoding, Staggered, make_order_policy
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.lora import TARGETS, LoraSpec
from setdiff_megatron.models.weight_maps.megatron_map import check_backend
from setdiff_megatron.recipes.decoding_settings import DecodingSection, settings_given
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

    def rules(self, r: Recipe) -> list[str]:
        """A base to adapt, and the layouts where an adapter is exact.

        Dense layers, whole linears (no TP split of B, no Transformer Engine norm fused into the
        linear), all layers on one stage (adapters are drawn layer by layer from one seed), and
        weights that are not partitioned (ZeRO-3)."""
        m, p = r.model, r.parallel
        errors = []
        if not m.init_from:
            errors.append("model.lora: adapters train on a base model: set model.init_from")
        if m.num_experts:
            errors.append(
                "model.lora: adapters go on dense layers; a mixture of experts (model.num_experts) is not supported"
            )
        if r.engine == "megatron" and (p.tp > 1 or p.pp > 1):
            errors.append(
                "model.lora: the megatron engine adapts whole layers on one stage: set parallel.tp = 1 and pp = 1"
            )
        if r.engine == "megatron" and m.backend == "te":
            errors.append(
                "model.lora: Transformer Engine fuses the norm into the adapted linears: set model.backend local"
            )
        if r.engine == "deepspeed" and p.zero_stage == 3:
            errors.append(
                "model.lora: ZeRO-3 partitions the frozen weights the adapters read: set parallel.zero_stage <= 2"
            )
        if r.train.ema:
            errors.append("model.lora: no average of the weights is kept for adapters: remove train.ema_decay")
        return errors


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

    def backend_rules(self) -> list[str]:
        """The body's layers (`backend`) can build this model."""
        try:
            check_backend(self, self.backend)
        except ValueError as exc:
            return [f"model.backend: {exc}"]
        return []


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

    def decoding_policy(self) -> PaperDecoding:
        """The paper's default decoding for a model of this section (core/orders.py `PaperDecoding`)."""
        if self.masked_diffusion:
            return masked_decoding_policy(self.block_size if self.family == "bd3lm" else None)
        return self.order_policy().decoding_policy()

    def rules(self, r: Recipe) -> list[str]:
        """The order law's own rules against data.seq_len, and the decoding policy it yields."""
        seq_len = r.data.seq_len
        if self.masked_diffusion:
            errors = self._masked_diffusion_rules(r)
        else:
            errors = []
            try:
                policy = self.order_policy()
                if isinstance(policy, Staggered):
                    policy.schedule(seq_len)
            except OrderError as exc:
                errors.append(f"method.{exc.field}: {exc}")
        if not errors:
            try:
                r.decoding_policy()
            except ValueError as exc:
                errors.append(f"decoding: {exc}")
        if self.order == "block" and self.block_size is not None and self.block_size > seq_len:
            errors.append(f"method.block_size: {self.block_size} exceeds data.seq_len ({seq_len})")
        return errors

    def _masked_diffusion_rules(self, r: Recipe) -> list[str]:
        """What MDLM and BD3-LM need: BD3-LM blocks that tile the sequence, none for MDLM, no context
        parallelism and no document mask."""
        seq_len, family = r.data.seq_len, self.family
        errors = []
        if family == "bd3lm" and self.block_size is None:
            errors.append("method.block_size: family bd3lm needs its block size (the reference trains 4, 8 or 16)")
        elif family == "bd3lm" and seq_len % self.block_size:
            errors.append(
                f"method.block_size: {self.block_size} does not divide data.seq_len ({seq_len}); BD3-LM's blocks "
                "tile the sequence"
            )
        if family == "mdlm" and self.block_size is not None:
            errors.append("method.block_size: MDLM is one block of data.seq_len; remove it (family bd3lm has blocks)")
        if r.parallel.cp > 1:
            errors.append(f"parallel.cp: family {family} runs without context parallelism; set cp = 1")
        if r.data.document_mask:
            errors.append(
                f"data.document_mask: family {family} attends across a packed window, as the reference; remove it"
            )
        return errors


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

    def seq_len_rules(self, r: Recipe) -> list[str]:
        if self.seq_len > r.model.max_seq_len:
            return [f"data.seq_len: {self.seq_len} exceeds model.max_seq_len ({r.model.max_seq_len})"]
        return []

    def rules(self, r: Recipe) -> list[str]:
        """A blend is all supervised or none, and supervised rows have room for a response."""
        errors = []
        formats = {ds.format for ds in self.datasets}
        if len(formats) > 1:
            return errors + [
                "data.datasets: a blend mixes pretraining and supervised datasets; give every entry the same format"
            ]
        if formats != {"supervised"}:
            return errors
        errors += [
            f"data.datasets.{i}.format: the built-in corpus {ds.path!r} has no supervised records (only "
            f"{', '.join(SUPERVISED_CORPORA)} has)"
            for i, ds in enumerate(self.datasets)
            if ds.path in BUILTIN_CORPORA and ds.path not in SUPERVISED_CORPORA
        ]
        if self.document_mask:
            errors.append(
                "data.document_mask: applies to packed pretraining windows; supervised rows always keep "
                "attention within each record: remove it"
            )
        s = self.supervised
        if s.max_prompt_tokens is not None and s.max_prompt_tokens >= self.seq_len:
            errors.append(
                f"data.supervised.max_prompt_tokens: {s.max_prompt_tokens} leaves no room for a response in "
                f"data.seq_len ({self.seq_len})"
            )
        return errors

    def corpus_rules(self) -> list[str]:
        """A built-in corpus trains alone with its own tokenizer; preprocessed datasets name theirs."""
        names = [ds.path for ds in self.datasets]
        builtin = [n for n in names if n in BUILTIN_CORPORA]
        if builtin and len(names) > 1:
            return [
                f"data.datasets: the built-in corpus {builtin[0]!r} trains alone; blend preprocessed datasets "
                "(setdiff preprocess) instead"
            ]
        if builtin and self.tokenizer is not None:
            return [
                f"data.tokenizer: the built-in corpus {builtin[0]!r} brings its own tokenizer; remove data.tokenizer"
            ]
        if not builtin and self.tokenizer is None:
            return [
                "data.tokenizer: preprocessed datasets need the tokenizer that made them (their tokenizer/ directory)"
            ]
        return []


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

    def data_parallel_size(self, world_size: int) -> int:
        return world_size // (self.tp * self.pp * self.cp)

    def rules(self, r: Recipe, world_size: int) -> list[str]:
        """The layout against the model, the data and the `world_size` processes."""
        p, m = self, r.model
        errors = []
        if m.num_heads % p.tp or m.num_kv_heads % p.tp:
            errors.append(
                f"parallel.tp: {p.tp} must divide model.num_heads ({m.num_heads}) and model.num_kv_heads "
                f"({m.num_kv_heads})"
            )
        stages = p.pp * (p.vpp or 1)
        if m.num_layers % stages:
            errors.append(f"parallel.pp: pp x vpp = {stages} must divide model.num_layers ({m.num_layers})")
        if p.vpp is not None and p.pp == 1:
            errors.append("parallel.vpp: virtual pipeline stages need parallel.pp > 1")
        if p.sequence_parallel and p.tp == 1:
            errors.append("parallel.sequence_parallel: needs parallel.tp > 1")
        if world_size % (p.tp * p.pp * p.cp):
            errors.append(
                f"parallel: tp x pp x cp = {p.tp * p.pp * p.cp} does not divide the {world_size} processes "
                "(launch.nnodes x launch.nproc_per_node)"
            )
        else:
            dp = p.data_parallel_size(world_size)
            if p.global_batch_size % (p.micro_batch_size * dp):
                errors.append(
                    f"parallel.global_batch_size: {p.global_batch_size} must be a multiple of "
                    f"micro_batch_size x data-parallel size = {p.micro_batch_size} x {dp}"
                )
        errors += p._expert_rules(r, world_size) + p._context_rules(r)
        return errors

    def _expert_rules(self, r: Recipe, world_size: int) -> list[str]:
        p, m = self, r.model
        errors = []
        if p.ep > 1 and not m.num_experts:
            errors.append("parallel.ep: expert parallelism needs a mixture of experts; set model.num_experts or ep = 1")
        elif m.num_experts % p.ep:
            errors.append(f"parallel.ep: {p.ep} must divide model.num_experts ({m.num_experts})")
        if p.ep > 1 and r.engine == "deepspeed":
            errors.append(
                "parallel.ep: expert parallelism is a megatron-engine feature (the deepspeed engine runs MoE "
                "models data-parallel); set ep = 1 or engine: megatron"
            )
        dp = p.data_parallel_size(world_size) if world_size % (p.tp * p.pp * p.cp) == 0 else None
        if dp is not None and p.ep > 1 and (dp * p.cp) % p.ep:
            errors.append(
                f"parallel.ep: {p.ep} must divide the data- x context-parallel size ({dp} x {p.cp}): experts "
                "are spread over those ranks of a stage"
            )
        if m.num_experts and p.tp > 1 and r.engine == "megatron" and not p.sequence_parallel:
            errors.append(
                "parallel.sequence_parallel: megatron-core trains MoE layers under tp > 1 only with sequence "
                "parallelism; set sequence_parallel: true"
            )
        return errors

    def _context_rules(self, r: Recipe) -> list[str]:
        if self.cp == 1:
            return []
        cp, errors = self.cp, []
        if r.data.seq_len % (2 * cp):
            errors.append(
                f"parallel.cp: each stream is split into 2 x cp = {2 * cp} chunks; data.seq_len "
                f"({r.data.seq_len}) must be divisible by {2 * cp}"
            )
        if r.engine == "deepspeed":
            errors.append(
                "parallel.cp: context parallelism is a megatron-engine feature; set cp = 1 or engine: megatron"
            )
        if r.model.num_experts:
            errors.append("parallel.cp: context parallelism with a mixture of experts is not supported yet; set cp = 1")
        return errors


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

    def rules(self, r: Recipe) -> list[str]:
        """Its length, rates and policies against the layout and the model."""
        t = self
        errors = []
        if (t.steps is None) == (t.tokens is None):
            errors.append("train.steps: set exactly one of train.steps and train.tokens")
        if t.min_lr > t.lr:
            errors.append(f"train.min_lr: {t.min_lr} exceeds train.lr ({t.lr})")
        spikes = t.spike_policy
        if spikes.min_history > spikes.window:
            errors.append(
                f"train.spike_policy.min_history: {spikes.min_history} exceeds train.spike_policy.window "
                f"({spikes.window}), so no loss would ever be judged"
            )
        if spikes.action == "skip" and r.engine == "deepspeed" and r.parallel.zero_stage > 0:
            errors.append(
                "train.spike_policy.action: skip cannot drop a step under ZeRO (DeepSpeed applies finite "
                "gradients from its own partitions); use action rollback, or warn"
            )
        if 0 < t.straggler_factor <= 1:
            errors.append(
                f"train.straggler_factor: {t.straggler_factor} would call every run's slowest rank a straggler; "
                "use a factor above 1 (1.5 is the default), or 0 to turn the warning off"
            )
        if t.loss_normalization == "per_row" and r.model.num_experts:
            errors.append(
                "train.loss_normalization: per_row with a mixture of experts is not supported (the router "
                "losses are weighted per token); use per_token or a dense model"
            )
        if t.fp8 is not None and r.model.backend != "te":
            errors.append("train.fp8: FP8 needs model.backend: te (Transformer Engine, GPU only)")
        return errors

    def fp8_rules(self, r: Recipe) -> list[str]:
        """Token counts and inner sizes Transformer Engine's FP8 GEMMs take.

        Their input's leading dimensions multiply to a multiple of 8 and its last is a multiple of
        16 (transformer_engine/pytorch/utils.py assert_dim_for_fp8_exec, TE 2.9-2.11, asserted by
        Linear, LayerNormLinear and LayerNormMLP), and megatron-core runs every forward under FP8
        once train.fp8 is set, evaluation included. The fewest tokens a layer sees on a rank are
        the last layer's: its query stream only."""
        p, m = r.parallel, r.model
        if self.fp8 is None:
            return (
                ["train.fp8_dot_product_attention: FP8 attention needs train.fp8"]
                if self.fp8_dot_product_attention
                else []
            )
        errors = []
        split = p.cp * (p.tp if p.sequence_parallel else 1)
        tokens = r.data.seq_len * p.micro_batch_size
        if tokens % split or (tokens // split) % 8:
            per = " / parallel.cp" + (" / parallel.tp (sequence parallel)" if p.sequence_parallel else "")
            errors.append(
                f"train.fp8: FP8 GEMMs take token counts that are multiples of 8; the last layer holds data.seq_len "
                f"x parallel.micro_batch_size{per if split > 1 else ''} = {tokens / split:g} tokens per rank: make it "
                "a multiple of 8"
            )
        for name, size in (
            ("model.hidden_size", m.hidden_size),
            ("model.intermediate_size", m.intermediate_size),
            ("model.num_heads x model.head_dim", m.num_heads * m.head_dim),
        ):
            if size % 16:
                errors.append(f"train.fp8: FP8 GEMMs take inner sizes that are multiples of 16; {name} is {size}")
        return errors


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

    def rules(self, r: Recipe, world_size: int) -> list[str]:
        """Prompts from padded supervised records, exact likelihoods, whole models, one step's batch.

        Set diffusion's exact likelihoods, the whole model on each rank to sample (no PP, CP, SP
        or ZeRO-3), and a global batch of exactly one step's completions."""
        p = r.parallel
        errors = []
        if r.data.datasets[0].format != "supervised" or r.data.supervised.layout != "padded":
            errors.append(
                "rl: prompts come from supervised records one per row: set data.datasets format supervised, "
                "layout padded"
            )
        if r.method.masked_diffusion:
            errors.append(
                f"rl: the exact trajectory likelihood is set diffusion's; method.family {r.method.family} has none"
            )
        if p.pp > 1 or p.cp > 1 or p.sequence_parallel:
            errors.append(
                "rl: sampling runs the whole model on each rank: set parallel.pp = 1, cp = 1, sequence_parallel = false"
            )
        if r.engine == "deepspeed" and p.zero_stage == 3:
            errors.append("rl: sampling needs whole parameters on each rank: set parallel.zero_stage <= 2")
        if self.group_size < 2:
            errors.append("rl.group_size: GRPO normalises rewards within a group: give at least 2 completions a prompt")
        if p.global_batch_size != self.prompts_per_step * self.group_size:
            errors.append(
                f"parallel.global_batch_size: {p.global_batch_size} must be rl.prompts_per_step x rl.group_size = "
                f"{self.prompts_per_step * self.group_size} (the completions of a step)"
            )
        dp = p.data_parallel_size(world_size)
        if dp and self.prompts_per_step % dp:
            errors.append(
                f"rl.prompts_per_step: {self.prompts_per_step} prompts do not split over {dp} data-parallel ranks"
            )
        if not r.model.init_from:
            errors.append("rl: needs model.init_from, the starting weights the KL penalty keeps the policy near")
        if self.reward != "gsm8k" and ":" not in self.reward:
            errors.append(f"rl.reward: {self.reward!r} is neither 'gsm8k' nor 'module:function'")
        return errors


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
    block order): every entry point (sample, eval, serve, lm-eval, the HF export) starts from it."""

    def engine_rules(self) -> list[str]:
        """What `engine` asks of the other sections: megatron-only and DeepSpeed-only settings."""
        p, t = self.parallel, self.train
        errors = []
        if self.engine == "deepspeed" and (p.tp > 1 or p.pp > 1):
            errors.append(
                "parallel: tensor and pipeline parallelism (tp, pp > 1) are megatron-engine features; "
                "the deepspeed engine is data-parallel (ZeRO): set tp = pp = 1 or engine: megatron"
            )
        if self.engine == "megatron" and t.compile:
            errors.append(
                "train.compile: the deepspeed engine compiles its torch model; megatron-core's layers are "
                "not compiled: set train.compile=false or engine: deepspeed"
            )
        if self.engine == "megatron" and p.zero_stage > 1:
            errors.append(
                "parallel.zero_stage: ZeRO stages 2-3 are DeepSpeed's; with engine megatron use "
                "parallel.distributed_optimizer"
            )
        if self.engine != "deepspeed":
            if p.offload_optimizer:
                errors.append(
                    "parallel.offload_optimizer: optimizer offload is a deepspeed-engine feature; "
                    "set engine: deepspeed or offload_optimizer=false"
                )
            return errors
        if self.checkpoint.async_save:
            errors.append(
                "checkpoint.async_save: the deepspeed engine saves synchronously: DeepSpeed 0.19's decoupled "
                "checkpoint writer commits inside the next optimizer step, with no point at which the "
                "checkpoint could be hashed and published once its files are on disk; set "
                "checkpoint.async_save=false or engine: megatron"
            )
        if t.ema and p.zero_stage == 3:
            errors.append(
                "train.ema_decay: the average of the weights is not kept under ZeRO-3 (partitioned parameters); "
                "use parallel.zero_stage <= 2 or engine: megatron"
            )
        if p.distributed_optimizer and p.zero_stage == 0:
            errors.append(
                "parallel.distributed_optimizer: with engine deepspeed the optimizer is sharded by "
                "parallel.zero_stage (1 is megatron's distributed optimizer); set zero_stage >= 1 "
                "or distributed_optimizer=false"
            )
        if p.offload_optimizer and p.zero_stage == 0:
            errors.append(
                "parallel.offload_optimizer: DeepSpeed offloads only ZeRO-partitioned optimizer state; "
                "set parallel.zero_stage >= 1"
            )
        if t.precision == "bf16" and p.zero_stage == 0:
            # Stage 0 would update bf16 weights in place: DeepSpeed keeps fp32 master weights in ZeRO only.
            errors.append(
                "train.precision: bf16 under engine deepspeed needs parallel.zero_stage >= 1 (fp32 master "
                "weights live in DeepSpeed's ZeRO optimizer); or use train.precision=fp32"
            )
        return errors

    def decoding_policy(self) -> DecodingConfig:
        """The model's own decoding policy: its order's paper default, with `decoding` over it."""
        return DecodingConfig(**{**self.method.decoding_policy().settings(), **settings_given(self.decoding)})
