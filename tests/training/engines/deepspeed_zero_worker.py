"""Two-rank worker (torchrun, gloo): the DeepSpeed engine's step at ZeRO stages 0-3 against
single-process training, and its checkpoints against the live weights.

Every rank builds the same weights (the engine's own build) and the same micro-batches
(tests/models/megatron_cases.py). Rank 0 first trains a plain torch copy on whole global batches; then
each stage trains through the DeepSpeedEngine on this rank's half, publishes a checkpoint as the
trainer does and compares checkpoint.deepspeed's consolidated_state_dict with the live fp32
weights; two of them go on training, and again from their checkpoint in a new engine. The JSON it writes holds
observations; test_deepspeed_engine.py holds the expectations.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

from setdiff_megatron.checkpoint.names import CHECKPOINTS, TOKENIZER_DIR
from setdiff_megatron.checkpoint.publish import publish
from setdiff_megatron.checkpoint.resolve import Resumed
from setdiff_megatron.checkpoint.state import Progress, TrainState, read_train_state, write_train_state
from setdiff_megatron.core.loss import set_diffusion_loss
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.sources.deepspeed_checkpoints import consolidated_state_dict
from setdiff_megatron.training.engines.deepspeed_config import build_optimizer
from setdiff_megatron.training.engines.deepspeed_engine import DeepSpeedEngine
from setdiff_megatron.training.lr_schedule import build_lr_scheduler
from tests.conftest import debug_config
from tests.models.megatron_cases import NUM_MICROBATCHES, ROOT, batches, write_worker_results

STEPS = 5
# (name, overrides): fp32 at every stage, activation recompute on two of them, optimizer offload,
# and a bf16 ZeRO-1 run (DeepSpeed's BF16_Optimizer) for its checkpoint only.
RUNS = [
    ("stage0", ["parallel.zero_stage=0"]),
    ("stage1", ["parallel.zero_stage=1"]),
    ("stage2", ["parallel.zero_stage=2", "train.recompute=selective"]),
    ("stage3", ["parallel.zero_stage=3", "train.recompute=full"]),
    ("stage2_offload", ["parallel.zero_stage=2", "parallel.offload_optimizer=true"]),
    ("stage1_bf16", ["parallel.zero_stage=1", "train.precision=bf16"]),
]
# The reference's training semantics (per-row loss, composer's DecoupledAdamW, an average of the
# weights), against reference_semantics below, at stage 0 and at ZeRO-2 (also resumed).
REFERENCE_SEMANTICS = [
    "train.loss_normalization=per_row",
    "train.optimizer=decoupled_adamw",
    f"train.ema_decay={(EMA_DECAY := 0.9)}",
]
SEMANTICS_RUNS = [
    ("stage0_reference", ["parallel.zero_stage=0", *REFERENCE_SEMANTICS]),
    ("stage2_reference", ["parallel.zero_stage=2", *REFERENCE_SEMANTICS]),
]
# Runs that also continue from their checkpoint in a new engine, for MORE_STEPS steps.
RESUMED = ("stage2_offload", "stage3", "stage2_reference")
MORE_STEPS = 2


class StubTokenizer:
    """What a checkpoint records of a tokenizer: its size, MASK id and files."""

    vocab_size, mask_id = 64, 63

    def save(self, directory: Path) -> None:
        directory.mkdir(parents=True)
        (directory / "tokenizer.json").write_text("{}")


def save(recipe, engine: DeepSpeedEngine, step: int) -> Path:
    """Collective: publish a checkpoint the way the trainer does (engine files, then rank 0's)."""

    def write(tmp: Path) -> None:
        engine.save(tmp)
        if dist.get_rank() == 0:
            write_train_state(
                tmp,
                TrainState(
                    progress=Progress(step=step),
                    scheduler=engine.scheduler_state(),
                    layout=engine.layout_record(),
                    model={},
                    run_id="worker",
                    tokenizer={"vocab_size": 64, "mask_id": 63},
                    ema=engine.ema_state(),
                ),
            )
            StubTokenizer().save(tmp / TOKENIZER_DIR)

    return publish(Path(recipe.checkpoint.dir) / CHECKPOINTS, step, write, run_id="worker")


def recipe_for(run_dir: Path, overrides: list[str]):
    cfg = debug_config()
    return load_recipe(
        ROOT / "recipes" / "tiny-cpu-deepspeed.yaml",
        [
            f"model.hidden_size={cfg.hidden_size}",
            f"model.num_layers={cfg.num_layers}",
            f"model.num_heads={cfg.num_heads}",
            f"model.num_kv_heads={cfg.num_kv_heads}",
            "model.intermediate_size=128",
            "parallel.micro_batch_size=2",
            "parallel.global_batch_size=8",
            f"train.steps={STEPS}",
            "train.warmup_steps=2",
            "train.lr=3e-3",
            "train.min_lr=3e-4",
            "train.weight_decay=0.1",
            "train.precision=fp32",
            f"checkpoint.dir={run_dir}",
            *overrides,
        ],
    )


def reference_losses(recipe, cfg, data) -> list[float]:
    """One process, whole global batches: per-token loss over the batch, clip, step."""
    torch.manual_seed(recipe.train.seed)  # the engine's initial weights
    model = SetDiffusionTransformer(cfg)
    optimizer = build_optimizer(recipe, model)
    scheduler = build_lr_scheduler(recipe, optimizer, STEPS)
    losses = []
    for step in range(STEPS):
        micro = data[step * NUM_MICROBATCHES : (step + 1) * NUM_MICROBATCHES]
        tokens = sum(b.loss_mask.sum() for b in micro).item()
        total = 0.0
        for b in micro:
            logits = model(b.clean_tokens, b.query_tokens, b.position_ids, b.valid_len, b.document_ids)
            nll = set_diffusion_loss(logits, b.targets, b.loss_mask, mask_token_id=cfg.mask_token_id).nll_sum.sum()
            (nll / tokens).backward()
            total += nll.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), recipe.train.clip_grad)
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step(increment=1)
        losses.append(total / tokens)
    return losses


def reference_semantics(recipe, cfg, data) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, whole global batches, the reference's semantics written out independently:
    its per-row loss (tests/core), clipping, composer's DecoupledAdamW update (the LR of each step
    from the recipe's schedule) and composer's EMA (the first step's weights, then decay x average
    + (1 - decay) x weights). The losses and the final average."""
    from tests.core.test_streams_and_loss import _reference_per_row_loss
    from tests.training.test_training_semantics import composer_step

    torch.manual_seed(recipe.train.seed)  # the engine's initial weights
    model = SetDiffusionTransformer(cfg)
    lr_of = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=recipe.train.lr)
    schedule = build_lr_scheduler(recipe, lr_of, STEPS)
    t, state, losses, average = recipe.train, {}, [], None
    for step in range(STEPS):
        micro = data[step * NUM_MICROBATCHES : (step + 1) * NUM_MICROBATCHES]
        rows = sum(b.loss_mask.shape[0] for b in micro)
        loss = 0.0
        for b in micro:
            logits = model(b.clean_tokens, b.query_tokens, b.position_ids, b.valid_len, b.document_ids)
            share = _reference_per_row_loss(logits, b, cfg.mask_token_id) * b.loss_mask.shape[0] / rows
            share.backward()
            loss += share.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_grad)
        params = dict(model.named_parameters())
        grads = {n: p.grad for n, p in params.items()}
        with torch.no_grad():
            lr = lr_of.param_groups[0]["lr"]
            composer_step(
                params, grads, state, lr=lr, initial_lr=t.lr, betas=t.betas, eps=t.eps, weight_decay=t.weight_decay
            )
        model.zero_grad()
        schedule.step(increment=1)
        weights = {n: p.detach().clone() for n, p in params.items()}
        average = (
            weights if average is None else {n: average[n] * EMA_DECAY + weights[n] * (1 - EMA_DECAY) for n in weights}
        )
        losses.append(loss)
    return losses, average


def full_fp32(engine: DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """Collective: the live fp32 weights (ZeRO's master copies, gathered), by parameter name."""
    ds = engine.engine
    if not ds.zero_optimization():
        return {n: p.detach().float().clone() for n, p in ds.module.named_parameters()}
    return {n: engine.deepspeed.utils.safe_get_full_fp32_param(p).clone() for n, p in ds.module.named_parameters()}


def train(engine: DeepSpeedEngine, data, steps: range) -> list[float]:
    """This rank's half of the global batch of each step in `steps`; the per-token losses."""
    half = NUM_MICROBATCHES // 2
    losses = []
    for step in steps:
        first = step * NUM_MICROBATCHES + dist.get_rank() * half
        nll, count = engine.forward_backward(data[first : first + half])
        assert engine.optimizer_step().applied
        losses.append(nll / count)
    return losses


def start(recipe, cfg) -> DeepSpeedEngine:
    engine = DeepSpeedEngine(recipe)
    engine.build(cfg, STEPS)
    return engine


def averages(engine: DeepSpeedEngine) -> dict[str, torch.Tensor]:
    """Collective: the engine's whole average of each weight."""
    return {s.name: whole.clone() for s, whole in engine.ema.wholes(engine._shares())}


def run(name: str, overrides: list[str], cfg, data, out_dir: Path, reference=None) -> dict:
    """`reference`: (losses, average) of reference_semantics, whose final average the checkpoint's
    is compared with."""
    start_time = time.perf_counter()
    recipe = recipe_for(out_dir / name, overrides)
    engine = start(recipe, cfg)
    result = {"losses": train(engine, data, range(STEPS)), "optimizer": type(engine.engine.optimizer).__name__}
    checkpoint = save(recipe, engine, STEPS)
    live = full_fp32(engine)
    if dist.get_rank() == 0:
        saved = consolidated_state_dict(checkpoint)
        result["keys_match"] = sorted(saved) == sorted(live)
        result["consolidated_diff"] = max((saved[k] - live[k]).abs().max().item() for k in live)
        result["dtypes"] = sorted({str(v.dtype) for v in saved.values()})
        if reference is not None:
            average = consolidated_state_dict(checkpoint, ema=True)
            result["ema_recorded"] = read_train_state(checkpoint).ema
            result["ema_keys_match"] = sorted(average) == sorted(live)
            result["ema_diff"] = max((average[k] - reference[1][k]).abs().max().item() for k in live)
            result["ema_not_weights"] = max((average[k] - live[k]).abs().max().item() for k in live)
    if name in RESUMED:
        more = range(STEPS, STEPS + MORE_STEPS)
        result["continued"] = train(engine, data, more)
        continued = averages(engine) if engine.ema is not None else {}
        engine = start(recipe, cfg)  # train.seed's weights again
        engine.load(Resumed(checkpoint, read_train_state(checkpoint)))
        result["resumed"] = train(engine, data, more)
        resumed = averages(engine) if engine.ema is not None else {}
        if continued:
            result["ema_resumed_bitwise"] = sorted(continued) == sorted(resumed) and all(
                torch.equal(continued[k], resumed[k]) for k in continued
            )
    result["seconds"] = time.perf_counter() - start_time
    return result


def main(out: Path) -> None:
    recipe = recipe_for(out.parent, [])
    DeepSpeedEngine(recipe)  # joins the process group; every run's engine reuses it
    cfg = recipe.model.to_model_config(vocab_size=StubTokenizer.vocab_size, mask_token_id=StubTokenizer.mask_id)
    data = batches(cfg, count=(STEPS + MORE_STEPS) * NUM_MICROBATCHES)
    results = {"reference": reference_losses(recipe, cfg, data) if dist.get_rank() == 0 else None}
    for name, overrides in RUNS:
        results[name] = run(name, overrides, cfg, data, out.parent)
    first = dist.get_rank() == 0
    reference = reference_semantics(recipe_for(out.parent, REFERENCE_SEMANTICS), cfg, data) if first else None
    results["semantics_reference"] = reference[0] if first else None
    for name, overrides in SEMANTICS_RUNS:
        results[name] = run(name, overrides, cfg, data, out.parent, reference)
    # Supervised records, two packed in a row (per-record positions and document ids), at ZeRO-2.
    records = batches(cfg, count=STEPS * NUM_MICROBATCHES, records=True)
    results["records_reference"] = reference_losses(recipe, cfg, records) if dist.get_rank() == 0 else None
    results["stage2_records"] = run("stage2_records", ["parallel.zero_stage=2"], cfg, records, out.parent)
    write_worker_results(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
