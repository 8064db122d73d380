"""DeepSpeed brought up for the DeepSpeed engine: the accelerator chosen before the import, quiet
logs, and the process group (gloo on CPUs, NCCL on GPUs) without the shared-memory op that
DeepSpeed's CPU backend would otherwise compile at start.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib
import logging
import os
import warnings
from typing import Iterator

import torch

from setdiff_megatron.errors import require
from setdiff_megatron.recipes import Recipe

__all__ = ["import_deepspeed", "init_distributed"]


def import_deepspeed(recipe: Recipe):
    """DeepSpeed, with its CPU accelerator where the run has no GPU (picked before the import,
    which fixes the accelerator) and its INFO logging off (metrics.py reports progress)."""
    if recipe.launch.device == "cpu" or not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    deepspeed = require("deepspeed", "deepspeed", "engine: deepspeed")
    deepspeed.utils.logger.setLevel(logging.WARNING)
    # ZeRO calls a collective that torch deprecates; nothing a user of this engine can act on.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.all_gather_into_tensor` is deprecated")
    return deepspeed


@contextlib.contextmanager
def _no_shared_memory_op(accelerator) -> Iterator[None]:
    """DeepSpeed's CPU backend JIT-compiles a shared-memory all-reduce when it starts (C++; over
    four minutes on a fresh 2-core machine, and it needs a compiler). Only its inference
    all-reduce uses it, so training starts without building it."""
    ds_comm = importlib.import_module("deepspeed.comm.torch")  # `deepspeed.comm.torch` is also torch itself
    build = ds_comm.build_shm_op
    if accelerator.device_name() == "cpu":
        ds_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm.build_shm_op = build


def init_distributed(deepspeed) -> None:
    from deepspeed.accelerator import get_accelerator

    # A plain `python -m setdiff_megatron.cli train` is a world of one.
    for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
                       ("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
        os.environ.setdefault(key, value)
    accelerator = get_accelerator()
    if accelerator.device_name() != "cpu":
        accelerator.set_device(int(os.environ["LOCAL_RANK"]))
    with _no_shared_memory_op(accelerator):
        deepspeed.init_distributed(dist_backend=accelerator.communication_backend_name(),
                                   timeout=datetime.timedelta(minutes=30))
