"""Two-rank worker (torchrun, gloo): the megatron engine's training step from the DeepSpeed
engine's initial weights, for the engine-parity test.

It builds the megatron engine (process groups, DDP chunks with the distributed optimizer, its
optimizer and LR scheduler, the data pipeline at DP=2), loads the weights that the DeepSpeed
engine starts from (the torch model of train.seed, through init_from and the weight map) and
logs the loss of each step, and the validation loss after the last one. It also records the LR of every step of megatron's scheduler for
each schedule, for the LR-equality test, and how far a few steps of decoupled_adamw through
megatron's distributed optimizer are from composer's update. Arguments: OUT.json, then recipe overrides. megatron-core
is imported in `main`, so that the tests can import this module's constants cheaply.
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist

from setdiff_megatron.distributed.runtime import shutdown
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.training import lr_schedule
from setdiff_megatron.training.data_pipeline import DataLoaders, prepare_data
from tests.models.megatron_cases import ROOT

RECIPE = ROOT / "recipes" / "tiny-cpu-deepspeed.yaml"
# The megatron engine's counterpart of the recipe's ZeRO data parallelism.
AS_MEGATRON = ["engine=megatron", "parallel.zero_stage=0", "parallel.distributed_optimizer=true"]
SCHEDULES = ["cosine", "linear", "constant", "wsd"]
SCHEDULE_STEPS = 50


def schedule_lrs(overrides: list[str], chunks) -> dict[str, list[float]]:
    """The megatron engine's LR at every step of a 50-step run, per schedule."""
    from setdiff_megatron.training.engines.megatron_engine import build_optimizer

    out = {}
    for schedule in SCHEDULES:
        recipe = load_recipe(
            RECIPE,
            [
                *overrides,
                *AS_MEGATRON,
                f"train.schedule={schedule}",
                "train.warmup_steps=10",
                "train.min_lr=1e-4",
                "train.decay_fraction=0.3",
            ],
        )
        optimizer, scheduler = build_optimizer(recipe, chunks, SCHEDULE_STEPS)
        lrs = []
        for _ in range(SCHEDULE_STEPS):
            lrs.append(scheduler.get_lr(optimizer.param_groups[0]))
            scheduler.step(increment=1)
        out[schedule] = lrs
    return out


def decoupled_worst(overrides: list[str], chunks) -> float:
    """train.optimizer=decoupled_adamw through megatron's distributed optimizer (this rank's
    shards stepped, the weights gathered): the largest difference, over 6 steps of warm-up and
    decay with the same random gradients on every rank and no clipping, from composer's update."""
    from setdiff_megatron.training.engines.megatron_engine import build_optimizer
    from tests.training.test_training_semantics import DECOUPLED, composer_step

    recipe = load_recipe(RECIPE, [*overrides, *AS_MEGATRON, *DECOUPLED, "train.clip_grad=0"])
    optimizer, scheduler = build_optimizer(recipe, chunks, 6)
    params = {f"{i}.{n}": p for i, c in enumerate(chunks) for n, p in c.module.named_parameters()}
    expected = {n: p.detach().clone() for n, p in params.items()}
    state, gen, worst = {}, torch.Generator().manual_seed(1), 0.0
    for _ in range(6):
        grads = {n: torch.randn(p.shape, generator=gen) for n, p in params.items()}
        for n, p in params.items():
            p.main_grad.copy_(grads[n])
        lr = scheduler.get_lr(optimizer.param_groups[0])
        with torch.no_grad():
            optimizer.prepare_grads()
            optimizer.step_with_ready_grads()
        scheduler.step(increment=1)
        composer_step(expected, grads, state, lr=lr, initial_lr=1e-2, betas=(0.9, 0.98), eps=1e-8, weight_decay=0.05)
        worst = max(worst, max((p.detach() - expected[n]).abs().max().item() for n, p in params.items()))
    return worst


def main(out: Path, overrides: list[str]) -> None:
    from setdiff_megatron.training.engines.megatron_engine import MegatronEngine

    warnings.filterwarnings("ignore")
    recipe = load_recipe(RECIPE, [*overrides, *AS_MEGATRON])
    engine = MegatronEngine(recipe)
    steps = lr_schedule.total_steps(recipe)
    gbs, mbs = recipe.parallel.global_batch_size, recipe.parallel.micro_batch_size
    data = prepare_data(
        recipe,
        num_train_samples=steps * gbs,
        num_valid_samples=recipe.eval.batches * mbs * engine.dp_size,
        is_first_rank=dist.get_rank() == 0,
        barrier=dist.barrier,
    )
    cfg = recipe.model.to_model_config(vocab_size=data.tokenizer.vocab_size, mask_token_id=data.tokenizer.mask_id)
    engine.build(cfg, steps)
    torch.manual_seed(recipe.train.seed)  # the DeepSpeed engine's initial weights
    engine.init_from(SetDiffusionTransformer(cfg).state_dict(), cfg)
    loaders = DataLoaders(recipe, data, dp_rank=engine.dp_rank, dp_size=engine.dp_size)
    losses = []
    for _ in range(steps):
        nll, count = engine.forward_backward(loaders.next_step())
        engine.optimizer_step()
        losses.append(nll / count)
    valid, rows = engine.evaluate(loaders.valid_batches(recipe.eval.batches))
    results = {
        "losses": losses,
        "valid": valid / rows,
        "schedules": schedule_lrs(overrides, engine.chunks),
        "decoupled_worst": decoupled_worst(overrides, engine.chunks),
    }
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    shutdown()


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
