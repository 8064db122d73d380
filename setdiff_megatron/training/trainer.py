"""The training loop: one for both engines, so every recipe field means the same under each.

    recipe -> checks (preflight.py) -> engine -> data -> model -> resume or init_from
           -> [forward/backward, optimizer step, metrics, validation, checkpoint] x steps

The loop decides the NaN and spike policies, fault handling, logging, validation, checkpoints,
preemption, the run directory's lock, resume and init_from; an engine owns only its model,
optimizer and steps (docs/training.md ("Training and checkpoints"), docs/fault-tolerance.md).
"""

from __future__ import annotations

import math
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import torch

from setdiff_megatron.checkpoint.identity import model_identity
from setdiff_megatron.checkpoint.resolve import resume_target
from setdiff_megatron.checkpoint.state import Progress
from setdiff_megatron.distributed import runtime
from setdiff_megatron.distributed.child_processes import ChildProcesses
from setdiff_megatron.distributed.fault_injection import Faults
from setdiff_megatron.distributed.ownership import owned
from setdiff_megatron.distributed.signals import PreemptionHandler
from setdiff_megatron.errors import UserError
from setdiff_megatron.log import say
from setdiff_megatron.recipes import Recipe, save_resolved_recipe
from setdiff_megatron.sources.read import fit_source, read_source
from setdiff_megatron.training import lr_schedule
from setdiff_megatron.training.checkpointer import Checkpointer
from setdiff_megatron.training.data_pipeline import DataLoaders, TrainingData, prepare_data
from setdiff_megatron.training.engines import Engine, start_engine
from setdiff_megatron.training.metric_sinks import MetricsLogger, peak_flops, step_metrics, training_flops_per_token
from setdiff_megatron.training.preflight import check_run
from setdiff_megatron.training.rollouts import Rollouts
from setdiff_megatron.training.spikes import SpikeDetector
from setdiff_megatron.training.stragglers import StragglerMonitor
from setdiff_megatron.training.watchdog import EVALUATION, ROLLBACK, STEP, Watchdog

__all__ = ["train", "TrainResult"]


@dataclass
class TrainResult:
    steps: int
    final_train_loss: float | None
    valid_losses: list[tuple[int, float]]
    checkpoint: Path | None
    tokens_per_s: float


def train(recipe: Recipe, recipe_path: str | Path = "<recipe>") -> TrainResult:
    check_run(recipe, recipe_path, world_size=runtime.world_size())
    children = ChildProcesses()
    with (
        owned(recipe.checkpoint.dir),
        PreemptionHandler(recipe.checkpoint.dir) as preemption,
        Watchdog.for_run(recipe, children) as watchdog,
    ):
        try:
            return _Run(recipe, start_engine(recipe), preemption, watchdog).loop()
        finally:
            children.end()
            runtime.shutdown()


class _Run:
    def __init__(self, recipe: Recipe, engine: Engine, preemption: PreemptionHandler, watchdog: Watchdog):
        self.recipe, self.engine, self.preemption, self.watchdog = recipe, engine, preemption, watchdog
        self.run_dir = Path(recipe.checkpoint.dir)
        self.first = runtime.rank() == 0
        self.total_steps = lr_schedule.total_steps(recipe)
        spikes = recipe.train.spike_policy
        self.spikes = SpikeDetector(spikes.window, spikes.threshold, spikes.min_history)
        self.rollbacks: list[int] = []
        """The steps whose spikes rolled the run back."""
        self.stragglers = StragglerMonitor(recipe.train.straggler_factor)
        self.faults = Faults.from_env(runtime.rank())

    # ---- set-up ----------------------------------------------------------------------------

    def _data(self) -> TrainingData:
        r = self.recipe
        steps = self.total_steps
        if r.train.spike_policy.action == "rollback":  # the steps replayed after rollbacks take new samples
            steps += r.train.spike_policy.max_rollbacks * r.checkpoint.interval
        return prepare_data(
            r,
            num_train_samples=steps * r.parallel.global_batch_size,
            num_valid_samples=r.eval.batches * r.parallel.global_batch_size,
            is_first_rank=self.first,
            barrier=runtime.barrier,
        )

    def _start(self) -> None:
        r, engine = self.recipe, self.engine
        self.data = self._data()
        tok = self.data.tokenizer
        self.model_cfg = r.model.to_model_config(vocab_size=tok.vocab_size, mask_token_id=tok.mask_id)
        self.identity = model_identity(self.model_cfg)
        resumed = resume_target(
            self.run_dir, r.checkpoint.resume, None if r.checkpoint.allow_model_change else self.identity
        )
        if self.first:  # only once the run directory is known to be this run's to write in
            save_resolved_recipe(r, self.run_dir)
        engine.build(self.model_cfg, self.total_steps)
        lora = r.model.lora is not None
        if r.model.init_from and (resumed is None or r.rl is not None or lora):
            source = read_source(r.model.init_from)
            start = fit_source(source, self.model_cfg, tok)
            # LoRA's frozen base, resumed or not: its checkpoints hold the adapters alone.
            if resumed is None or lora:
                engine.init_from(start, self.model_cfg)
                say(f"setdiff: {'LoRA adapters on' if lora else 'initialised from'} {source.describe()}")
        self.progress, self.resumed = Progress(), resumed
        if resumed is not None:
            engine.load(resumed)
            self.progress = Progress(**vars(resumed.state.progress))
            self.run_id = resumed.state.run_id or runtime.broadcast_object(uuid.uuid4().hex)
        else:
            self.run_id = runtime.broadcast_object(uuid.uuid4().hex)
        if r.rl is not None:  # RL's KL reference: the starting weights (with LoRA the base), resumed or not
            engine.set_reference(start, self.model_cfg)

    # ---- the loop --------------------------------------------------------------------------

    def _evaluate(self, batches) -> float | None:
        if not batches:
            return None
        with self.watchdog.phase(EVALUATION, self.progress.step):
            nll, count = self.engine.evaluate(batches)
        return nll / max(count, 1)

    def _step(self, logger: MetricsLogger, saves: Checkpointer) -> tuple[float, float | None] | None:
        """One optimizer step under the NaN and spike policies: the loss and the gradient norm, or
        None after a rollback, which leaves `progress` at the checkpoint's step."""
        engine, step = self.engine, self.progress.step + 1
        self.faults.at_step_start(step)
        batches = self.source.next_step()  # RL's rollouts decode here, outside the straggler's clock
        start = time.perf_counter()
        nll, count = engine.forward_backward(batches)
        self.faults.in_forward_backward()
        self.stragglers.add(time.perf_counter() - start - engine.sync_seconds)  # this rank's own work
        loss, grad_norm, problem, skipped = self.faults.loss(step, nll / max(count, 1)), None, None, True
        if not math.isfinite(loss):
            problem = f"loss is {loss}"
            skipped = engine.discard()
        elif (action := self._spiked(step, loss, logger, saves)) == "rolled back":
            return None
        elif action == "skipped":
            return loss, None
        else:
            self.spikes.accept(loss)
            outcome = engine.optimizer_step()
            grad_norm, problem = outcome.grad_norm, outcome.problem
        if problem is not None:
            if self.recipe.train.nan_policy == "stop":
                raise UserError(
                    f"{problem} at step {step}; stopping (train.nan_policy=stop). "
                    "Lower train.lr or raise train.warmup_steps; the last checkpoint is intact"
                )
            what = "step skipped" if skipped else "update applied (its gradients were finite)"
            logger.message(f"step {step}: {problem}, {what} (train.nan_policy=skip)")
            self.progress.skipped_steps += 1
        return loss, grad_norm

    def _spiked(self, step: int, loss: float, logger: MetricsLogger, saves: Checkpointer) -> str | None:
        """What the spike policy did to this step ("skipped", "rolled back"), or None: go on. The
        loss is the global batch's, equal on every rank, so every rank decides alike."""
        policy = self.recipe.train.spike_policy
        spike = self.spikes.check(loss)
        if spike is None:
            return None
        what = f"step {step}: {spike.describe()} (train.spike_policy.action={policy.action})"
        if policy.action == "warn":
            logger.message(f"{what}; update applied")
            return None
        if self.rollbacks and step <= self.rollbacks[-1]:
            raise UserError(
                f"{what}: a spike again at step {step} after rolling back for the one at step "
                f"{self.rollbacks[-1]}, on other data: it comes from the model's state, not a batch; "
                "stopping. Lower train.lr or resume from an earlier checkpoint (checkpoint.resume)"
            )
        if policy.action == "skip" or saves.last is None:
            self.engine.discard()
            self.progress.skipped_steps += 1
            logger.message(
                f"{what}; update skipped" + (" (no checkpoint to roll back to yet)" if saves.last is None else "")
            )
            return "skipped"
        if len(self.rollbacks) >= policy.max_rollbacks:
            raise UserError(
                f"{what}: train.spike_policy.max_rollbacks = {policy.max_rollbacks} rollbacks already "
                "done; stopping. Lower train.lr or raise train.spike_policy.max_rollbacks"
            )
        saves.wait(step=self.progress.step)
        self.engine.discard()
        with self.watchdog.phase(ROLLBACK, step):
            target = resume_target(self.run_dir, str(saves.last), None)
            self.engine.load(target)
        self.rollbacks.append(step)
        self.progress.step = target.state.progress.step
        self.progress.consumed_samples = self.source.consumed_samples  # past the bad batch
        logger.message(
            f"{what}; rolled back to the checkpoint of step {self.progress.step}, its data order "
            f"moved past the batches up to step {step} (rollback {len(self.rollbacks)} of "
            f"{policy.max_rollbacks})"
        )
        return "rolled back"

    def loop(self) -> TrainResult:
        self._start()
        r, engine, progress = self.recipe, self.engine, self.progress
        gbs, seq_len = r.parallel.global_batch_size, r.data.seq_len
        self.loaders = DataLoaders(
            r,
            self.data,
            dp_rank=engine.dp_rank,
            dp_size=engine.dp_size,
            consumed_samples=progress.consumed_samples,
            device=engine.device,
        )
        valid_batches = self.loaders.valid_batches(r.eval.batches)
        # Training batches: the data's, or with `rl` the model's own decodes (consumed: prompts).
        self.source = self.loaders
        if r.rl is not None:
            self.source = Rollouts(
                r, self.data, engine, dp_rank=engine.dp_rank, dp_size=engine.dp_size, consumed=progress.consumed_samples
            )
        logger = MetricsLogger(
            r.log,
            self.run_dir / "logs",
            total_steps=self.total_steps,
            start_step=progress.step,
            enabled=self.first,
            run_name=r.name,
            config=r.model_dump(mode="json"),
        )
        if self.resumed is not None:
            logger.message(f"resumed from {self.resumed.path} at step {progress.step}")
        flops_per_token = training_flops_per_token(self.model_cfg, seq_len)
        peak = peak_flops(torch.cuda.get_device_name() if engine.device.type == "cuda" else None)
        result = TrainResult(progress.step, None, [], self.resumed and self.resumed.path, 0.0)

        def validate() -> None:
            valid = self._evaluate(valid_batches)
            if valid is not None:
                result.valid_losses.append((progress.step, valid))
                logger.log(progress.step, {"valid/loss": valid})

        if progress.step == 0:
            validate()
        tokens_seen, train_time = 0, 0.0
        saved_step = progress.step if self.resumed is not None else None
        saves = Checkpointer(
            r,
            engine,
            self.identity,
            self.data.tokenizer,
            self.run_id,
            logger,
            last=self.resumed and self.resumed.path,
            watchdog=self.watchdog,
            faults=self.faults,
        )
        try:
            with self.watchdog.phase(STEP, progress.step + 1) as watchdog:
                while progress.step < self.total_steps:
                    watchdog.beat(progress.step + 1)
                    start = time.perf_counter()
                    stepped = self._step(logger, saves)
                    if stepped is None:  # rolled back
                        saved_step = progress.step
                        continue
                    loss, grad_norm = stepped
                    progress.step += 1
                    progress.consumed_samples = self.source.consumed_samples
                    elapsed = time.perf_counter() - start
                    tokens_seen += gbs * seq_len
                    train_time += elapsed
                    result.final_train_loss = loss
                    logger.advance()
                    last = progress.step == self.total_steps
                    if progress.step % r.log.interval == 0 or last:
                        metrics = step_metrics(
                            loss=loss,
                            lr=engine.lr(),
                            step_time_s=elapsed,
                            tokens=gbs * seq_len,
                            flops_per_token=flops_per_token,
                            world_size=runtime.world_size(),
                            peak=peak,
                        )
                        if grad_norm is not None:
                            metrics["train/grad_norm"] = grad_norm
                        ranks, straggler = self.stragglers.report()  # collective
                        rl = self.source.metrics if r.rl is not None else {}
                        logger.log(progress.step, metrics | ranks | engine.router_metrics() | rl)
                        if straggler is not None:
                            logger.message(f"step {progress.step}: {straggler}")
                    if progress.step % r.eval.interval == 0 or last:
                        validate()
                    saves.poll(progress.step)
                    if progress.step % r.checkpoint.interval == 0 or last:
                        saves.save(progress, background=r.checkpoint.async_save and not last)
                        saved_step = progress.step
                    if not last and self.preemption.agreed():  # every rank, every step boundary
                        if saved_step != progress.step:
                            saves.save(progress, background=False)
                        saves.wait(step=progress.step)
                        raise self.preemption.stop(progress.step, saves.last)
                saves.wait(step=progress.step)
        finally:
            logger.close()
        result.checkpoint = saves.last
        result.steps = progress.step
        result.tokens_per_s = tokens_seen / train_time if train_time else 0.0
        curve = ", ".join(f"{s}: {v:.3f}" for s, v in result.valid_losses)
        say(
            f"done: {result.steps} steps, {result.tokens_per_s:.0f} tokens/s; validation loss by step {{{curve}}}"
            if tokens_seen
            else f"done: the run was already at step {result.steps}; nothing to train"
        )
        say(f"checkpoint: {result.checkpoint}  logs: {self.run_dir / 'logs'} (metrics.jsonl, tensorboard/)")
        return result
