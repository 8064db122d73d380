"""What the training loop needs from an engine, and the body both engines share.

The loop (trainer.py) owns everything a recipe means the same under both engines: data and
orders, the NaN policy, logging, validation and checkpoint intervals, preemption, `init_from`
and resume selection. An engine owns the model, optimizer and LR scheduler it builds, and how
they run and how their files are written and read; the average of the weights' life is `Engine`'s.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.checkpoint.resolve import Resumed
from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.log import say
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.recipes import Recipe
from setdiff_megatron.training.expert_load import ExpertLoad
from setdiff_megatron.training.weight_average import Share, WeightAverage

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


class Engine(ABC):
    """An engine as the loop drives it, with the body both engines share.

    Each engine supplies its parts (`_shares` among them); the average of the weights' life is
    here: built from the recipe, updated after an applied step, swapped in for validation, saved
    and resumed."""

    name: str
    recipe: Recipe
    dp_rank: int
    dp_size: int
    device: torch.device
    sync_seconds: float
    """How long the last forward_backward waited in collectives for other ranks (gradient and loss
    reductions), which the straggler report subtracts to get the rank's own work."""
    scheduler: Any
    """The LR scheduler (training/lr_schedule.py)."""
    expert_load: ExpertLoad | None = None
    """The MoE routing statistics; None for dense models."""
    ema: WeightAverage | None = None
    """The average of the weights (train.ema_decay, training/weight_average.py), from `build`; None without one."""

    @abstractmethod
    def build(self, model_cfg: ModelConfig, total_steps: int) -> None:
        """Build this rank's model, optimizer and LR scheduler (weights from the recipe's seed)."""

    @abstractmethod
    def init_from(self, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
        """Replace the initial weights with a source's torch weights (model.init_from)."""

    @abstractmethod
    def forward_backward(self, batches: list[TwoStreamBatch]) -> tuple[float, float]:
        """Gradients of this rank's micro-batches of one global batch; returns the global batch's
        [weighted NLL sum, denominator]: the loss is their ratio, normalised per target token or
        per row as train.loss_normalization says (training/objective.py)."""

    @abstractmethod
    def optimizer_step(self) -> StepOutcome:
        """Update from the accumulated gradients, unless they are not finite."""

    @abstractmethod
    def discard(self) -> bool:
        """Drop this step's gradients without an update; False if the engine updated anyway."""

    @abstractmethod
    def evaluate(self, batches: list[TwoStreamBatch]) -> tuple[float, float]:
        """[weighted NLL sum, denominator] of these micro-batches over all ranks, without
        gradients, normalised as training is; with the EMA's weights when the run keeps one."""

    @abstractmethod
    def lr(self) -> float: ...

    @abstractmethod
    def layout_record(self) -> dict:
        """The parallel layout as a checkpoint records it."""

    @abstractmethod
    def save(self, directory: Path) -> None:
        """Collective: write this rank's engine files (weights, optimizer, RNG, the average of the
        weights) into `directory`."""

    @abstractmethod
    def start_save(self, directory: Path, then: Callable[[], None]) -> None:
        """Collective: start writing this rank's engine files into `directory` in the background
        (a snapshot of now); `then` runs on every rank once every rank's files are written, from
        `finish_saves`. Engines that cannot save in the background raise UserError."""

    @abstractmethod
    def finish_saves(self, *, blocking: bool) -> bool:
        """Collective: complete the background saves whose files are all written (waiting for them
        with `blocking`); True when none is left in flight."""

    @abstractmethod
    def load(self, resumed: Resumed) -> None:
        """Collective: restore weights, optimizer, scheduler, RNG and the average of the weights,
        or refuse with the reason."""

    @abstractmethod
    def _shares(self) -> list[Share]:
        """Each parameter's fp32 weights that the optimizer steps on this rank (training/weight_average.py).

        In an order every rank of a data-parallel group shares."""

    def router_metrics(self) -> dict[str, float | list[float]]:
        """Collective: the last step's MoE routing (training/expert_load.py); empty for dense models."""
        return {} if self.expert_load is None else self.expert_load.metrics()

    def scheduler_state(self) -> dict:
        return self.scheduler.state_dict()

    # ---- the average of the weights ----------------------------------------------------------

    def _start_ema(self) -> None:
        """The recipe's average of the weights (none without train.ema_decay), empty until a step."""
        t = self.recipe.train
        self.ema = WeightAverage(t.ema_decay) if t.ema else None

    def _update_ema(self) -> None:
        """After an applied optimizer step (never a skipped one)."""
        if self.ema is not None:
            self.ema.update(self._shares())

    def _ema_weights(self) -> AbstractContextManager:
        """Collective: the model holds the average inside once there is one, its own weights after."""
        return self.ema.swapped_in(self._shares()) if self.ema and self.ema.started else nullcontext()

    def ema_state(self) -> dict | None:
        """What train_state.json records of the average of the weights its files hold
        (training/weight_average.py), or None: no average (train.ema_decay unset, or no step yet)."""
        return self.ema.record() if self.ema is not None else None

    def _ema_wholes(self) -> Iterator[tuple[Share, torch.Tensor]]:
        """Collective: each share with its parameter's whole average, to save (ema_state not None)."""
        return self.ema.wholes(self._shares())

    def _ema_to_load(self, resumed: Resumed) -> bool:
        """Whether a resume loads the checkpoint's average of the weights.

        Says so when the recipe and the checkpoint disagree on keeping one."""
        saved = resumed.state.ema is not None
        if saved and self.ema is None:
            say(f"setdiff: {resumed.path} holds an EMA of the weights; train.ema_decay is unset, so it is not kept")
        elif self.ema is not None and not saved:
            say(f"setdiff: {resumed.path} holds no EMA of the weights; it starts from the weights after the next step")
        return saved and self.ema is not None

    def _load_ema(self, whole: Callable[[Share], torch.Tensor]) -> None:
        """Take this rank's part of each parameter's whole average, `whole(share)`, from a checkpoint."""
        self.ema.load(self._shares(), whole)


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
