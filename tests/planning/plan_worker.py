"""Worker for test_plan.py: `python -m tests.planning.plan_worker OUT LAYOUT real|fake [RANK]`.

real (under torchrun, or one plain process): every rank measures its real training step with
LiveBytes and rank 0 writes all ranks' figures. fake: this process plans rank RANK of the
layout's world under fake tensors, with the attention this machine runs (not the kernel
stand-in), so that both count the same computation. One rank per process, as in a real job: a
process that built one rank keeps a few bytes of megatron's process-wide state for the next.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import warnings
from pathlib import Path

warnings.filterwarnings("ignore")

from setdiff_megatron.planning.cli import plan_model_config  # noqa: E402
from setdiff_megatron.planning.measure import measure_megatron_rank  # noqa: E402
from setdiff_megatron.recipes.loading import load_recipe  # noqa: E402

LAYOUTS = {
    "one": ("launch.nproc_per_node=1",),
    "tp2": ("launch.nproc_per_node=2", "parallel.tp=2", "parallel.sequence_parallel=true"),
    "pp2": ("launch.nproc_per_node=2", "parallel.pp=2", "parallel.micro_batch_size=4"),
    "dp2": ("launch.nproc_per_node=2", "parallel.micro_batch_size=4"),
    "moe-ep2": ("launch.nproc_per_node=2",),
}
COMMON = ("parallel.distributed_optimizer=true", "train.precision=fp32", "model.num_layers=4")


def recipe(layout: str):
    name = "tiny-moe-cpu.yaml" if layout.startswith("moe") else "tiny-cpu.yaml"
    return load_recipe(Path(__file__).parents[2] / "recipes" / name, [*COMMON, *LAYOUTS[layout]])


def main(out: Path, layout: str, mode: str, rank: str = "0") -> None:
    r = recipe(layout)
    cfg = plan_model_config(r, None)
    if mode == "fake":
        from setdiff_megatron.planning.fake_world import fake_rank

        with fake_rank(r.launch.world_size, int(rank)):
            out.write_text(json.dumps(dataclasses.asdict(measure_megatron_rank(r, cfg, fake=True))))
        return
    import torch.distributed as dist

    from setdiff_megatron.distributed.runtime import init_process_group

    init_process_group()
    mine = dataclasses.asdict(measure_megatron_rank(r, cfg, fake=False))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        out.write_text(json.dumps(every))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]), *sys.argv[2:])
