"""One rank of a world that is not here: torch.distributed on its `fake` backend (every
collective returns at once) at the full world size, and megatron-core's process groups built on
it, so that the rank's model chunks, DDP buffers and optimizer shards are the ones it would build.

Two things megatron-core does at build time do not run on the fake backend, and are stood in for
while the world lasts: its gloo side groups (used only to save the distributed optimizer) are made
on the fake backend too, and `all_gather_object` (the optimizer's check that every rank built the
same parameter groups) returns this rank's object from every rank, which is what it checks.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from unittest import mock

import torch.distributed as dist

__all__ = ["fake_rank"]


@contextlib.contextmanager
def fake_rank(world_size: int, rank: int) -> Iterator[None]:
    """Be `rank` of `world_size` until the block ends; megatron-core's groups are then gone."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from setdiff_megatron.distributed.megatron_cpu import auto_cpu_mode, prepare_megatron_import

    if dist.is_initialized():
        raise RuntimeError("a plan is made in a process that has not joined a process group")
    prepare_megatron_import()  # before megatron-core is imported
    auto_cpu_mode()
    from megatron.core import parallel_state

    create_group = parallel_state.create_group

    def fake_side_group(*args, backend=None, **kwargs):
        return create_group(*args, **kwargs)

    def local_object(out: list, obj, group=None) -> None:
        out[:] = [obj] * len(out)

    env = {"WORLD_SIZE": str(world_size), "RANK": str(rank), "LOCAL_RANK": "0"}
    with (
        mock.patch.dict(os.environ, env),
        mock.patch.object(parallel_state, "create_group", fake_side_group),
        mock.patch.object(dist, "all_gather_object", local_object),
    ):
        dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
        try:
            yield
        finally:
            parallel_state.destroy_model_parallel()
            dist.destroy_process_group()
