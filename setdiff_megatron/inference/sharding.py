"""Which batches of a job's examples this process does.

Examples are cut into batches of consecutive indices, and batch b belongs to shard b mod S,
S being the data-parallel ranks times the explicit shards (e.g. of a SLURM array). A batch is
therefore the same whatever the number of processes, and so are its results, including those
seeded per batch; a rerun does only the examples not yet written.
"""

from __future__ import annotations

from dataclasses import dataclass

from setdiff_megatron.distributed.runtime import Ranks
from setdiff_megatron.errors import UserError

__all__ = ["Placement", "Shard"]


@dataclass(frozen=True)
class Placement:
    """Where a sampling or evaluation job runs and how it batches: the options all of them share."""

    batch_size: int = 16
    tp: int = 1
    shard: int | None = None
    num_shards: int | None = None
    """Explicit shards (a SLURM array): this invocation does shard `shard` of `num_shards`."""
    device: str = "auto"
    dtype: str | None = None
    progress: bool = True
    compile: str = "auto"
    """Compiled static-shape decode steps (sampling/step_compiler.py COMPILE_MODES); TP=1 only."""

    def check(self) -> None:
        if self.batch_size < 1:
            raise UserError(f"--batch-size must be >= 1; got {self.batch_size}")
        if (self.shard is None) != (self.num_shards is None):
            raise UserError("--shard and --num-shards go together")
        if self.num_shards is not None and not 0 <= self.shard < self.num_shards:
            raise UserError(f"--shard must be in [0, --num-shards); got {self.shard} of {self.num_shards}")


@dataclass(frozen=True)
class Shard:
    index: int
    count: int

    @classmethod
    def of(cls, ranks: Ranks, placement: Placement) -> Shard:
        return cls(
            index=(placement.shard or 0) * ranks.dp_size + ranks.dp_rank,
            count=ranks.dp_size * (placement.num_shards or 1),
        )

    @property
    def name(self) -> str:
        return f"shard-{self.index:05d}-of-{self.count:05d}"

    def batches(self, num_examples: int, batch_size: int, done: set[int]) -> list[tuple[int, list[int]]]:
        """(first index of the batch, its indices not yet done) for each of this shard's batches with work left."""
        mine = []
        for number, first in enumerate(range(0, num_examples, batch_size)):
            todo = [i for i in range(first, min(first + batch_size, num_examples)) if i not in done]
            if number % self.count == self.index and todo:
                mine.append((first, todo))
        return mine
