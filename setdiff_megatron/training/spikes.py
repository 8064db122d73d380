"""Loss spikes: a loss far above its recent window, told from noise by a robust scale.

A step's loss is a spike when it exceeds the median of the last `window` accepted losses by more
than `threshold` robust deviations (the median absolute deviation, scaled by 1.4826 to match a
normal's standard deviation), the rule PaLM and Megatron-LM apply before they skip batches or
roll back. Median and MAD, not mean and std: the spike itself must not widen the yardstick it is
measured with, and a falling loss curve must not look like one. A floor on the deviation keeps a
flat curve (MAD near 0) from calling every wiggle a spike.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

__all__ = ["SpikeDetector", "Spike"]

MAD_TO_STD = 1.4826
"""A normal distribution's standard deviation per median absolute deviation."""
RELATIVE_FLOOR = 0.01
"""The smallest robust deviation counted, as a fraction of the median loss."""


@dataclass(frozen=True)
class Spike:
    loss: float
    median: float
    deviation: float

    def describe(self) -> str:
        return (
            f"loss {self.loss:.4f} is {(self.loss - self.median) / self.deviation:.1f} robust deviations above "
            f"the recent median {self.median:.4f}"
        )


@dataclass
class SpikeDetector:
    window: int
    threshold: float
    min_history: int
    history: deque[float] = field(init=False)

    def __post_init__(self) -> None:
        self.history = deque(maxlen=self.window)

    def check(self, loss: float) -> Spike | None:
        """The spike `loss` is, or None; no judgement before `min_history` accepted losses."""
        if len(self.history) < self.min_history:
            return None
        median = statistics.median(self.history)
        mad = statistics.median(abs(v - median) for v in self.history)
        deviation = max(MAD_TO_STD * mad, RELATIVE_FLOOR * abs(median), 1e-12)
        return Spike(loss, median, deviation) if loss > median + self.threshold * deviation else None

    def accept(self, loss: float) -> None:
        self.history.append(loss)
