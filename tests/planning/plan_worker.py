"""Worker for test_plan.py: `python -m tests.planning.plan_worker OUT real|fake LAYOUT [LAYOUT ...]`.

real (under torchrun at the layouts' world size, or one plain process for "one"): every rank
measures a real training step of each layout in turn with LiveBytes, and rank 0 writes every
rank's figures. fake: this one process plans every rank of each layout in turn under fake
tensors, with the attention this machine runs (not the kernel stand-in), so that both count the
same computation. Output: {layout: [figures of rank 0, rank 1, ...]}.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

from setdiff_megatron.planning.plan_cli import plan_model_config  # noqa: E402
from setdiff_megatron.recipes.recipe_files import load_recipe  # noqa: E402

LAYOUTS = {
    "one": ("launch.nproc_per_node=1",),
    "tp2": ("launch.nproc_per_node=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
    "pp2": ("launch.nproc_per_node=2", "parallel.pp=2", "parallel.micro_batch_size=4"),
    "dp2": ("launch.nproc_per_node=2", "parallel.micro_batch_size=4"),
    "moe-ep2": ("launch.nproc_per_node=2",),
    "zero2": ("launch.nproc_per_node=2", "parallel.micro_batch_size=4"),
}
COMMON = ("parallel.distributed_optimizer=true", "train.precision=fp32", "model.num_layers=4")


def recipe(layout: str):
    """tiny-cpu at each megatron layout (the distributed optimizer on), tiny-moe-cpu, and
    tiny-cpu-deepspeed (ZeRO-2)."""
    name = {"moe": "tiny-moe-cpu.yaml", "zer": "tiny-cpu-deepspeed.yaml"}.get(layout[:3], "tiny-cpu.yaml")
    common = COMMON[1:] if layout.startswith("zero") else COMMON
    return load_recipe(Path(__file__).parents[2] / "recipes" / name, [*common, *LAYOUTS[layout]])


def measure(recipe, fake: bool) -> dict:
    from setdiff_megatron.planning.measure import measure_megatron_rank
    from setdiff_megatron.planning.measure_deepspeed import measure_deepspeed_rank

    rank_of = measure_deepspeed_rank if recipe.engine == "deepspeed" else measure_megatron_rank
    return dataclasses.asdict(rank_of(recipe, plan_model_config(recipe, None), fake=fake))


def planned(layout: str) -> list[dict]:
    from setdiff_megatron.planning.fake_world import fake_rank

    r = recipe(layout)
    ranks = []
    for rank in range(r.launch.world_size):
        with fake_rank(r.launch.world_size, rank):
            ranks.append(measure(r, fake=True))
    return ranks


def measured(layout: str) -> list[dict]:
    import torch.distributed as dist
    from megatron.core import parallel_state

    r = recipe(layout)
    mine = measure(r, fake=False)
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    parallel_state.destroy_model_parallel()
    return every


def main(out: Path, mode: str, *layouts: str) -> None:
    if mode == "fake":
        out.write_text(json.dumps({layout: planned(layout) for layout in layouts}))
        return
    import torch.distributed as dist

    from setdiff_megatron.distributed.runtime import init_process_group

    init_process_group()
    results = {layout: measured(layout) for layout in layouts}
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
