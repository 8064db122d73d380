"""The DeepSpeed engine: the torch model under ZeRO stage 0-3, trained from the same recipes as
the megatron engine.

The wiring, in the order it is built:
  process group    deepspeed_runtime.py: gloo on CPUs (DS_ACCELERATOR=cpu), NCCL on GPUs
  data             data_pipeline, one data-parallel rank per process: the megatron engine's
                   samples and orders (seeded by seed, data-parallel rank and consumed samples)
  model            models/torch_model with train.seed's weights (or model.init_from's),
                   activation checkpointing per train.recompute, wrapped by deepspeed.initialize
                   with deepspeed_config.py's config (ZeRO stage, optimizer offload, precision,
                   accumulation, clipping)
  step             the micro-batches of one global batch, the loss per target token of the whole
                   global batch (as megatron), one optimizer step, megatron-core's LR scheduler
  around it        validation loss, metrics.py, deepspeed_checkpointing.py, and a checkpoint-and-
                   exit (code 75) on SIGTERM/SIGUSR1 at a step boundary (signals.py)

Not here: tensor and pipeline parallelism (the megatron engine's), and building a model too big
for one device under deepspeed.zero.Init: every rank builds the full model, which ZeRO-3 then
partitions.
"""

from __future__ import annotations

import math
import os
import time
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint

from setdiff_megatron.core.loss import set_diffusion_loss
from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.recipes import Recipe, save_resolved_recipe
from setdiff_megatron.recipes.validation import check_recipe
from setdiff_megatron.training import checkpointing, deepspeed_checkpointing, lr_schedule, signals
from setdiff_megatron.training.data_pipeline import DataLoaders, prepare_data
from setdiff_megatron.training.deepspeed_config import build_optimizer, deepspeed_config
from setdiff_megatron.training.deepspeed_runtime import import_deepspeed, init_distributed
# The two engines must agree on the step count (it shapes the LR schedule) and report alike.
from setdiff_megatron.training.megatron_engine import TrainResult
from setdiff_megatron.training.metrics import MetricsLogger, peak_flops, step_metrics, training_flops_per_token

__all__ = ["train", "build_model", "build_engine", "TrainStep"]


def apply_recompute(model: SetDiffusionTransformer, mode: str) -> None:
    """train.recompute from outside the model: 'full' recomputes each transformer block in the
    backward pass, 'selective' each attention sub-layer (megatron recomputes only the core
    attention; the torch model has no smaller seam). Parameter names do not change."""
    if mode == "none":
        return
    for block in model.layers:
        module = block if mode == "full" else block.self_attn
        module.forward = partial(checkpoint, module.forward, use_reentrant=False)


def build_model(recipe: Recipe, model_cfg: ModelConfig) -> SetDiffusionTransformer:
    """The torch model with the weights of train.seed: every rank builds the same ones."""
    torch.manual_seed(recipe.train.seed)
    model = SetDiffusionTransformer(model_cfg)
    apply_recompute(model, recipe.train.recompute)
    if recipe.train.compile:
        model.compile()  # in place: the module, and so its parameter names, stay as they are
    return model


def initialize_from(model: SetDiffusionTransformer, path: str, model_cfg: ModelConfig, tokenizer) -> None:
    """model.init_from: trained weights (any source hf/sources.py reads) instead of train.seed's,
    loaded before DeepSpeed copies and partitions them. hf/init_from.py checks the tokenizer and
    the architecture, as for the megatron engine."""
    from setdiff_megatron.hf.init_from import fit_source
    from setdiff_megatron.hf.sources import read_source

    source = read_source(path)
    model.load_state_dict(fit_source(source, model_cfg, tokenizer))
    if dist.get_rank() == 0:
        print(f"setdiff: initialised from {source.describe()}", flush=True)


def build_engine(deepspeed, recipe: Recipe, model: SetDiffusionTransformer, dp_size: int):
    """The DeepSpeed engine around `model`, with the recipe's optimizer."""
    if recipe.parallel.zero_stage == 3 and model.lm_head is None:
        # The tied output layer reads embed_tokens.weight outside embed_tokens' forward: ZeRO-3
        # must gather it for the whole model's forward, not just the embedding's.
        deepspeed.zero.register_external_parameter(model, model.embed_tokens.weight)
    engine, *_ = deepspeed.initialize(model=model, optimizer=build_optimizer(recipe, model),
                                      config=deepspeed_config(recipe, dp_size))
    return engine


def _all_sum(local: torch.Tensor) -> torch.Tensor:
    total = local.clone()
    dist.all_reduce(total)
    return total


class TrainStep:
    """Forward and backward passes of this rank's micro-batches.

    megatron averages the loss over the target tokens of the whole global batch; DeepSpeed
    divides each micro-batch's loss by the accumulation steps and averages gradients over the
    data-parallel ranks. So a micro-batch contributes its NLL sum x (micro-batches x dp) / the
    global batch's target tokens, and the gradient is megatron's.
    """

    def __init__(self, engine, dp_size: int, mask_token_id: int):
        self.engine, self.dp_size, self.mask_token_id = engine, dp_size, mask_token_id
        self.device = engine.device

    def _nll(self, batch: TwoStreamBatch) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.engine(batch.clean_tokens, batch.query_tokens, batch.position_ids, batch.valid_len)
        out = set_diffusion_loss(logits, batch.targets, batch.loss_mask, mask_token_id=self.mask_token_id)
        return out.nll_sum.sum(), out.num_tokens.sum()

    def forward_backward(self, batches: list[TwoStreamBatch]) -> torch.Tensor:
        """[NLL sum, target tokens] of the global batch; gradients accumulated, no update yet."""
        tokens = _all_sum(sum(b.loss_mask.sum() for b in batches).double().reshape(1).to(self.device))
        scale = len(batches) * self.dp_size / max(tokens.item(), 1.0)
        local = torch.zeros(2, dtype=torch.float64, device=self.device)
        for i, batch in enumerate(batches):
            # One accumulation boundary per global batch, whatever DeepSpeed's micro-step count.
            self.engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
            nll, count = self._nll(batch)
            self.engine.backward(nll * scale)
            local += torch.stack([nll.detach().double(), count.double()])
        return _all_sum(local).cpu()

    def update(self) -> bool:
        """The optimizer step; False if DeepSpeed skipped it: its ZeRO optimizers skip an update
        whose gradient norm is not finite (and fp16 loss scaling one that overflowed)."""
        self.engine.step()
        return self.engine.was_step_applied()

    def discard(self) -> bool:
        """Drop this step's gradients; True if no update happened. A ZeRO optimizer keeps them
        in its own partitions, so it is stepped and skips non-finite ones (`update`); at stage 0
        they are plain .grad tensors."""
        if not self.engine.zero_optimization():
            self.engine.zero_grad()
            return True
        return not self.update()

    def evaluate(self, batches: list[TwoStreamBatch]) -> torch.Tensor:
        """[NLL sum, target tokens] of these micro-batches over all ranks, without gradients."""
        local = torch.zeros(2, dtype=torch.float64, device=self.device)
        self.engine.eval()
        with torch.no_grad():
            for batch in batches:
                nll, count = self._nll(batch)
                local += torch.stack([nll.double(), count.double()])
        self.engine.train()
        return _all_sum(local).cpu()


def train(recipe: Recipe, recipe_path: str | Path = "<recipe>") -> TrainResult:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_recipe(recipe, recipe_path, world_size=world)
    checkpointing.preflight(recipe)
    deepspeed = import_deepspeed(recipe)
    init_distributed(deepspeed)
    with signals.PreemptionHandler(recipe.checkpoint.dir) as preemption:
        try:
            return _train(deepspeed, recipe, world, preemption)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()


def _train(deepspeed, recipe: Recipe, world: int, preemption: signals.PreemptionHandler) -> TrainResult:
    rank, run_dir = dist.get_rank(), Path(recipe.checkpoint.dir)
    total_steps = lr_schedule.total_steps(recipe)
    gbs, seq_len = recipe.parallel.global_batch_size, recipe.data.seq_len

    if rank == 0:
        save_resolved_recipe(recipe, run_dir)
    data = prepare_data(recipe, num_train_samples=total_steps * gbs,
                        num_valid_samples=recipe.eval.batches * recipe.parallel.micro_batch_size * world,
                        is_first_rank=rank == 0, barrier=dist.barrier)
    model_cfg = recipe.model.to_model_config(vocab_size=data.tokenizer.vocab_size, mask_token_id=data.tokenizer.mask_id)
    resumed = deepspeed_checkpointing.resume_target(recipe, data.tokenizer)
    model = build_model(recipe, model_cfg)
    if resumed is None and recipe.model.init_from:
        initialize_from(model, recipe.model.init_from, model_cfg, data.tokenizer)
    engine = build_engine(deepspeed, recipe, model, world)
    scheduler = lr_schedule.build_lr_scheduler(recipe, engine.optimizer, total_steps)
    state = checkpointing.TrainState()
    if resumed is not None:
        deepspeed_checkpointing.load(resumed, recipe, engine, scheduler, state)
    loaders = DataLoaders(recipe, data, dp_rank=rank, dp_size=world, consumed_samples=state.consumed_samples,
                          device=engine.device)
    step_fn = TrainStep(engine, world, model_cfg.mask_token_id)
    valid_batches = loaders.valid_batches(recipe.eval.batches)

    logger = MetricsLogger(recipe.log, run_dir / "logs", total_steps=total_steps, start_step=state.step,
                           enabled=rank == 0, run_name=recipe.name, config=recipe.model_dump(mode="json"))
    if resumed is not None:
        logger.message(f"resumed from {resumed} at step {state.step}")
    flops_per_token = training_flops_per_token(model_cfg, seq_len)
    peak = peak_flops(torch.cuda.get_device_name() if engine.device.type == "cuda" else None)
    result = TrainResult(state.step, None, [], None, 0.0)

    def evaluate() -> float | None:
        if not valid_batches:
            return None
        nll, count = step_fn.evaluate(valid_batches).tolist()
        return nll / max(count, 1)

    def save() -> Path:
        return deepspeed_checkpointing.save(recipe, engine, scheduler, state, data.tokenizer)

    if state.step == 0:
        first = evaluate()
        if first is not None:
            result.valid_losses.append((0, first))
            logger.log(0, {"valid/loss": first})
    tokens_seen, train_time = 0, 0.0
    saved_step = state.step if resumed is not None else None
    try:
        while state.step < total_steps:
            start = time.perf_counter()
            nll, count = step_fn.forward_backward(loaders.next_step()).tolist()
            loss = nll / max(count, 1)
            # A non-finite loss is seen before the update; non-finite gradients of a finite loss
            # only by DeepSpeed, which then skips the update (megatron would apply it and meet
            # a non-finite loss a step later). fp16 overflow skips are loss scaling at work.
            problem = None
            if not math.isfinite(loss):
                problem = f"loss is {loss}"
            elif not step_fn.update() and recipe.train.precision != "fp16":
                problem = "the gradients are not finite"
            if problem is None:
                scheduler.step(increment=1)
            elif recipe.train.nan_policy == "stop":
                raise UserError(f"{problem} at step {state.step + 1}; stopping (train.nan_policy=stop). "
                                "Lower train.lr or raise train.warmup_steps; the last checkpoint is intact")
            else:
                outcome = "skipped" if math.isfinite(loss) or step_fn.discard() else "applied (finite gradients)"
                logger.message(f"step {state.step + 1}: {problem}, step {outcome} (train.nan_policy=skip)")
                state.skipped_steps += 1
            state.step += 1
            state.consumed_samples = loaders.consumed_samples
            elapsed = time.perf_counter() - start
            tokens_seen += gbs * seq_len
            train_time += elapsed
            result.final_train_loss = loss
            logger.advance()
            if state.step % recipe.log.interval == 0 or state.step == total_steps:
                metrics = step_metrics(loss=loss, lr=scheduler.get_lr(engine.optimizer.param_groups[0]),
                                       step_time_s=elapsed, tokens=gbs * seq_len, flops_per_token=flops_per_token,
                                       world_size=world, peak=peak)
                if engine.get_global_grad_norm() is not None:  # stage 0 in fp32 does not report it
                    metrics["train/grad_norm"] = float(engine.get_global_grad_norm())
                logger.log(state.step, metrics)
            if state.step % recipe.eval.interval == 0 or state.step == total_steps:
                valid = evaluate()
                if valid is not None:
                    result.valid_losses.append((state.step, valid))
                    logger.log(state.step, {"valid/loss": valid})
            if state.step % recipe.checkpoint.interval == 0 or state.step == total_steps:
                result.checkpoint, saved_step = save(), state.step
            if state.step < total_steps and preemption.agreed():  # every rank, every step boundary
                if saved_step != state.step:
                    result.checkpoint = save()
                raise preemption.stop(state.step, result.checkpoint or resumed)
    finally:
        logger.close()
    result.steps = state.step
    result.tokens_per_s = tokens_seen / train_time if train_time else 0.0
    if rank == 0:
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in result.valid_losses)
        print(f"done: {result.steps} steps, {result.tokens_per_s:.0f} tokens/s; validation loss by step {{{curve}}}")
        print(f"checkpoint: {result.checkpoint}  logs: {run_dir / 'logs'} (metrics.jsonl, tensorboard/)")
    return result
