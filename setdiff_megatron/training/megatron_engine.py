"""The megatron-core engine: a recipe in, a trained and checkpointed model out.

The wiring of megatron-core's parts, in the order they are built:
  process groups   torch.distributed (gloo on CPU, NCCL on GPUs) + parallel_state (tp, pp, vpp)
  data             data_pipeline: tokenizer, packed samples, two-stream micro-batches per DP rank
  model            models/megatron_model: this rank's chunks, wrapped in megatron DDP
  optimizer        get_megatron_optimizer (distributed optimizer when asked) + OptimizerParamScheduler
  step             get_forward_backward_func() (1F1B / interleaved) over the micro-batches of one
                   global batch, per-token loss normalisation, optimizer step, LR step
  around it        validation loss, metrics (console, TensorBoard, wandb), checkpoints, and a
                   checkpoint-and-exit (code 75) on SIGTERM/SIGUSR1 at a step boundary (signals.py)

On a machine without a GPU the CPU compatibility layer (megatron_cpu) is switched on first.
"""

from __future__ import annotations

import datetime
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from setdiff_megatron.errors import UserError
from setdiff_megatron.recipes import Recipe, save_resolved_recipe
from setdiff_megatron.recipes.validation import check_recipe, data_parallel_size
from setdiff_megatron.training import checkpointing, lr_schedule, signals
from setdiff_megatron.training.data_pipeline import DataLoaders, prepare_data
from setdiff_megatron.training.megatron_cpu import auto_cpu_mode, dist_backend, model_parallel_seed, quiet_known_warnings
from setdiff_megatron.training.metrics import MetricsLogger, peak_flops, step_metrics, training_flops_per_token

__all__ = ["train", "TrainResult"]

PRECISION = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class TrainResult:
    steps: int
    final_train_loss: float | None
    valid_losses: list[tuple[int, float]]
    checkpoint: Path | None
    tokens_per_s: float


def _init_distributed(recipe: Recipe) -> None:
    if not dist.is_initialized():
        # A plain `python -m setdiff_megatron.cli train` is a world of one.
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        dist.init_process_group(backend=dist_backend(), timeout=datetime.timedelta(minutes=30))
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    from megatron.core import parallel_state

    p = recipe.parallel
    parallel_state.initialize_model_parallel(p.tp, p.pp, virtual_pipeline_model_parallel_size=p.vpp)
    model_parallel_seed(recipe.train.seed)


def build_model(recipe: Recipe, model_cfg):
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads

    from setdiff_megatron.models.megatron_model import build_model_chunks, transformer_config_from

    t = recipe.train
    overrides = {}
    if t.fp8 is not None:
        overrides = dict(fp8=t.fp8, fp8_recipe=t.fp8_recipe)
    config = transformer_config_from(
        model_cfg, tp=recipe.parallel.tp, pp=recipe.parallel.pp, vpp=recipe.parallel.vpp,
        sequence_parallel=recipe.parallel.sequence_parallel, recompute=t.recompute,
        params_dtype=PRECISION[t.precision], **overrides,
    )
    config.finalize_model_grads_func = finalize_model_grads
    chunks = build_model_chunks(model_cfg, config, backend=recipe.model.backend)
    if torch.cuda.is_available():
        chunks = [c.cuda() for c in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=recipe.parallel.distributed_optimizer,
    )
    return config, [DistributedDataParallel(config, ddp_config, c) for c in chunks]


def build_optimizer(recipe: Recipe, chunks, total_steps: int):
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t = recipe.train
    opt_config = OptimizerConfig(
        optimizer="adam" if t.optimizer == "adamw" else "sgd", lr=t.lr, min_lr=t.min_lr,
        weight_decay=t.weight_decay, adam_beta1=t.betas[0], adam_beta2=t.betas[1], adam_eps=t.eps,
        clip_grad=t.clip_grad, bf16=t.precision == "bf16", fp16=t.precision == "fp16",
        params_dtype=PRECISION[t.precision], use_distributed_optimizer=recipe.parallel.distributed_optimizer,
    )
    optimizer = get_megatron_optimizer(opt_config, chunks)
    scheduler = lr_schedule.build_lr_scheduler(recipe, optimizer, total_steps)
    return optimizer, scheduler


class TrainStep:
    """One forward/backward over a list of micro-batches through megatron's pipeline schedule."""

    def __init__(self, recipe: Recipe, chunks):
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from setdiff_megatron.models.megatron_model import forward_step, pipeline_seq_length

        self.chunks, self.forward_step = chunks, forward_step
        self.schedule = get_forward_backward_func()
        self.seq_length = pipeline_seq_length(recipe.data.seq_len)
        self.micro_batch_size = recipe.parallel.micro_batch_size

    def __call__(self, batches, *, forward_only: bool) -> torch.Tensor:
        """[NLL sum, token count] of these micro-batches on this rank's last stage (else zeros)."""
        reports = self.schedule(
            forward_step_func=self.forward_step, data_iterator=[iter(batches) for _ in self.chunks],
            model=self.chunks, num_microbatches=len(batches), seq_length=self.seq_length,
            micro_batch_size=self.micro_batch_size, forward_only=forward_only,
        )
        total = torch.zeros(2, dtype=torch.float64)
        for report in reports or []:
            total += report["lm loss"].detach().double().cpu()
        return total


def _global_loss(local: torch.Tensor) -> torch.Tensor:
    """Sum [NLL, tokens] over every rank: only last-stage ranks hold nonzero values, one per DP
    replica per TP rank, so divide by TP (each TP rank of a replica reports the same loss)."""
    from megatron.core import parallel_state

    total = local.clone()
    dist.all_reduce(total)
    return total / parallel_state.get_tensor_model_parallel_world_size()


def train(recipe: Recipe, recipe_path: str | Path = "<recipe>") -> TrainResult:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_recipe(recipe, recipe_path, world_size=world)
    checkpointing.preflight(recipe)
    quiet_known_warnings()
    auto_cpu_mode()
    _init_distributed(recipe)
    with signals.PreemptionHandler(recipe.checkpoint.dir) as preemption:
        try:
            return _train(recipe, world, preemption)
        finally:
            from megatron.core import parallel_state

            parallel_state.destroy_model_parallel()
            if dist.is_initialized():
                dist.destroy_process_group()


def _train(recipe: Recipe, world: int, preemption: signals.PreemptionHandler) -> TrainResult:
    from megatron.core import parallel_state

    rank, run_dir = dist.get_rank(), Path(recipe.checkpoint.dir)
    is_logger = rank == world - 1  # a last pipeline stage, where the loss lives
    total_steps = lr_schedule.total_steps(recipe)
    dp_size, dp_rank = data_parallel_size(recipe, world), parallel_state.get_data_parallel_rank()
    gbs, seq_len = recipe.parallel.global_batch_size, recipe.data.seq_len

    if rank == 0:
        save_resolved_recipe(recipe, run_dir)
    data = prepare_data(recipe, num_train_samples=total_steps * gbs,
                        num_valid_samples=recipe.eval.batches * recipe.parallel.micro_batch_size * dp_size,
                        is_first_rank=rank == 0, barrier=dist.barrier)
    model_cfg = recipe.model.to_model_config(vocab_size=data.tokenizer.vocab_size, mask_token_id=data.tokenizer.mask_id)
    _, chunks = build_model(recipe, model_cfg)
    optimizer, scheduler = build_optimizer(recipe, chunks, total_steps)
    state = checkpointing.TrainState()
    resumed = checkpointing.maybe_resume(recipe, chunks, optimizer, scheduler, state, data.tokenizer)
    if resumed is None and recipe.model.init_from:
        from setdiff_megatron.hf.init_from import initialize_from

        initialize_from(recipe.model.init_from, chunks, model_cfg, data.tokenizer, recipe)
        optimizer.reload_model_params()  # the optimizer's main (fp32) params copy the loaded weights
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaders = DataLoaders(recipe, data, dp_rank=dp_rank, dp_size=dp_size,
                          consumed_samples=state.consumed_samples, device=device)
    step_fn = TrainStep(recipe, chunks)
    valid_batches = loaders.valid_batches(recipe.eval.batches)

    logger = MetricsLogger(recipe.log, run_dir / "logs", total_steps=total_steps, start_step=state.step,
                           enabled=is_logger, run_name=recipe.name, config=recipe.model_dump(mode="json"))
    if resumed is not None:
        logger.message(f"resumed from {resumed} at step {state.step}")
    flops_per_token = training_flops_per_token(model_cfg, seq_len)
    peak = peak_flops(torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    result = TrainResult(state.step, None, [], None, 0.0)

    def evaluate() -> float | None:
        if not valid_batches:
            return None
        for c in chunks:
            c.eval()
        with torch.no_grad():
            nll, count = _global_loss(step_fn(valid_batches, forward_only=True)).tolist()
        for c in chunks:
            c.train()
        return nll / max(count, 1)

    if state.step == 0:
        first = evaluate()
        if first is not None:
            result.valid_losses.append((0, first))
            logger.log(0, {"valid/loss": first})
    tokens_seen, train_time, grad_norm = 0, 0.0, None
    saved_step = state.step if resumed is not None else None
    try:
        while state.step < total_steps:
            start = time.perf_counter()
            batches = loaders.next_step()
            for c in chunks:
                c.zero_grad_buffer()
            optimizer.zero_grad()
            nll, count = _global_loss(step_fn(batches, forward_only=False)).tolist()
            loss = nll / max(count, 1)
            if not math.isfinite(loss):
                if recipe.train.nan_policy == "stop":
                    raise UserError(f"loss is {loss} at step {state.step + 1}; stopping (train.nan_policy=stop). "
                                    "Lower train.lr or raise train.warmup_steps; the last checkpoint is intact")
                logger.message(f"step {state.step + 1}: loss is {loss}, step skipped (train.nan_policy=skip)")
                state.skipped_steps += 1
            else:
                _, grad_norm, _ = optimizer.step()
                scheduler.step(increment=1)
            state.step += 1
            state.consumed_samples = loaders.consumed_samples
            elapsed = time.perf_counter() - start
            tokens_seen += gbs * seq_len
            train_time += elapsed
            result.final_train_loss = loss
            logger.advance()
            if state.step % recipe.log.interval == 0 or state.step == total_steps:
                metrics = step_metrics(loss=loss, lr=scheduler.get_lr(optimizer.param_groups[0]), step_time_s=elapsed,
                                       tokens=gbs * seq_len, flops_per_token=flops_per_token, world_size=world,
                                       peak=peak)
                metrics["train/grad_norm"] = float(grad_norm or 0.0)
                logger.log(state.step, metrics)
            if state.step % recipe.eval.interval == 0 or state.step == total_steps:
                valid = evaluate()
                if valid is not None:
                    result.valid_losses.append((state.step, valid))
                    logger.log(state.step, {"valid/loss": valid})
            if state.step % recipe.checkpoint.interval == 0 or state.step == total_steps:
                result.checkpoint = checkpointing.save(recipe, chunks, optimizer, scheduler, state, data.tokenizer)
                saved_step = state.step
            if state.step < total_steps and preemption.agreed():  # every rank, every step boundary
                if saved_step != state.step:
                    result.checkpoint = checkpointing.save(recipe, chunks, optimizer, scheduler, state, data.tokenizer)
                raise preemption.stop(state.step, result.checkpoint or resumed)
    finally:
        logger.close()
    result.steps = state.step
    result.tokens_per_s = tokens_seen / train_time if train_time else 0.0
    if is_logger:
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in result.valid_losses)
        print(f"done: {result.steps} steps, {result.tokens_per_s:.0f} tokens/s; validation loss by step {{{curve}}}")
        print(f"checkpoint: {result.checkpoint}  logs: {run_dir / 'logs'} (metrics.jsonl, tensorboard/)")
    return result
