"""`python -m benchmarks.study --quick`: AR and set diffusion d = 4 trained from scratch with the
full study's recipes and seeds, decoded on its 250 test problems: 21 minutes on 2 idle cores,
over the 15-minute goal (its two 1,750-step trainings take 10.6 minutes each). On the machine
the full study ran on, the quick run reproduced its figures exactly (0.452, 0.064, 1.37).

Thresholds, from the full study (benchmarks/results/study/results.json, 2026-12-01), with
margins for another CPU's float order over 1,750 steps; accuracies are fractions:
- AR greedy accuracy was 0.452 there; a quick run must reach AR_MIN = 0.452 - 0.15, far above
  the trivial baseline of 0.036 (every problem given the most common answer).
- d = 4 at window 4, threshold 0.9 decoded 1.37 tokens per step there; a quick run must reach
  TPS_MIN = 1.37 - 0.15. An untrained model commits one token per step at this threshold.
- d = 4's accuracy there trailed AR's by 0.388; a quick run may trail by GAP_MAX = 0.388 + 0.15.
  At this scale the gap is large (the README's study section says why), so this bound only fails
  if set diffusion falls further behind: it guards against a regression, not for parity.
"""

from __future__ import annotations

import pytest

from benchmarks.study import plan
from benchmarks.study.__main__ import main

AR_MIN = 0.452 - 0.15
TPS_MIN = 1.37 - 0.15
GAP_MAX = 0.388 + 0.15

pytestmark = [pytest.mark.slow, pytest.mark.timeout(3600)]


def _point(results: dict, model: str, **decoding) -> dict:
    (point,) = [p for p in results["models"][model]["points"]
                if all(p[key] == value for key, value in decoding.items())]
    return point


def test_quick_study_keeps_the_full_runs_trade_off(tmp_path):
    results = main(["--quick", "--out", str(tmp_path / "runs"), "--results", str(tmp_path / "results")])
    ar = _point(results, "ar", window=1)
    sd = _point(results, "sd-d4", **plan.QUICK_POINT)
    assert ar["examples"] == sd["examples"] == 250
    assert ar["accuracy"] >= AR_MIN
    assert sd["tokens_per_step"] >= TPS_MIN
    assert sd["accuracy"] >= ar["accuracy"] - GAP_MAX
    assert (tmp_path / "results" / "results.md").is_file()
