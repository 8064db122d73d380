"""A recipe's rules, checked before anything heavy starts.

Each section's rules against the rest of the recipe live beside its fields (schema.py, its
`rules` method); here are those against the machine and the files the run reads.
`validate_recipe` returns every violation, each as "key.path: what is wrong and what to do";
training/preflight.py's `check_run`, the one check every command runs, raises the first one as a
RecipeError naming the recipe file. Hardware-dependent
rules (FP8, the TE backend and the te/flash_attn attention kernels need a GPU) are checked
against the machine the run starts on.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from setdiff_megatron.errors import require
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.recipes.inputs import dataset_exists, where_looked
from setdiff_megatron.recipes.recipe_files import RecipeError
from setdiff_megatron.recipes.schema import BUILTIN_CORPORA, Recipe

__all__ = [
    "validate_recipe",
    "check_engine_installed",
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


def _gpu_rules(r: Recipe, has_gpu: bool) -> list[str]:
    """Transformer Engine, FP8, the GPU attention kernels and launch.device cuda need a GPU."""
    errors = []
    if not has_gpu:
        if r.model.backend == "te":
            errors.append("model.backend: te (Transformer Engine) needs a GPU; use model.backend=local here")
        if r.model.attention_impl in GPU_ATTENTION:
            errors.append(
                f"model.attention_impl: {r.model.attention_impl} ({GPU_ATTENTION[r.model.attention_impl]}) "
                "needs a GPU; use model.attention_impl=auto here"
            )
        if r.train.fp8 is not None:
            errors.append("train.fp8: FP8 needs a GPU with Transformer Engine; use train.fp8=null here")
        if r.launch.device == "cuda":
            errors.append("launch.device: cuda, but this machine has no GPU; use launch.device=cpu or auto")
    return errors


def _deepspeed_machine_rules(r: Recipe, has_gpu: bool, host_memory: int | None, num_params: int) -> list[str]:
    """DeepSpeed's fp16 needs a GPU; optimizer offload needs the host memory."""
    errors = []
    if r.engine == "deepspeed" and r.train.precision == "fp16" and not has_gpu:
        errors.append("train.precision: DeepSpeed has no fp16 on the CPU; use bf16 or fp32 here")
    p = r.parallel
    if r.engine == "deepspeed" and p.offload_optimizer and p.zero_stage and host_memory is not None:
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
    num_params = (model_config or estimated_model_config(recipe)).num_params()
    rl, lora = recipe.rl, recipe.model.lora
    errors = (  # in this order: the first one is the one a command reports
        recipe.parallel.rules(recipe, world)
        + recipe.engine_rules()
        + _deepspeed_machine_rules(recipe, has_gpu, host_memory, num_params)
        + recipe.method.rules(recipe)
        + recipe.data.seq_len_rules(recipe)
        + recipe.train.rules(recipe)
        + recipe.model.backend_rules()
        + _gpu_rules(recipe, has_gpu)
        + recipe.train.fp8_rules(recipe)
        + recipe.data.rules(recipe)
        + (rl.rules(recipe, world) if rl is not None else [])
        + (lora.rules(recipe) if lora is not None else [])
    )
    if check_paths:
        errors += _path_rules(recipe, recipe_file)
    return errors + recipe.data.corpus_rules()


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
