"""Per-rank compute time, and one line when a rank is slower than the median rank.

Synchronous training runs at its slowest rank's pace, and every rank's step time shows that
pace, since the fast ones wait for it in the gradient and loss reductions. What tells the straggler
apart is the time each rank spends on its own work: its forward-backward less the time the engine
waited in those reductions (Engine.sync_seconds). The megatron engine times its data-parallel
gradient all-reduce; DeepSpeed reduces gradients inside backward, and with TP or PP the
forward-backward holds collectives too, so there the report is a hint rather than a measurement.
Gathered at each log step (one small all-gather), so a straggler costs no extra synchronisation.
"""

from __future__ import annotations

import statistics

from setdiff_megatron.distributed import runtime

__all__ = ["StragglerMonitor"]


class StragglerMonitor:
    def __init__(self, factor: float):
        self.factor = factor
        self.seconds, self.steps = 0.0, 0

    def add(self, seconds: float) -> None:
        self.seconds += seconds
        self.steps += 1

    def report(self) -> tuple[dict[str, float | list[float]], str | None]:
        """Metrics of every rank's mean forward-backward time since the last report, and a
        warning naming the slowest rank if it is `factor` times the other ranks' median or more:
        the median over all ranks would include the straggler itself, and with two ranks it is
        their mean, which caps the ratio below 2. Collective."""
        mine = self.seconds / max(self.steps, 1)
        self.seconds, self.steps = 0.0, 0
        times = [float(t) for t in runtime.gather_objects(mine)]
        median, slowest = statistics.median(times), max(range(len(times)), key=times.__getitem__)
        metrics: dict[str, float | list[float]] = {
            "ranks/compute_s_median": median,
            "ranks/compute_s_max": times[slowest],
            "ranks/slowest": float(slowest),
            "ranks/compute_s": times,
        }
        warning = None
        if len(times) == 1 or self.factor == 0:
            return metrics, warning
        others = statistics.median(t for rank, t in enumerate(times) if rank != slowest)
        if times[slowest] >= self.factor * others > 0:
            warning = (
                f"rank {slowest} is a straggler: {times[slowest]:.3f} s of forward-backward per step against "
                f"the other ranks' median of {others:.3f} s ({times[slowest] / others:.1f}x; "
                f"train.straggler_factor = {self.factor:g})"
            )
        return metrics, warning
