"""The DeepSpeed engine: the torch model under ZeRO stage 0-3, trained from the same recipes.

It adopts the run's process group (gloo on CPUs, NCCL on GPUs), wraps models/torch_model in
deepspeed.initialize with deepspeed_config.py's config, and steps with the megatron engine's
update rule, loss normalisation and weight average. Checkpoints are DeepSpeed's own format,
resumable only on the ZeRO stage and data-parallel size they were saved with. Not here: tensor
and pipeline parallelism (the megatron engine's), and deepspeed.zero.Init: every rank builds the
full model, which ZeRO-3 then partitions. docs/training.md ("DeepSpeed engine").
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from setdiff_megatron.checkpoint.ema_files import read_whole, write_whole
from setdiff_megatron.checkpoint.names import DEEPSPEED_TAG as TAG
from setdiff_megatron.checkpoint.names import RNG_FILE
from setdiff_megatron.checkpoint.resolve import Resumed
from setdiff_megatron.core.loss import LossWeights, token_nll
from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.distributed import runtime
from setdiff_megatron.distributed.layout import Layout
from setdiff_megatron.errors import UserError, require
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.lora import adapt_torch_model, load_weights
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.recipes import Recipe
from setdiff_megatron.training import lr_schedule
from setdiff_megatron.training.engines.base import Engine, StepOutcome, evaluating
from setdiff_megatron.training.engines.deepspeed_config import build_optimizer, deepspeed_config
from setdiff_megatron.training.engines.rng import host_rng_state, set_host_rng_state
from setdiff_megatron.training.expert_load import ExpertLoad
from setdiff_megatron.training.objective import Objective
from setdiff_megatron.training.weight_average import Share

__all__ = ["DeepSpeedEngine", "import_deepspeed", "apply_recompute", "layout_refusal", "LOADABLE_ON"]

LOADABLE_ON = ("zero_stage", "dp", "optimizer")
"""Keys of the layout that DeepSpeed's own format must find unchanged to load."""


def import_deepspeed(recipe: Recipe):
    """DeepSpeed, with its CPU accelerator where the run has no GPU (picked before the import,
    which fixes the accelerator) and its INFO logging off (metrics.py reports progress)."""
    if recipe.launch.device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = require("deepspeed", "deepspeed", "engine: deepspeed")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # ZeRO calls a collective that torch deprecates; nothing a user of this engine can act on.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated")
    return deepspeed


@contextlib.contextmanager
def _no_shared_memory_op(accelerator) -> Iterator[None]:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce when it starts (C++; over
    four minutes on a fresh 2-core machine, and it needs a compiler). Only its inference
    all-reduce uses it, so training starts without building it."""
    ds_comm = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` is also torch itself
    build = ds_comm.build_shm_op
    if accelerator.device_name() == "cpu":
        ds_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm.build_shm_op = build


def apply_recompute(model: SetDiffusionTransformer, mode: str) -> None:
    """train.recompute from outside the model: 'full' recomputes each transformer block in the
    backward pass, 'selective' each attention sub-layer (megatron recomputes only the core
    attention; the torch model has no smaller seam). Parameter names do not change."""
    if mode == "none":
        return
    for block in model.layers:
        module = block if mode == "full" else block.self_attn
        module.forward = partial(checkpoint, module.forward, use_reentrant=False)


def layout_refusal(path: Path, saved: dict, here: dict) -> str | None:
    """Why a checkpoint saved at layout `saved` cannot be resumed at `here`, or None."""
    if saved.get("engine") != "deepspeed":
        return (
            f"{path} was written by the megatron engine; the deepspeed engine resumes only its own "
            "checkpoints: use engine: megatron or a new checkpoint.dir"
        )
    changed = [f"{k} {saved[k]} there, {here[k]} here" for k in LOADABLE_ON if saved[k] != here[k]]
    if changed:
        return (
            f"{path} has another DeepSpeed layout ({'; '.join(changed)}); DeepSpeed loads its partitioned "
            "optimizer state only on the layout it was saved with: restore parallel.zero_stage, the process "
            "count and train.precision, or start a new run from its consolidated weights (model.init_from)"
        )
    return None


def _logits(model: torch.nn.Module, batch: TwoStreamBatch) -> torch.Tensor:
    """The torch body's query-stream logits of `batch`: the engine's one call of the model.

    Divided by the batch's sampling temperature where it has one (RL's PolicyBatch)."""
    logits = model(
        batch.clean_tokens,
        batch.query_tokens,
        batch.position_ids,
        batch.valid_len,
        batch.document_ids,
        groups=batch.groups,
        group_within=batch.group_within,
    )
    return logits / getattr(batch, "temperature", 1.0)


def _all_sum(local: torch.Tensor) -> torch.Tensor:
    total = local.clone()
    dist.all_reduce(total)
    return total


class DeepSpeedEngine(Engine):
    name = "deepspeed"

    def __init__(self, recipe: Recipe):
        self.recipe, self.objective = recipe, Objective.of(recipe)
        self.deepspeed = import_deepspeed(recipe)  # before anything of DeepSpeed: it picks the accelerator
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        runtime.init_process_group()
        with _no_shared_memory_op(accelerator):
            self.deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name())
        self.layout = Layout.of(runtime.world_size())
        self.dp_rank, self.dp_size = dist.get_rank(), self.layout.dp
        self.device = torch.device(accelerator.device_name(int(os.environ.get("LOCAL_RANK", "0"))))
        self.sync_seconds = 0.0
        """The token-count and loss reductions only: DeepSpeed reduces gradients inside backward."""

    # ---- building --------------------------------------------------------------------------

    def build(self, model_cfg: ModelConfig, total_steps: int) -> None:
        """The torch model with the weights of train.seed (every rank builds the same ones); the
        DeepSpeed engine around it is made on the first use, after `init_from` could load weights."""
        r = self.recipe
        torch.manual_seed(r.train.seed)
        model = SetDiffusionTransformer(model_cfg)
        if r.model.lora is not None:  # frozen weights, trained adapters (models/lora.py)
            adapt_torch_model(model, r.model.lora.spec(), r.train.seed)
        apply_recompute(model, r.train.recompute)
        if r.train.compile:
            model.compile()  # in place: the module, and so its parameter names, stay as they are
        self.model, self.mask_token_id, self.total_steps = model, model_cfg.mask_token_id, total_steps
        self.expert_load = ExpertLoad(model_cfg, self.device) if model_cfg.num_experts else None
        self._start_ema()
        self._engine = None

    def init_from(self, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
        """Before DeepSpeed copies and partitions the weights; with LoRA, the base under the adapters."""
        load_weights(self.model, state_dict, "model.init_from")

    # ---- RL (training/rollouts.py): sampling from, and scoring with, the policy ----------

    def policy_model(self) -> SetDiffusionTransformer:
        """The model being trained, as the sampler's StepModel (RL runs at ZeRO <= 2: whole
        parameters on every rank)."""
        return self.engine.module

    def decoding(self) -> contextlib.AbstractContextManager:
        """RL's rollouts decode as the model trains (this engine has no FP8)."""
        return contextlib.nullcontext()

    def set_reference(self, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
        """A frozen copy of `state_dict`'s weights: RL's KL reference."""
        reference = SetDiffusionTransformer(model_cfg)
        reference.load_state_dict(state_dict)
        dtype = next(self.engine.module.parameters()).dtype
        self.reference = reference.to(device=self.device, dtype=dtype).eval().requires_grad_(False)

    @torch.no_grad()
    def token_logprobs(self, batches, *, reference: bool = False) -> list[torch.Tensor]:
        """Each target's log-probability [b, L] under the policy (or the reference), no gradient."""
        with evaluating(self.reference if reference else self.policy_model()) as model:
            return [-token_nll(_logits(model, b), b.targets, self.mask_token_id) for b in batches]

    @property
    def engine(self):
        if self._engine is None:
            r, model = self.recipe, self.model
            if r.parallel.zero_stage == 3 and model.lm_head is None:
                # The tied output layer reads embed_tokens.weight outside embed_tokens' forward: ZeRO-3
                # must gather it for the whole model's forward, not just the embedding's.
                self.deepspeed.zero.register_external_parameter(model, model.embed_tokens.weight)
            self._engine, *_ = self.deepspeed.initialize(
                model=model, optimizer=build_optimizer(r, model), config=deepspeed_config(r, self.dp_size)
            )
            self.scheduler = lr_schedule.build_lr_scheduler(r, self._engine.optimizer, self.total_steps)
        return self._engine

    # ---- steps -----------------------------------------------------------------------------

    def _nll(self, batch: TwoStreamBatch, weights: LossWeights) -> tuple[torch.Tensor, torch.Tensor | float]:
        """Weighted NLL sum (training/objective.py) and the MoE router losses weighted per routed
        token (0 if dense)."""
        nll = weights.apply(token_nll(_logits(self.engine, batch), batch.targets, self.mask_token_id))
        if self.expert_load is not None:
            for layer, stats in self.model.router_stats().items():
                self.expert_load.add(layer, stats.tokens_per_expert, stats.load_balancing_loss, stats.z_loss)
        return nll.sum(dim=1).sum(), self.model.router_loss()

    def forward_backward(self, batches: list[TwoStreamBatch]) -> tuple[float, float]:
        """megatron divides the loss by the denominator of the whole global batch (its target
        tokens, or rows); DeepSpeed divides each micro-batch's loss by the accumulation steps and
        averages gradients over the data-parallel ranks. So a micro-batch contributes its weighted
        NLL sum x (micro-batches x dp) / the global batch's denominator, and the gradient is
        megatron's."""
        engine, start = self.engine, time.perf_counter()
        weights = [self.objective(b) for b in batches]
        denominator = _all_sum(sum(w.denominator for w in weights).double().reshape(1).to(engine.device))
        self.sync_seconds = time.perf_counter() - start
        local = self.backward_micro_batches(
            batches, weights, len(batches) * self.dp_size / max(denominator.item(), 1.0)
        )
        start = time.perf_counter()
        nll, count = _all_sum(local).cpu().tolist()
        self.sync_seconds += time.perf_counter() - start
        return nll, count

    def backward_micro_batches(
        self, batches: list[TwoStreamBatch], weights: list[LossWeights], scale: float
    ) -> torch.Tensor:
        """Forward and backward of each micro-batch, its loss times `scale`; this rank's [NLL sum,
        denominator]. setdiff plan runs it alone (no host reads: fake tensors cannot answer them)."""
        engine = self.engine
        local = torch.zeros(2, dtype=torch.float64, device=engine.device)
        if self.expert_load is not None:
            self.expert_load.reset()
        for i, (batch, w) in enumerate(zip(batches, weights)):
            # One accumulation boundary per global batch, whatever DeepSpeed's micro-step count.
            engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            nll, router_loss = self._nll(batch, w)
            engine.backward((nll + router_loss) * scale)
            local += torch.stack([nll.detach().double(), w.denominator.double()])
        return local

    def _stage0_grad_norm(self) -> float:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        return (
            float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads])))
            if grads
            else 0.0
        )

    def optimizer_step(self) -> StepOutcome:
        """ZeRO optimizers skip an update whose gradient norm is not finite (and fp16 loss scaling
        one that overflowed); at stage 0 a plain optimizer would apply it, so the norm of the
        (already averaged) gradients is checked first."""
        engine = self.engine
        if not engine.zero_optimization():
            norm = self._stage0_grad_norm()
            if not math.isfinite(norm):
                engine.zero_grad()
                return StepOutcome(applied=False, grad_norm=norm, problem="the gradients are not finite")
        engine.step()
        norm = engine.get_global_grad_norm()  # stage 0 in fp32 does not report it
        norm = None if norm is None else float(norm)
        if engine.was_step_applied():
            self._update_ema()
            self.scheduler.step(increment=1)
            return StepOutcome(applied=True, grad_norm=norm)
        problem = None if self.recipe.train.precision == "fp16" else "the gradients are not finite"
        return StepOutcome(applied=False, grad_norm=norm, problem=problem)

    def discard(self) -> bool:
        """A ZeRO optimizer keeps the gradients in its own partitions, so it is stepped and skips
        non-finite ones; at stage 0 they are plain .grad tensors."""
        engine = self.engine
        if not engine.zero_optimization():
            engine.zero_grad()
            return True
        engine.step()
        return not engine.was_step_applied()

    def evaluate(self, batches: list[TwoStreamBatch]) -> tuple[float, float]:
        engine = self.engine
        local = torch.zeros(2, dtype=torch.float64, device=engine.device)
        engine.eval()
        with torch.no_grad(), self._ema_weights():
            for batch in batches:
                weights = self.objective(batch)
                nll, _ = self._nll(batch, weights)
                local += torch.stack([nll.double(), weights.denominator.double()])
        engine.train()
        nll, count = _all_sum(local).cpu().tolist()
        return nll, count

    def lr(self) -> float:
        return self.scheduler.get_lr(self.engine.optimizer.param_groups[0])

    # ---- checkpoints -----------------------------------------------------------------------

    def layout_record(self) -> dict:
        """The megatron layout's keys (ZeRO >= 1 counts as a distributed optimizer), plus what
        DeepSpeed's format depends on."""
        stage = self.recipe.parallel.zero_stage
        return {
            **self.layout.as_record(),
            "distributed_optimizer": stage >= 1,
            "engine": "deepspeed",
            "zero_stage": stage,
            "offload_optimizer": self.recipe.parallel.offload_optimizer,
            "optimizer": type(self.engine.optimizer).__name__,
        }

    def _shares(self) -> list[Share]:
        """Each parameter's fp32 weights that the optimizer steps on this rank (training/weight_average.py):
        under ZeRO 1-2 its fragment of the rank's flat fp32 partition, which DeepSpeed links to
        the parameter (`_hp_mapping`, None where the rank holds none of it); at stage 0 the
        parameter itself."""
        shares = []
        for name, p in self.model.named_parameters():
            if not hasattr(p, "_hp_mapping"):
                shares.append(Share(name, p, p.shape, p))
            elif p._hp_mapping is None:
                shares.append(Share(name, p, p.shape, None, group=p._dp_group))
            else:
                fragment = p._hp_mapping
                start = fragment.lp_fragment_address.start
                shares.append(Share(name, p, p.shape, fragment.hp_fragment, start, p._dp_group))
        return shares

    def save(self, directory: Path) -> None:
        # With LoRA the frozen base is model.init_from's, read again on resume: adapters only.
        lora = self.recipe.model.lora is not None
        self.engine.save_checkpoint(str(directory), tag=TAG, save_latest=False, exclude_frozen_parameters=lora)
        torch.save(host_rng_state(), directory / RNG_FILE.format(rank=dist.get_rank()))
        if (
            self.ema_state() is not None
        ):  # whole, fp32, under the torch names: sources/deepspeed_checkpoints.py reads it
            wholes = {s.name: whole.cpu() for s, whole in self._ema_wholes()}
            if dist.get_rank() == 0:
                write_whole(directory, wholes)

    def start_save(self, directory: Path, then) -> None:
        """Refused by recipe validation (recipes/validation.py says why)."""
        raise UserError("checkpoint.async_save needs engine: megatron")

    def finish_saves(self, *, blocking: bool) -> bool:
        return True

    def load(self, resumed: Resumed) -> None:
        path = resumed.path
        problem = layout_refusal(path, resumed.state.layout, self.layout_record())
        if problem:
            raise UserError(f"checkpoint.resume: cannot load {problem}")
        # The LR schedule is the recipe's (its scheduler takes only the step count from the checkpoint).
        loaded, _ = self.engine.load_checkpoint(
            str(path),
            tag=TAG,
            load_optimizer_states=True,
            load_lr_scheduler_states=False,
            load_module_strict=self.recipe.model.lora is None,  # a LoRA checkpoint holds adapters only
        )
        if loaded is None:
            raise UserError(f"checkpoint.resume: DeepSpeed found no checkpoint in {path / TAG}")
        self.scheduler.load_state_dict(resumed.state.scheduler)
        set_host_rng_state(torch.load(path / RNG_FILE.format(rank=dist.get_rank()), weights_only=True))
        if self._ema_to_load(resumed):
            wholes = read_whole(path)
            self._load_ema(lambda share: wholes[share.name])
