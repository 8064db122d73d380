"""An exponential moving average of the weights (train.ema_decay), as the reference keeps one.

As composer's EMA: the weights after the first optimizer step are copied, then after every step
average = decay x average + (1 - decay) x weights, with no warm-up or bias correction. Each rank
averages its share of the optimizer's fp32 weights, so the average is split as the optimizer
state is; a parameter's whole average is gathered only to save or to evaluate
(docs/training.md, "The reference's training semantics").
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

__all__ = ["Share", "WeightAverage"]


@dataclass(frozen=True)
class Share:
    """One parameter's part of the optimizer's fp32 weights on this rank."""

    name: str
    """A key that names the parameter alike on every rank and at every step."""
    param: torch.nn.Parameter
    """The model's parameter, which evaluation overwrites with the average."""
    shape: torch.Size
    """The parameter's shape on this rank (its tensor- and pipeline-parallel part)."""
    main: torch.Tensor | None
    """The fp32 values the optimizer steps: the whole parameter, or a 1-D shard of the flattened
    parameter; None when this rank holds none of it."""
    start: int = 0
    """Where `main` begins in the flattened parameter."""
    group: dist.ProcessGroup | None = None
    """The ranks whose shares make the whole parameter; None: `main` is all of it."""

    @property
    def size(self) -> int:
        """How many of `main`'s values are the parameter's (a ZeRO-3 shard may end in padding)."""
        if self.main is None:
            return 0
        return max(0, min(self.main.numel(), self.shape.numel() - self.start))


class WeightAverage:
    """The average of this rank's shares, keyed by share name; empty until the first update."""

    def __init__(self, decay: float):
        self.decay = decay
        self.averages: dict[str, torch.Tensor] = {}
        self.started = False
        """Whether a step (or a checkpoint) has given it weights."""

    @torch.no_grad()
    def update(self, shares: list[Share]) -> None:
        """After an optimizer step: the first copies the weights, each later one averages them in
        with composer's expression (in fp32)."""
        if not self.started:
            self.averages = {s.name: s.main.detach().float().clone() for s in shares if s.main is not None}
            self.started = True
            return
        for s in shares:
            if s.main is not None:
                average = self.averages[s.name]
                average.copy_(average * self.decay + s.main * (1.0 - self.decay))

    @torch.no_grad()
    def whole(self, share: Share) -> torch.Tensor:
        """The parameter's whole average in fp32, at its shape; collective over `share.group`:
        every rank of the group writes its part into zeros and the group sums them, which is
        exact."""
        if share.group is None:
            return self.averages[share.name].view(share.shape)
        device = share.param.device
        whole = torch.zeros(share.shape.numel(), dtype=torch.float32, device=device)
        if share.size:
            whole[share.start : share.start + share.size] = self.averages[share.name][: share.size]
        dist.all_reduce(whole, group=share.group)
        return whole.view(share.shape)

    def wholes(self, shares: list[Share]) -> Iterator[tuple[Share, torch.Tensor]]:
        """Each share with its whole average, in order (every rank of a group in the same order)."""
        for share in shares:
            yield share, self.whole(share)

    @torch.no_grad()
    def load(self, shares: list[Share], whole: Callable[[Share], torch.Tensor]) -> None:
        """Take this rank's part of each parameter's whole average (`whole`, from a checkpoint)."""
        averages = {}
        for s in shares:
            if s.main is None:
                continue
            part = torch.zeros_like(s.main, dtype=torch.float32)
            part[: s.size] = whole(s).to(part.device).flatten()[s.start : s.start + s.size]
            averages[s.name] = part
        self.averages, self.started = averages, True

    @contextlib.contextmanager
    def swapped_in(self, shares: list[Share]) -> Iterator[None]:
        """The model's parameters hold the average (in their dtype) inside, their own values after
        (collective: evaluation on every rank)."""
        kept = []
        with torch.no_grad():
            for share, whole in self.wholes(shares):
                kept.append(share.param.detach().clone())
                share.param.copy_(whole)
        try:
            yield
        finally:
            with torch.no_grad():
                for share, own in zip(shares, kept):
                    share.param.copy_(own)

    def record(self) -> dict | None:
        """What train_state.json says of it: the decay, or None before the first update."""
        return {"decay": self.decay} if self.started else None
