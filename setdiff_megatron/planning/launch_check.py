"""The plan checked before a GPU run starts: `setdiff train` and `setdiff launch` (--dry-run included)
print its one-line summary, and on GPUs refuse a run whose plan does not fit, naming the peak and
the fastest layout of the same GPUs that fits (`launch.check_memory: false` goes on anyway)."""

from __future__ import annotations

import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor

from setdiff_megatron.distributed.child_processes import exit_with_parent
from setdiff_megatron.errors import UserError
from setdiff_megatron.planning.devices import DEVICES, Device, device
from setdiff_megatron.recipes.schema import Recipe

__all__ = ["launch_plan", "this_device"]

DEFAULT_GPU = "h100-80gb"


def this_device() -> tuple[Device, str]:
    """This machine's GPU as a plan's device (the table's entry of its kind, its own memory), or
    the default device where there is none; with a note saying which."""
    import torch

    if not torch.cuda.is_available():
        return DEVICES[DEFAULT_GPU], f" (planned for {DEFAULT_GPU}: no GPU here; `setdiff plan --gpu` for another)"
    props = torch.cuda.get_device_properties(0)
    memory = props.total_memory / 2**30
    for key, known in DEVICES.items():
        if known.name.split()[0] in props.name:
            return device(key, memory_gib=memory), ""
    from setdiff_megatron.training.metric_sinks import peak_flops

    return device(props.name, memory_gib=memory, tflops=(peak_flops(props.name) or 1e12) / 1e12), ""


def launch_plan(recipe: Recipe, *, has_gpu: bool | None = None, gpu: Device | None = None) -> str | None:
    """The plan's summary for a GPU run (None for a CPU run), or a one-line refusal where the GPUs
    are here (`has_gpu`, detected by default) and it does not fit. `gpu`: the device planned for
    (default `this_device()`). Planned in a child process: the fake world's process group, megatron's
    groups and DeepSpeed's accelerator (its CPU one) must not stay behind in a process that trains next;
    the child exits with this process, however that one ends."""
    import torch

    has_gpu = torch.cuda.is_available() if has_gpu is None else has_gpu
    on_gpu = recipe.launch.device == "cuda" or (recipe.launch.device == "auto" and has_gpu)
    if not on_gpu:
        return None
    gpu, note = (gpu, "") if gpu is not None else this_device()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=spawn, initializer=exit_with_parent, initargs=(os.getpid(),)) as child:
        return child.submit(_summary_or_refusal, recipe, has_gpu, gpu).result() + note


def _summary_or_refusal(recipe: Recipe, has_gpu: bool, gpu: Device) -> str:
    from setdiff_megatron.distributed.megatron_cpu import prepare_megatron_import
    from setdiff_megatron.planning.plan import GIB, make_plan, nearest_fitting, search_layouts
    from setdiff_megatron.planning.plan_cli import plan_model_config

    prepare_megatron_import()
    cfg = plan_model_config(recipe, None)
    gpus, per_node = recipe.launch.world_size, recipe.launch.nproc_per_node
    plan = make_plan(recipe, cfg, gpus, gpu, gpus_per_node=per_node)
    if plan.fits or not has_gpu or not recipe.launch.check_memory:
        return plan.summary()
    others = [make_plan(r, cfg, gpus, gpu, gpus_per_node=per_node) for r in search_layouts(recipe, cfg, gpus)]
    best = nearest_fitting(others)
    instead = f"{best.layout} fits ({best.peak / GIB:.2f} GiB)" if best else "no layout of these GPUs fits"
    raise UserError(
        f"{recipe.name}: the plan's peak of {plan.peak / GIB:.2f} GiB per GPU at {plan.layout} exceeds the "
        f"{plan.budget / GIB:.2f} GiB usable on {gpu.name}; {instead}; set launch.check_memory=false to launch anyway"
    )
