"""Compiled decode steps at static shapes, one graph per bucket, and the rule for when to compile.

A decode step whose rows, commit slots, query slots and cache span are rounded up to a bucket
(sampling/step_layout.py) has the shapes of every other step of that bucket, so one graph serves them all.
`on` compiles a bucket at its first step and `off` never; `auto` compiles a bucket once its eager
steps have taken as long as a compile is expected to, and goes back to eager steps for a bucket whose
first compiled steps are no faster. Graphs live for the process. The CUDA path (CUDA graphs) has not
run on a GPU yet: docs/sampling.md, "Compiled decode steps".
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Hashable
from pathlib import Path

import torch

from setdiff_megatron.machine_cache import machine_cache_dir

__all__ = ["COMPILE_MODES", "StepCompiler"]

COMPILE_MODES = ("off", "auto", "on")

COMPILE_COST_S = {"cpu": 10.0, "cuda": 5.0}
"""What `auto` expects one bucket's compile to cost before one is measured on the machine (seconds)."""

RECORDED = 16
"""Compiles of a device kind remembered on the machine: their median is the price `auto` expects."""

JUDGE_AFTER = 8
"""Compiled steps of a bucket after which `auto` compares them with the bucket's eager steps."""

_log = logging.getLogger(__name__)


class StepCompiler:
    """Which buckets run compiled, and the compiled step (model.step under torch.compile)."""

    def __init__(self, model, mode: str, device: torch.device):
        if mode not in COMPILE_MODES:
            raise ValueError(f"compile must be one of {', '.join(COMPILE_MODES)}; got {mode!r}")
        self.mode, self.device = mode, device
        self.compiled: set[Hashable] = set()
        self.compile_s: dict[Hashable, float] = {}
        self.eager_s: dict[Hashable, float] = defaultdict(float)
        self.eager_n: dict[Hashable, int] = defaultdict(int)
        self.compiled_s: dict[Hashable, float] = defaultdict(float)
        self.compiled_n: dict[Hashable, int] = defaultdict(int)
        self.slower: set[Hashable] = set()
        """Compiled buckets whose steps took at least as long as their eager ones (`auto` only)."""
        self.failed: str | None = None
        self._step: Callable | None = None
        self._model = model
        self.progress: Callable[[str], None] | None = None
        """Told a line per bucket compiled (a warm-up's progress)."""

    @property
    def enabled(self) -> bool:
        return self.mode != "off" and self.failed is None

    def expected_cost(self) -> float:
        """The seconds `auto` expects a compile to take: the longest compile of this process, else the
        median of the last RECORDED compiles on this machine for this device kind (compile_seconds.json
        under SETDIFF_CACHE_DIR, default ~/.cache/setdiff_megatron), else COMPILE_COST_S."""
        measured = list(self.compile_s.values())
        if measured:
            return max(measured)
        recorded = _recorded_costs().get(_device_kind(self.device))
        return statistics.median(recorded) if recorded else COMPILE_COST_S.get(self.device.type, 10.0)

    def wants(self, key: Hashable) -> bool:
        """Whether a step of bucket `key` should run compiled."""
        if not self.enabled or key in self.slower:
            return False
        return key in self.compiled or self.mode == "on" or self.eager_s[key] >= self.expected_cost()

    def note_eager(self, key: Hashable, seconds: float) -> None:
        self.eager_s[key] += seconds
        self.eager_n[key] += 1

    def note_compiled(self, key: Hashable, seconds: float) -> None:
        """A compiled step of `key` after its first (which compiled it) took `seconds`. Under `auto`, a
        bucket whose first JUDGE_AFTER compiled steps are no faster on average than its eager steps
        goes back to eager steps; a bucket compiled before any eager step (`on`, a warm-up) is kept."""
        self.compiled_s[key] += seconds
        self.compiled_n[key] += 1
        n, eager = self.compiled_n[key], self.eager_n[key]
        if self.mode == "auto" and n == JUDGE_AFTER and eager and self.compiled_s[key] / n >= self.eager_s[key] / eager:
            self.slower.add(key)

    def step(self, key: Hashable, *args) -> torch.Tensor | None:
        """model.step(*args) compiled for `key` (compiling it now if new); None if compiling failed."""
        if self._step is None:
            self._step = self._compile()
        first = key not in self.compiled
        start = time.perf_counter()
        try:
            out = self._step(*args)
        except Exception as error:  # a model the compiler cannot trace decodes eagerly
            if not first:  # an error of a step that compiled before is the step's own
                raise
            self.failed = f"{type(error).__name__}: {error}".splitlines()[0]
            _log.warning("compiling the decode step failed (%s); decoding eagerly", self.failed)
            return None
        if first:
            self.compiled.add(key)
            self.compile_s[key] = time.perf_counter() - start
            _record_cost(_device_kind(self.device), self.compile_s[key])
            if self.progress is not None:
                self.progress(
                    f"compiled decode step {len(self.compiled)} (rows, commits, queries, span, capacity "
                    f"= {key}) in {self.compile_s[key]:.1f} s"
                )
        return out

    def _compile(self) -> Callable:
        import torch._dynamo.config as dynamo_config

        # One graph per bucket: more buckets than dynamo's default recompile limit of 8.
        dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, 256)
        if self.device.type == "cuda":
            # CUDA graphs: the cache, which rows joining and leaving reallocate, is copied into the
            # graph's static buffers at each replay (docs/sampling.md, "Compiled decode steps").
            return torch.compile(self._model.step, dynamic=False, mode="reduce-overhead")
        # The C++ wrapper calls a graph's kernels without Python in between: a decode step's
        # kernels are small enough for that to matter (benchmarks/PERFORMANCE.md, "Sampling").
        return torch.compile(self._model.step, dynamic=False, options={"cpp_wrapper": True})

    def summary(self) -> dict:
        """For logs and benchmarks: buckets compiled and what compiling them cost."""
        return {
            "mode": self.mode,
            "buckets": len(self.compiled),
            "compile_s": sum(self.compile_s.values()),
            "slower_than_eager": len(self.slower),
            "failed": self.failed,
        }


def _costs_file() -> Path:
    return machine_cache_dir() / "compile_seconds.json"


def _device_kind(device: torch.device) -> str:
    """The kind a compile's cost is recorded for: the CPU, or the GPU's name."""
    return f"cuda:{torch.cuda.get_device_name(device)}" if device.type == "cuda" else device.type


def _recorded_costs() -> dict[str, list[float]]:
    try:
        costs = json.loads(_costs_file().read_text())
    except (OSError, ValueError):  # none recorded yet, or unreadable: the assumed cost stands
        return {}
    if not isinstance(costs, dict):
        return {}
    return {
        kind: [float(x) for x in times]
        for kind, times in costs.items()
        if isinstance(times, list) and all(isinstance(x, int | float) and x >= 0 for x in times)
    }


def _record_cost(kind: str, seconds: float) -> None:
    """Add a measured compile to the machine's record (written whole, then renamed into place);
    a cache directory that cannot be written leaves `auto` on its in-process measurements."""
    costs = _recorded_costs()
    costs[kind] = [*costs.get(kind, []), round(seconds, 3)][-RECORDED:]
    path = _costs_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        partial.write_text(json.dumps(costs, indent=1) + "\n")
        partial.replace(path)
    except OSError as error:
        _log.info("could not record the compile's cost in %s: %s", path, error)
