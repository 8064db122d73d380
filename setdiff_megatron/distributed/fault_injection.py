"""Faults on purpose, for fire drills and tests: SETDIFF_INJECT names what to break and where.

A recovery path that never ran is a guess; this lets a test (or an operator before a long job)
break a run the way large jobs break and watch it recover. SETDIFF_INJECT holds comma-separated
faults, each `KIND:key=value:...` with KIND one of kill, hang, slow, spike, e.g.
`kill:rank=1:step=25,hang:rank=1:step=30:seconds=300:attempt=1`. The whole grammar (every kind,
every key, when each fault fires): docs/fault-tolerance.md ("Drills: SETDIFF_INJECT").
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from setdiff_megatron.errors import UserError
from setdiff_megatron.log import write

__all__ = ["INJECT_ENV", "Fault", "Faults"]

INJECT_ENV = "SETDIFF_INJECT"
KINDS = ("kill", "hang", "slow", "spike")
PLACES = ("step", "save")
"""Where kill and hang fire (`at=`): at the start of the step, or inside the step's save."""


@dataclass
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    seconds: float = 0.0
    factor: float = 1.0
    attempt: int = 0
    always: bool = False
    at: str = "step"
    fired: bool = False

    def due(self, rank: int, step: int | None, at: str = "step") -> bool:
        return (
            self.at == at
            and (self.rank is None or self.rank == rank)
            and (self.step is None or self.step == step)
            and (self.always or not self.fired)
        )


def _parse(spec: str) -> Fault:
    kind, *fields = spec.strip().split(":")
    if kind not in KINDS:
        raise UserError(f"{INJECT_ENV}: unknown fault {kind!r} in {spec!r}; one of {', '.join(KINDS)}")
    fault = Fault(kind)
    for item in fields:
        key, _, value = item.partition("=")
        try:
            if key == "always" and not value:
                fault.always = True
            elif key in ("rank", "step", "attempt"):
                setattr(fault, key, int(value))
            elif key in ("seconds", "factor"):
                setattr(fault, key, float(value))
            elif key == "at" and value in PLACES:
                fault.at = value
            else:
                raise ValueError(key)
        except ValueError:
            raise UserError(
                f"{INJECT_ENV}: cannot read {item!r} in {spec!r}; "
                "use rank=N, step=N, attempt=N, seconds=S, factor=F, at=step|save or always"
            ) from None
    fault.always = fault.always or kind == "slow"  # a straggler is slow at every step
    if kind in ("kill", "hang", "spike") and fault.step is None:
        raise UserError(f"{INJECT_ENV}: {spec!r} needs step=N")
    if fault.at != "step" and kind not in ("kill", "hang"):
        raise UserError(f"{INJECT_ENV}: {spec!r}: only kill and hang fire inside a save (at=save)")
    return fault


class Faults:
    """The faults SETDIFF_INJECT names for this process; no-ops when it is unset."""

    def __init__(self, faults: list[Fault], rank: int):
        attempt = sum(int(os.environ.get(v, "0") or 0) for v in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"))
        self.faults, self.rank = [f for f in faults if f.always or f.attempt == attempt], rank

    @classmethod
    def from_env(cls, rank: int) -> Faults:
        spec = os.environ.get(INJECT_ENV, "").strip()
        return cls([_parse(s) for s in spec.split(",") if s.strip()], rank)

    def _due(self, kind: str, step: int | None, at: str = "step") -> list[Fault]:
        due = [f for f in self.faults if f.kind == kind and f.due(self.rank, step, at)]
        for f in due:
            f.fired = True
        return due

    def _kill_or_hang(self, step: int, at: str, where: str) -> None:
        if self._due("kill", step, at):
            write(f"setdiff: {INJECT_ENV}: killing rank {self.rank} {where}")
            os.kill(os.getpid(), signal.SIGKILL)
        for fault in self._due("hang", step, at):
            time.sleep(fault.seconds)

    def at_step_start(self, step: int) -> None:
        self._kill_or_hang(step, "step", f"at step {step}")

    def in_save(self, step: int) -> None:
        """Inside the checkpoint save of `step`, before it is published (training/checkpointer.py)."""
        self._kill_or_hang(step, "save", f"in the checkpoint save of step {step}")

    def in_forward_backward(self) -> None:
        for fault in self._due("slow", None):
            time.sleep(fault.seconds)

    def loss(self, step: int, loss: float) -> float:
        for fault in self._due("spike", step):
            loss *= fault.factor
        return loss
