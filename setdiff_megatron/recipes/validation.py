"""Rules that relate fields of different sections, checked before anything heavy starts.

`validate_recipe` returns every violation, each as "key.path: what is wrong and what to do";
training/preflight.py's `check_run`, the one check every command runs, raises the first one as a
RecipeError naming the recipe file. Hardware-dependent
rules (FP8, the TE backend and the te/flash_attn attention kernels need a GPU) are checked
against the machine the run starts on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setdiff_megatron.core.orders import OrderError, Staggered
from setdiff_megatron.errors import require
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.megatron_map import check_backend
from setdiff_megatron.recipes.inputs import dataset_exists, where_looked
from setdiff_megatron.recipes.loading import RecipeError
from setdiff_megatron.recipes.schema import BUILTIN_CORPORA, SUPERVISED_CORPORA, Recipe

__all__ = [
    "validate_recipe",
    "check_engine_installed",
    "data_parallel_size",
    "ENGINE_EXTRAS",
    "offload_host_bytes",
    "estimated_model_config",
]

# Host bytes per parameter of offloaded optimizer state: fp32 master weights, two Adam moments
# and fp32 gradients.
OFFLOAD_BYTES_PER_PARAM = 16
# engine -> (module that must import, pip extra that provides it)
ENGINE_EXTRAS = {"megatron": ("megatron.core", "megatron"), "deepspeed": ("deepspeed", "deepspeed")}
# attention_impl names that run only on CUDA GPUs -> the library behind them
GPU_ATTENTION = {"te": "Transformer Engine", "flash_attn": "flash-attn"}


def data_parallel_size(recipe: Recipe, world_size: int) -> int:
    p = recipe.parallel
    return world_size // (p.tp * p.pp * p.cp)


def _parallel_rules(r: Recipe, world_size: int) -> list[str]:
    p, m = r.parallel, r.model
    errors = []
    if m.num_heads % p.tp or m.num_kv_heads % p.tp:
        errors.append(
            f"parallel.tp: {p.tp} must divide model.num_heads ({m.num_heads}) and model.num_kv_heads ({m.num_kv_heads})"
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
        dp = data_parallel_size(r, world_size)
        if p.global_batch_size % (p.micro_batch_size * dp):
            errors.append(
                f"parallel.global_batch_size: {p.global_batch_size} must be a multiple of "
                f"micro_batch_size x data-parallel size = {p.micro_batch_size} x {dp}"
            )
    errors += _expert_rules(r, world_size) + _context_rules(r)
    if r.engine == "deepspeed" and (p.tp > 1 or p.pp > 1):
        errors.append(
            "parallel: tensor and pipeline parallelism (tp, pp > 1) are megatron-engine features; "
            "the deepspeed engine is data-parallel (ZeRO): set tp = pp = 1 or engine: megatron"
        )
    if r.engine == "megatron" and r.train.compile:
        errors.append(
            "train.compile: the deepspeed engine compiles its torch model; megatron-core's layers are "
            "not compiled: set train.compile=false or engine: deepspeed"
        )
    if r.engine == "megatron" and p.zero_stage > 1:
        errors.append(
            "parallel.zero_stage: ZeRO stages 2-3 are DeepSpeed's; with engine megatron use "
            "parallel.distributed_optimizer"
        )
    return errors


def _expert_rules(r: Recipe, world_size: int) -> list[str]:
    p, m = r.parallel, r.model
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
    dp = data_parallel_size(r, world_size) if world_size % (p.tp * p.pp * p.cp) == 0 else None
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


def _context_rules(r: Recipe) -> list[str]:
    p = r.parallel
    if p.cp == 1:
        return []
    errors = []
    if r.data.seq_len % (2 * p.cp):
        errors.append(
            f"parallel.cp: each stream is split into 2 x cp = {2 * p.cp} chunks; data.seq_len "
            f"({r.data.seq_len}) must be divisible by {2 * p.cp}"
        )
    if r.engine == "deepspeed":
        errors.append("parallel.cp: context parallelism is a megatron-engine feature; set cp = 1 or engine: megatron")
    if r.model.num_experts:
        errors.append("parallel.cp: context parallelism with a mixture of experts is not supported yet; set cp = 1")
    return errors


def _deepspeed_rules(r: Recipe, has_gpu: bool, host_memory: int | None, num_params: int) -> list[str]:
    p = r.parallel
    if r.engine != "deepspeed":
        return (
            [
                "parallel.offload_optimizer: optimizer offload is a deepspeed-engine feature; "
                "set engine: deepspeed or offload_optimizer=false"
            ]
            if p.offload_optimizer
            else []
        )
    errors = []
    if r.checkpoint.async_save:
        errors.append(
            "checkpoint.async_save: the deepspeed engine saves synchronously: DeepSpeed 0.19's decoupled "
            "checkpoint writer commits inside the next optimizer step, with no point at which the "
            "checkpoint could be hashed and published once its files are on disk; set "
            "checkpoint.async_save=false or engine: megatron"
        )
    if r.train.ema and p.zero_stage == 3:
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
    if r.train.precision == "bf16" and p.zero_stage == 0:
        # Stage 0 would update bf16 weights in place: DeepSpeed keeps fp32 master weights in ZeRO only.
        errors.append(
            "train.precision: bf16 under engine deepspeed needs parallel.zero_stage >= 1 (fp32 master "
            "weights live in DeepSpeed's ZeRO optimizer); or use train.precision=fp32"
        )
    if r.train.precision == "fp16" and not has_gpu:
        errors.append("train.precision: DeepSpeed has no fp16 on the CPU; use bf16 or fp32 here")
    if p.offload_optimizer and p.zero_stage and host_memory is not None:
        need = offload_host_bytes(r, num_params)
        if need > host_memory:
            errors.append(
                f"parallel.offload_optimizer: the offloaded optimizer state needs about "
                f"{need / 2**30:.1f} GiB of host memory on this node ({OFFLOAD_BYTES_PER_PARAM} bytes per "
                f"parameter, shared over data-parallel ranks), but {host_memory / 2**30:.1f} GiB is "
                "available; use more nodes or offload_optimizer=false"
            )
    return errors


def estimated_model_config(r: Recipe, vocab_size: int | None = None) -> ModelConfig:
    """The run's model config before its tokenizer loads: the vocabulary is `vocab_size` (the
    tokenizer's, where the caller has it), else the recipe's or the BPE size it trains."""
    return r.model.to_model_config(vocab_size=vocab_size or r.model.vocab_size or r.data.vocab_size, mask_token_id=0)


def offload_host_bytes(r: Recipe, num_params: int) -> int:
    """Host memory that optimizer offload takes on one node: each of its processes holds a 1/dp
    share of the fp32 master weights, both Adam moments and the fp32 gradients."""
    return OFFLOAD_BYTES_PER_PARAM * num_params * r.launch.nproc_per_node // r.launch.world_size


def _host_memory() -> int:
    psutil = require("psutil", "deepspeed", "the host-memory check of parallel.offload_optimizer")
    return psutil.virtual_memory().available


def _method_rules(r: Recipe) -> list[str]:
    """The order law's own rules (core/orders.py), against the recipe's sequence length, and the
    decoding policy it yields."""
    me, seq_len = r.method, r.data.seq_len
    if me.masked_diffusion:
        errors = _masked_diffusion_rules(r)
    else:
        errors = []
        try:
            policy = me.order_policy()
            if isinstance(policy, Staggered):
                policy.schedule(seq_len)
        except OrderError as exc:
            errors.append(f"method.{exc.field}: {exc}")
    if not errors:
        try:
            r.decoding_policy()
        except ValueError as exc:
            errors.append(f"decoding: {exc}")
    if me.order == "block" and me.block_size is not None and me.block_size > seq_len:
        errors.append(f"method.block_size: {me.block_size} exceeds data.seq_len ({seq_len})")
    if seq_len > r.model.max_seq_len:
        errors.append(f"data.seq_len: {seq_len} exceeds model.max_seq_len ({r.model.max_seq_len})")
    return errors


def _masked_diffusion_rules(r: Recipe) -> list[str]:
    """What the masked-diffusion baselines (method.family mdlm, bd3lm) need: BD3-LM blocks that
    tile the sequence, none for MDLM, no context parallelism and no document mask."""
    me, seq_len, family = r.method, r.data.seq_len, r.method.family
    errors = []
    if family == "bd3lm" and me.block_size is None:
        errors.append("method.block_size: family bd3lm needs its block size (the reference trains 4, 8 or 16)")
    elif family == "bd3lm" and seq_len % me.block_size:
        errors.append(
            f"method.block_size: {me.block_size} does not divide data.seq_len ({seq_len}); BD3-LM's blocks tile "
            "the sequence"
        )
    if family == "mdlm" and me.block_size is not None:
        errors.append("method.block_size: MDLM is one block of data.seq_len; remove it (family bd3lm has blocks)")
    if r.parallel.cp > 1:
        errors.append(f"parallel.cp: family {family} runs without context parallelism; set cp = 1")
    if r.data.document_mask:
        errors.append(
            f"data.document_mask: family {family} attends across a packed window, as the reference; remove it"
        )
    return errors


def _rl_rules(r: Recipe, world_size: int) -> list[str]:
    """What RL (the `rl` section) needs: prompts from padded supervised records, set diffusion's
    exact likelihoods, the whole model on each rank to sample (no PP, CP, SP or ZeRO-3), and a
    global batch of exactly one step's completions."""
    rl, p = r.rl, r.parallel
    if rl is None:
        return []
    errors = []
    if r.data.datasets[0].format != "supervised" or r.data.supervised.layout != "padded":
        errors.append(
            "rl: prompts come from supervised records one per row: set data.datasets format supervised, layout padded"
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
    if rl.group_size < 2:
        errors.append("rl.group_size: GRPO normalises rewards within a group: give at least 2 completions a prompt")
    if p.global_batch_size != rl.prompts_per_step * rl.group_size:
        errors.append(
            f"parallel.global_batch_size: {p.global_batch_size} must be rl.prompts_per_step x rl.group_size = "
            f"{rl.prompts_per_step * rl.group_size} (the completions of a step)"
        )
    dp = data_parallel_size(r, world_size)
    if dp and rl.prompts_per_step % dp:
        errors.append(f"rl.prompts_per_step: {rl.prompts_per_step} prompts do not split over {dp} data-parallel ranks")
    if not r.model.init_from:
        errors.append("rl: needs model.init_from, the starting weights the KL penalty keeps the policy near")
    if rl.reward != "gsm8k" and ":" not in rl.reward:
        errors.append(f"rl.reward: {rl.reward!r} is neither 'gsm8k' nor 'module:function'")
    return errors


def _lora_rules(r: Recipe) -> list[str]:
    """What LoRA (model.lora) needs: a base to adapt, and the layouts where an adapter is exact:
    dense layers, whole linears (no TP split of B, no Transformer Engine norm fused into the
    linear), all layers on one stage (adapters are drawn layer by layer from one seed), and
    weights that are not partitioned (ZeRO-3)."""
    m, p = r.model, r.parallel
    if m.lora is None:
        return []
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
        errors.append("model.lora: Transformer Engine fuses the norm into the adapted linears: set model.backend local")
    if r.engine == "deepspeed" and p.zero_stage == 3:
        errors.append(
            "model.lora: ZeRO-3 partitions the frozen weights the adapters read: set parallel.zero_stage <= 2"
        )
    if r.train.ema:
        errors.append("model.lora: no average of the weights is kept for adapters: remove train.ema_decay")
    return errors


def _supervised_rules(r: Recipe) -> list[str]:
    formats = {ds.format for ds in r.data.datasets}
    if len(formats) > 1:
        return ["data.datasets: a blend mixes pretraining and supervised datasets; give every entry the same format"]
    s, seq_len = r.data.supervised, r.data.seq_len
    if formats != {"supervised"}:
        return []
    errors = [
        f"data.datasets.{i}.format: the built-in corpus {ds.path!r} has no supervised records (only "
        f"{', '.join(SUPERVISED_CORPORA)} has)"
        for i, ds in enumerate(r.data.datasets)
        if ds.path in BUILTIN_CORPORA and ds.path not in SUPERVISED_CORPORA
    ]
    if r.data.document_mask:
        errors.append(
            "data.document_mask: applies to packed pretraining windows; supervised rows always keep "
            "attention within each record: remove it"
        )
    if s.max_prompt_tokens is not None and s.max_prompt_tokens >= seq_len:
        errors.append(
            f"data.supervised.max_prompt_tokens: {s.max_prompt_tokens} leaves no room for a response in "
            f"data.seq_len ({seq_len})"
        )
    return errors


def _data_rules(r: Recipe) -> list[str]:
    names = [ds.path for ds in r.data.datasets]
    builtin = [n for n in names if n in BUILTIN_CORPORA]
    if builtin and len(names) > 1:
        return [
            f"data.datasets: the built-in corpus {builtin[0]!r} trains alone; blend preprocessed datasets "
            "(setdiff preprocess) instead"
        ]
    if builtin and r.data.tokenizer is not None:
        return [f"data.tokenizer: the built-in corpus {builtin[0]!r} brings its own tokenizer; remove data.tokenizer"]
    if not builtin and r.data.tokenizer is None:
        return ["data.tokenizer: preprocessed datasets need the tokenizer that made them (their tokenizer/ directory)"]
    return []


def _train_rules(r: Recipe, has_gpu: bool) -> list[str]:
    t = r.train
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
    try:
        check_backend(r.model, r.model.backend)
    except ValueError as exc:
        errors.append(f"model.backend: {exc}")
    if not has_gpu:
        if r.model.backend == "te":
            errors.append("model.backend: te (Transformer Engine) needs a GPU; use model.backend=local here")
        if r.model.attention_impl in GPU_ATTENTION:
            errors.append(
                f"model.attention_impl: {r.model.attention_impl} ({GPU_ATTENTION[r.model.attention_impl]}) "
                "needs a GPU; use model.attention_impl=auto here"
            )
        if t.fp8 is not None:
            errors.append("train.fp8: FP8 needs a GPU with Transformer Engine; use train.fp8=null here")
        if r.launch.device == "cuda":
            errors.append("launch.device: cuda, but this machine has no GPU; use launch.device=cpu or auto")
    return errors


def _fp8_rules(r: Recipe) -> list[str]:
    """Transformer Engine's FP8 GEMMs take an input whose leading dimensions multiply to a multiple
    of 8 and whose last is a multiple of 16 (transformer_engine/pytorch/utils.py
    assert_dim_for_fp8_exec, TE 2.9-2.11, asserted by Linear, LayerNormLinear and LayerNormMLP),
    and megatron-core runs every forward under FP8 once train.fp8 is set, evaluation included.
    The fewest tokens a layer sees on a rank are the last layer's: its query stream only."""
    t, p, m = r.train, r.parallel, r.model
    if t.fp8 is None:
        return ["train.fp8_dot_product_attention: FP8 attention needs train.fp8"] if t.fp8_dot_product_attention else []
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


def _path_rules(r: Recipe, recipe_file: str | Path | None) -> list[str]:
    """The files the run reads exist; a relative one found nowhere says where it was looked for."""
    errors = []
    for i, ds in enumerate(r.data.datasets):
        if ds.path not in BUILTIN_CORPORA and not dataset_exists(Path(ds.path)):
            errors.append(
                f"data.datasets.{i}.path: no indexed dataset at {ds.path}(.bin/.idx){where_looked(ds.path, recipe_file)}; "
                "build it with `setdiff preprocess`"
            )
    for key, value in (("data.tokenizer", r.data.tokenizer), ("model.init_from", r.model.init_from)):
        if value is not None and not Path(value).exists():
            errors.append(f"{key}: {value} does not exist{where_looked(value, recipe_file)}")
    resume = r.checkpoint.resume
    if resume not in ("auto", "none") and not Path(resume).exists():
        errors.append(
            f"checkpoint.resume: {resume} does not exist{where_looked(resume, recipe_file)} "
            "(use auto, none or a checkpoint path)"
        )
    return errors


def validate_recipe(
    recipe: Recipe,
    *,
    world_size: int | None = None,
    has_gpu: bool | None = None,
    check_paths: bool = True,
    host_memory: int | None = None,
    model_config: ModelConfig | None = None,
    recipe_file: str | Path | None = None,
) -> list[str]:
    """`host_memory` (bytes) is what optimizer offload may fill on a node; None measures this
    machine's available memory when checking against it (`check_paths`), else skips that rule.
    `model_config`: the caller's estimate of the run's model (estimated_model_config), else
    estimated here. `recipe_file`: the recipe's file, for where a missing input was looked for
    (inputs.py)."""
    if has_gpu is None:
        import torch

        has_gpu = torch.cuda.is_available()
    if host_memory is None and check_paths and recipe.parallel.offload_optimizer:
        host_memory = _host_memory()
    world = world_size if world_size is not None else recipe.launch.world_size
    errors = (
        _parallel_rules(recipe, world)
        + _deepspeed_rules(recipe, has_gpu, host_memory, (model_config or estimated_model_config(recipe)).num_params())
        + _method_rules(recipe)
        + _train_rules(recipe, has_gpu)
        + _fp8_rules(recipe)
        + _supervised_rules(recipe)
        + _rl_rules(recipe, world)
        + _lora_rules(recipe)
    )
    if check_paths:
        errors += _path_rules(recipe, recipe_file)
    return errors + _data_rules(recipe)


def check_engine_installed(recipe: Recipe) -> None:
    module, extra = ENGINE_EXTRAS[recipe.engine]
    try:
        found = importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        found = False
    if not found:
        raise RecipeError(
            f"engine {recipe.engine} needs {module.split('.')[0]}: pip install 'setdiff-megatron[{extra}]'"
        )
