"""What the training loop needs from an engine, and nothing more.

The loop (trainer.py) owns everything a recipe means the same under both engines: data and
orders, the NaN policy, logging, validation and checkpoint intervals, preemption, `init_from`
and resume selection. An engine owns the model, optimizer and LR scheduler it builds, and how
they run and how their files are written and read.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

from setdiff_megatron.checkpoint.resolve import Resumed
from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.models.config import ModelConfig

__all__ = ["Engine", "StepOutcome", "evaluating", "fill_torch_optimizer_state"]


@contextmanager
def evaluating(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """The model in eval mode for the block (RL's rollouts and their scoring), back in the mode
    it was in afterwards, however the block ends."""
    was = model.training
    model.eval()
    try:
        yield model
    finally:
        model.train(was)


@dataclass(frozen=True)
class StepOutcome:
    applied: bool
    """Whether the parameters were updated (and the LR scheduler stepped)."""
    grad_norm: float | None
    problem: str | None = None
    """Why the update was refused ('the gradients are not finite'), for the NaN policy; None when it
    was applied, or skipped by fp16 loss scaling, which is not a problem."""


class Engine(Protocol):
    name: str
    dp_rank: int
    dp_size: int
    device: torch.device
    sync_seconds: float
    """How long the last forward_backward waited in collectives for other ranks (gradient and loss
    reductions), which the straggler report subtracts to get the rank's own work."""

    def build(self, model_cfg: ModelConfig, total_steps: int) -> None:
        """Build this rank's model, optimizer and LR scheduler (weights from the recipe's seed)."""

    def init_from(self, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
        """Replace the initial weights with a source's torch weights (model.init_from)."""

    def forward_backward(self, batches: list[TwoStreamBatch]) -> tuple[float, float]:
        """Gradients of this rank's micro-batches of one global batch; returns the global batch's
        [weighted NLL sum, denominator]: the loss is their ratio, normalised per target token or
        per row as train.loss_normalization says (training/objective.py)."""

    def optimizer_step(self) -> StepOutcome:
        """Update from the accumulated gradients, unless they are not finite."""

    def discard(self) -> bool:
        """Drop this step's gradients without an update; False if the engine updated anyway."""

    def evaluate(self, batches: list[TwoStreamBatch]) -> tuple[float, float]:
        """[weighted NLL sum, denominator] of these micro-batches over all ranks, without
        gradients, normalised as training is; with the EMA's weights when the run keeps one."""

    def router_metrics(self) -> dict[str, float | list[float]]:
        """Collective: the last step's MoE routing (training/expert_load.py); empty for dense models."""

    def lr(self) -> float: ...

    def layout_record(self) -> dict:
        """The parallel layout as a checkpoint records it."""

    def scheduler_state(self) -> dict: ...

    def ema_state(self) -> dict | None:
        """What train_state.json records of the average of the weights its files hold
        (training/ema.py), or None: no average (train.ema_decay unset, or no step yet)."""

    def save(self, directory: Path) -> None:
        """Collective: write this rank's engine files (weights, optimizer, RNG, the average of the
        weights) into `directory`."""

    def start_save(self, directory: Path, then: Callable[[], None]) -> None:
        """Collective: start writing this rank's engine files into `directory` in the background
        (a snapshot of now); `then` runs on every rank once every rank's files are written, from
        `finish_saves`. Engines that cannot save in the background raise UserError."""

    def finish_saves(self, *, blocking: bool) -> bool:
        """Collective: complete the background saves whose files are all written (waiting for them
        with `blocking`); True when none is left in flight."""

    def load(self, resumed: Resumed) -> None:
        """Collective: restore weights, optimizer, scheduler, RNG and the average of the weights,
        or refuse with the reason."""


def fill_torch_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """The state a torch optimizer's first update would create, for every parameter that lacks
    it: Adam's step and moments, SGD's momentum. A sharded load fills existing tensors in place
    (megatron engine), and setdiff plan counts the state before any update (planning/)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if isinstance(optimizer, torch.optim.SGD):
                if group["momentum"] and "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p.data)
            elif "exp_avg" not in state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p.data)
                state["exp_avg_sq"] = torch.zeros_like(p.data)
