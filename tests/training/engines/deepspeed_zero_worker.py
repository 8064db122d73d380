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
from setdiff_megatron.sources.deepspeed import consolidated_state_dict
from setdiff_megatron.training.engines.deepspeed import DeepSpeedEngine
from setdiff_megatron.training.engines.deepspeed_config import build_optimizer
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
# Runs that also continue from their checkpoint in a new engine, for MORE_STEPS steps.
RESUMED = ("stage2_offload", "stage3")
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


def run(name: str, overrides: list[str], cfg, data, out_dir: Path) -> dict:
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
    if name in RESUMED:
        more = range(STEPS, STEPS + MORE_STEPS)
        result["continued"] = train(engine, data, more)
        engine = start(recipe, cfg)  # train.seed's weights again
        engine.load(Resumed(checkpoint, read_train_state(checkpoint)))
        result["resumed"] = train(engine, data, more)
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
    # Supervised records, two packed in a row (per-record positions and document ids), at ZeRO-2.
    records = batches(cfg, count=STEPS * NUM_MICROBATCHES, records=True)
    results["records_reference"] = reference_losses(recipe, cfg, records) if dist.get_rank() == 0 else None
    results["stage2_records"] = run("stage2_records", ["parallel.zero_stage=2"], cfg, records, out.parent)
    write_worker_results(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
