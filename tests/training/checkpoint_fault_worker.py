"""One rank of the kill -9 fault test (test_checkpoint_faults.py): resume, check, save in a loop.

Started as WORLD_SIZE processes (RANK, MASTER_ADDR, ... in the environment), it resumes through
the real `resume_target` and MegatronEngine.load with `resume: auto`, checks the loaded model
and Adam state against the fingerprint it wrote just before saving that step, prints
`RESUMED <step>`, then takes a synthetic optimizer step (gradients drawn from a generator seeded
by the step, the same on every rank) and saves as the trainer does, printing `SAVING <step>` and
`SAVED <step>` (for a background save: once it is published, during the next step's save),
until it is killed.

    python tests/training/checkpoint_fault_worker.py RUN_DIR [sync|async]
"""

import json
import os
import sys
from pathlib import Path

TINY = Path(__file__).parents[2] / "recipes" / "tiny-cpu.yaml"
TOTAL_STEPS = 100_000


# Imports live in the functions: megatron's checkpoint writer spawns a helper process that
# re-imports this file, and that should stay cheap.


def fingerprint(chunks, optimizer) -> list[float]:
    """Sums of this rank's weights and Adam moments: equal before the save and after the load."""
    weights = sum(p.detach().double().sum().item() for c in chunks for p in c.parameters())
    moments = sum(
        st[k].double().sum().item()
        for opt in optimizer.chained_optimizers
        for st in opt.optimizer.state.values()
        for k in ("exp_avg", "exp_avg_sq")
    )
    return [weights, moments]


def main(run_dir: Path, mode: str) -> int:
    import torch
    import torch.distributed as dist

    from setdiff_megatron.checkpoint.identity import model_identity
    from setdiff_megatron.checkpoint.names import step_of
    from setdiff_megatron.checkpoint.resolve import resume_target
    from setdiff_megatron.checkpoint.state import Progress
    from setdiff_megatron.data.tokenizers import train_byte_level_bpe
    from setdiff_megatron.recipes import load_recipe
    from setdiff_megatron.training.checkpointer import Checkpointer
    from setdiff_megatron.training.engines.megatron_engine import MegatronEngine
    from setdiff_megatron.training.metric_sinks import MetricsLogger

    world = int(os.environ["WORLD_SIZE"])
    recipe = load_recipe(
        TINY,
        [
            f"checkpoint.dir={run_dir}",
            f"launch.nproc_per_node={world}",
            "checkpoint.keep_last_n=2",
            f"train.steps={TOTAL_STEPS}",
        ],
    )
    engine = MegatronEngine(recipe)
    tokenizer = train_byte_level_bpe(["set diffusion language models decode several tokens at once"] * 8, 300)
    model_cfg = recipe.model.to_model_config(vocab_size=tokenizer.vocab_size, mask_token_id=tokenizer.mask_id)
    engine.build(model_cfg, TOTAL_STEPS)
    chunks, optimizer = engine.chunks, engine.optimizer
    rank, prints = dist.get_rank(), run_dir / "fingerprints"
    prints.mkdir(parents=True, exist_ok=True)
    identity, progress, run_id = model_identity(model_cfg), Progress(), "fault-worker"
    resumed = resume_target(run_dir, "auto", identity)
    if resumed is not None:
        engine.load(resumed)
        progress = resumed.state.progress
        expected = json.loads((prints / f"{resumed.path.name}.rank{rank}.json").read_text())
        if fingerprint(chunks, optimizer) != expected:
            print(f"MISMATCH {progress.step}", flush=True)
            return 3
    print(f"RESUMED {progress.step}", flush=True)
    quiet = MetricsLogger(
        recipe.log,
        run_dir / "logs",
        total_steps=TOTAL_STEPS,
        start_step=progress.step,
        enabled=False,
        run_name="fault-worker",
        config={},
    )
    saves = Checkpointer(recipe, engine, identity, tokenizer, run_id, quiet)
    while True:
        generator = torch.Generator().manual_seed(progress.step)
        for c in chunks:
            c.zero_grad_buffer()
            for p in c.parameters():
                p.main_grad.copy_(torch.randn(p.main_grad.shape, generator=generator))
        optimizer.step()
        engine.scheduler.step(increment=1)
        progress.step += 1
        record = prints / f"step_{progress.step:08d}.rank{rank}.json"
        record.with_suffix(".tmp").write_text(json.dumps(fingerprint(chunks, optimizer)))
        record.with_suffix(".tmp").replace(record)
        print(f"SAVING {progress.step}", flush=True)
        published = saves.last
        saves.save(progress, background=mode == "async")
        if saves.last != published:
            print(f"SAVED {step_of(saves.last)}", flush=True)


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "sync"))
