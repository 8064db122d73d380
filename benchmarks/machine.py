"""What every benchmark prints and records about the machine it ran on."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import torch

RESULTS_DIR = Path(__file__).parent / "results"


def machine_info() -> dict:
    return {
        "date": time.strftime("%Y-%m-%d"),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "processor": platform.processor() or platform.machine(),
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def best_time(fn, *, repeats: int, warmup: int = 1) -> float:
    """Minimum wall time over `repeats` calls: the least disturbed by other load on the machine."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def best_times(fns: dict, *, repeats: int, warmup: int = 1) -> dict:
    """`best_time` of several workloads, interleaved: round r times every workload once, so a
    slow spell of the machine (a shared VM has them, lasting seconds) hits all of them alike
    rather than whichever ran during it, and the ratios between them stay meaningful."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(repeats):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def save_results(name: str, payload: dict) -> Path:
    RESULTS_DIR.mkdir(exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_info(), **payload}, indent=1) + "\n")
    return path
