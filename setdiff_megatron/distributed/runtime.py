"""The process group and megatron-core's model-parallel groups, for every job that needs them.

Training, sampling, evaluation and conversion all start the same way: join the process group
torchrun or srun set up (a plain process is a world of one), on gloo where there is no GPU and
NCCL where there is, then, for the megatron model, build megatron-core's groups from a `Layout`
(with the CPU compatibility layer switched on first where there is no GPU). `Ranks` says where
this process sits for the jobs that shard work over data-parallel replicas.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from setdiff_megatron.distributed.layout import Layout
from setdiff_megatron.errors import UserError
from setdiff_megatron.log import rank  # re-exported: one answer to "which rank is this process"

__all__ = [
    "Ranks",
    "init_process_group",
    "init_model_parallel",
    "model_parallel_ranks",
    "join",
    "shutdown",
    "world_size",
    "rank",
    "check_port",
    "free_port",
    "barrier",
    "gather_objects",
    "broadcast_object",
    "tensor_parallel_broadcast",
]


def check_port(value: int | str, problem: str) -> None:
    """A UserError saying `problem` unless `value` is a TCP port (a whole number from 1 to 65535),
    checked before anything listens on it: torch's rendezvous and uvicorn report a port they
    cannot use with a traceback, late."""
    try:
        port = int(value)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        raise UserError(problem)


def free_port() -> int:
    """A free TCP port on 127.0.0.1, for a rendezvous or a local server that must not meet a
    lingering one."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def world_size() -> int:
    """The processes of this job, as the launcher announced them (1 without a launcher)."""
    return dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", "1"))


def init_process_group(*, timeout_minutes: int = 30) -> None:
    """Join the job's process group (gloo without a GPU, NCCL with one); idempotent."""
    if dist.is_initialized():
        return
    for key, value in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", str(29500 + os.getpid() % 1000)),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(key, value)  # a plain `python -m ...` is a world of one
    port = os.environ["MASTER_PORT"]
    check_port(port, f"MASTER_PORT={port!r} is not a TCP port (a whole number from 1 to 65535)")
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group(
        "nccl" if torch.cuda.is_available() else "gloo", timeout=datetime.timedelta(minutes=timeout_minutes)
    )


def init_model_parallel(layout: Layout, seed: int) -> None:
    """megatron-core's groups for `layout`, and its RNG streams seeded per TP rank. Without a GPU
    the CPU compatibility layer goes on first: megatron-core then runs over gloo."""
    from setdiff_megatron.distributed.megatron_cpu import auto_cpu_mode, model_parallel_seed, prepare_megatron_import

    prepare_megatron_import()
    auto_cpu_mode()
    init_process_group()
    if layout.world_size != world_size():
        raise UserError(
            f"the layout {layout.describe()} needs {layout.world_size} processes; this job has {world_size()}"
        )
    from megatron.core import parallel_state

    if parallel_state.model_parallel_is_initialized():
        held = (
            parallel_state.get_tensor_model_parallel_world_size(),
            parallel_state.get_pipeline_model_parallel_world_size(),
        )
        if held != (layout.tp, layout.pp):
            raise UserError(
                f"this process already holds model-parallel groups at tp {held[0]} pp {held[1]}; it cannot "
                f"build others at tp {layout.tp} pp {layout.pp}"
            )
    else:
        parallel_state.initialize_model_parallel(
            layout.tp,
            layout.pp,
            virtual_pipeline_model_parallel_size=layout.vpp,
            context_parallel_size=layout.cp,
            expert_model_parallel_size=layout.ep,
        )
    model_parallel_seed(seed)


def model_parallel_ranks() -> tuple[int, int]:
    """(tensor-parallel rank, pipeline-parallel rank) of this process in megatron-core's groups."""
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank()


def shutdown() -> None:
    """Tear down megatron-core's groups (if built) and the process group."""
    if "megatron.core" in sys.modules:
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass(frozen=True)
class Ranks:
    """Where this process sits in a sharded job: its data-parallel replica and whether it writes
    (the first rank of its TP group)."""

    rank: int = 0
    world_size: int = 1
    tp: int = 1
    dp_rank: int = 0
    dp_size: int = 1

    @property
    def writes(self) -> bool:
        return self.rank % self.tp == 0

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier()


def join(tp: int = 1) -> Ranks:
    """Join the job's process group, if it has several processes, and split it into TP x DP
    (megatron orders ranks TP-fastest, so a TP group is `tp` consecutive ranks)."""
    world = world_size()
    if tp < 1:
        raise UserError(f"--tp must be >= 1; got {tp}")
    if tp > world or world % tp:
        raise UserError(
            f"--tp {tp} needs a multiple of {tp} processes; this job has {world} "
            f"(start it with --nproc {tp} or torchrun --nproc_per_node {tp})"
        )
    if world == 1:
        return Ranks()
    init_process_group()
    me = dist.get_rank()
    return Ranks(rank=me, world_size=world, tp=tp, dp_rank=me // tp, dp_size=world // tp)


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


def gather_objects(obj) -> list:
    """`obj` of every rank, in rank order ([obj] without a process group)."""
    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0, group: dist.ProcessGroup | None = None):
    """Rank `src`'s `obj` (a global rank) on every rank of `group` (default: all of them)."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def tensor_parallel_broadcast(obj):
    """The `obj` of the first rank of this process's tensor-parallel group on every rank of that
    group: megatron-core's group, built by `init_model_parallel` like every other group."""
    from megatron.core import parallel_state

    return broadcast_object(
        obj, parallel_state.get_tensor_model_parallel_src_rank(), parallel_state.get_tensor_model_parallel_group()
    )
