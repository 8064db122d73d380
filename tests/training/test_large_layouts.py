"""Layouts the size of a real job, 8 and 16 ranks with every kind of parallelism at once, each
equal to the one-rank run, and checkpoints that move between them (docs/parallelism.md, "Tested
compositions"). Every run is `setdiff train` with the layout as recipe overrides, started from
the same weights (the shipped AR base, or a seed checkpoint for the MoE model and the adaLN DiT:
megatron-core's initialisation depends on the layout, as torchtitan's does for pipeline stages),
so the losses of every step and the validation losses must agree within the tolerance of the
other parity tests.

TP with CP runs in the 16-rank layout (TP2 x PP2 x CP2 x DP2), not again in 8 ranks; a checkpoint
moves from 16 ranks to one and from 8 ranks to 16. Slow: about 8 minutes on 2 cores. Peak memory of the 16-rank run: see docs/parallelism.md.
"""

import json
import shutil
from pathlib import Path

import pytest

from tests.cli_runs import setdiff

ROOT = Path(__file__).parents[2]
REASONING = str(ROOT / "recipes" / "tiny-reasoning.yaml")
MOE = str(ROOT / "recipes" / "tiny-moe-cpu.yaml")
DIT = str(ROOT / "recipes" / "tiny-dit-cpu.yaml")
QUIET = ("log.interval=1", "log.tensorboard=false", "eval.interval=2", "eval.batches=1", "eval.showcase_problems=0")
STEPS = ("train.steps=4", "checkpoint.interval=2", "checkpoint.keep_last_n=10", "parallel.global_batch_size=16")
TOLERANCE = 1e-4
"""Absolute, on losses near 1-5: what the 2 -> 1 resharding test allows (reductions in another order)."""

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]


def train(run: Path, data: Path, recipe: str, *overrides: str) -> list[tuple[str, int, float]]:
    """Run `setdiff train`; its (kind, step, loss) records, kind 'train' or 'valid'."""
    setdiff("train", recipe, f"checkpoint.dir={run}", f"data.cache_dir={data}", *QUIET, *STEPS, *overrides)
    records = []
    for m in map(json.loads, (run / "logs" / "metrics.jsonl").read_text().splitlines()):
        records += [(kind, m["step"], m[f"{kind}/loss"]) for kind in ("train", "valid") if f"{kind}/loss" in m]
    return records


def assert_same(got: list, expected: list) -> None:
    assert [(k, s) for k, s, _ in got] == [(k, s) for k, s, _ in expected]
    for (kind, step, a), (_, _, b) in zip(got, expected):
        assert a == pytest.approx(b, abs=TOLERANCE), f"{kind} loss at step {step}: {a} against {b}"


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("layouts-data")


FAMILIES = {
    "set_diffusion": (REASONING, ("model.init_from=assets/reasoning-ar-base",)),
    "mdlm": (str(ROOT / "recipes" / "study" / "adapted" / "mdlm.yaml"), ("model.init_from=assets/reasoning-ar-base",)),
    "bd3lm": (
        str(ROOT / "recipes" / "study" / "adapted" / "bd3lm-b4.yaml"),
        ("model.init_from=assets/reasoning-ar-base",),
    ),
    "moe": (MOE, ("parallel.ep=1",)),
    # MDLM over the DiT with adaLN, as the LM1B baselines: every pipeline stage's time embedding
    "dit-adaln-mdlm": (DIT, ("method.family=mdlm", "model.adaln=true")),
}
"""Each family's recipe and overrides; a family without model.init_from starts from a seed
checkpoint (`starts`)."""


@pytest.fixture(scope="module")
def starts(tmp_path_factory, data):
    """A family's starting weights as model.init_from: the shipped AR base, or a seed checkpoint
    made once by one process (weights only are read)."""
    cache: dict[str, str] = {}

    def start(family: str) -> str:
        recipe, extra = FAMILIES[family]
        given = [o for o in extra if o.startswith("model.init_from=")]
        if given:
            return given[0]
        if family not in cache:
            run = tmp_path_factory.mktemp(f"{family}-seed") / "run"
            train(run, data, recipe, *extra, "launch.nproc_per_node=1", "train.steps=1", "checkpoint.interval=1")
            cache[family] = f"model.init_from={run}"
        return cache[family]

    return start


def family_overrides(family: str, start: str) -> tuple[str, ...]:
    """The family's overrides with its starting weights."""
    return (*(o for o in FAMILIES[family][1] if not o.startswith("model.init_from=")), start)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory, data, starts):
    """The one-process runs every layout is held to, by family (and engine for ZeRO)."""
    cache: dict[str, list] = {}

    def reference(name: str) -> list:
        if name not in cache:
            run = tmp_path_factory.mktemp(f"one-rank-{name}") / "run"
            family = name.removesuffix("-deepspeed")
            engine = ("engine=deepspeed",) if name.endswith("-deepspeed") else ()
            overrides = family_overrides(family, starts(family))
            cache[name] = train(run, data, FAMILIES[family][0], *overrides, *engine, "launch.nproc_per_node=1")
        return cache[name]

    return reference


EIGHT_RANKS = {
    "tp2-pp2-vpp2-dp2": (
        "set_diffusion",
        "parallel.tp=2",
        "parallel.pp=2",
        "parallel.vpp=2",
        "parallel.micro_batch_size=4",
    ),
    "pp2-dp4": ("dit-adaln-mdlm", "parallel.pp=2", "parallel.micro_batch_size=2"),
    "moe-ep2-tp2-pp2-dp2": (
        "moe",
        "parallel.ep=2",
        "parallel.tp=2",
        "parallel.sequence_parallel=true",
        "parallel.pp=2",
        "parallel.micro_batch_size=4",
    ),
    "zero3-dp8": ("bd3lm-deepspeed", "engine=deepspeed", "parallel.zero_stage=3", "parallel.micro_batch_size=2"),
}
SIXTEEN = ("parallel.tp=2", "parallel.pp=2", "parallel.cp=2", "parallel.micro_batch_size=4")


@pytest.fixture(scope="module")
def layout_runs(tmp_path_factory, data, starts):
    """Each layout's run (8 or 16 processes), made once: (run directory, records)."""
    cache: dict[str, tuple[Path, list]] = {}

    def run(name: str) -> tuple[Path, list]:
        if name not in cache:
            family, *overrides = EIGHT_RANKS[name] if name in EIGHT_RANKS else ("set_diffusion", *SIXTEEN)
            family = family.removesuffix("-deepspeed")
            nproc = 16 if name == "sixteen" else 8
            directory = tmp_path_factory.mktemp(name) / "run"
            records = train(
                directory,
                data,
                FAMILIES[family][0],
                *family_overrides(family, starts(family)),
                f"launch.nproc_per_node={nproc}",
                "parallel.distributed_optimizer=true",
                *overrides,
            )
            cache[name] = directory, records
        return cache[name]

    return run


@pytest.mark.parametrize("layout", list(EIGHT_RANKS))
def test_eight_ranks_equal_one_rank(one_rank, layout_runs, layout):
    _, records = layout_runs(layout)
    assert_same(records, one_rank(EIGHT_RANKS[layout][0]))


def test_sixteen_ranks_equal_one_rank(one_rank, layout_runs):
    """TP2 x PP2 x CP2 x DP2: 16 processes of megatron-core's process groups, ring attention."""
    _, records = layout_runs("sixteen")
    assert_same(records, one_rank("set_diffusion"))


def resumed(saved: Path, tmp_path: Path, data: Path, *layout: str) -> list:
    """The run of `saved` resumed from its step-2 checkpoint on another layout (weights and the
    distributed optimizer's state resharded): the records of its steps 3 and 4."""
    run = tmp_path / "run"
    shutil.copytree(saved / "checkpoints" / "step_00000002", run / "checkpoints" / "step_00000002")
    records = train(run, data, REASONING, "parallel.distributed_optimizer=true", *layout)
    return [r for r in records if r[1] > 2]


@pytest.mark.parametrize(
    "source, layout",
    [
        ("sixteen", ("launch.nproc_per_node=1",)),
        ("tp2-pp2-vpp2-dp2", ("launch.nproc_per_node=16", *SIXTEEN)),
    ],
    ids=["16-to-1", "8-to-16"],
)
def test_a_checkpoint_moves_between_layouts(tmp_path, data, one_rank, layout_runs, source, layout):
    saved, _ = layout_runs(source)
    expected = [r for r in one_rank("set_diffusion") if r[1] > 2]
    assert_same(resumed(saved, tmp_path, data, *layout), expected)
