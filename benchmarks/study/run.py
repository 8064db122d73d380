"""Training and evaluation of the study's models, through the project's own command and jobs.

Each model trains with `setdiff train recipes/study/<name>.yaml` in its own process (a run
directory under OUT/runs, the corpus and index cache shared under OUT/data); a run whose final
checkpoint is in place is not trained again. The evaluations are the `setdiff eval` jobs called
in this process, each resuming and skipping what it already wrote; OUT/timings.json records which
invocation of the study measured each one's speed (`invocation_of`).
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import replace
from pathlib import Path

from benchmarks.study.plan import Model
from setdiff_megatron.checkpoint.manifest import verify
from setdiff_megatron.checkpoint.names import CHECKPOINTS, find_checkpoints
from setdiff_megatron.data.answers import gsm8k_answer
from setdiff_megatron.data.chains import prepare_chains_corpus, rule_baselines
from setdiff_megatron.data.reasoning import TRAIN_LEVELS, ReasoningCorpus, prepare_reasoning_corpus
from setdiff_megatron.distributed.child_processes import child_env
from setdiff_megatron.evaluation.infilling import InfillJob, run_infill_job
from setdiff_megatron.evaluation.likelihood import LikelihoodJob, run_likelihood_job
from setdiff_megatron.evaluation.scoring import exact_match
from setdiff_megatron.evaluation.sweep import run_sweep
from setdiff_megatron.inference.sharding import Placement
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.sampling.decoding import DecodingConfig

BATCH_SIZE = 16
MAX_NEW_TOKENS = 51
"""Room for the longest solution of the training levels (42 characters) and its EOS after the
longest prompt (13) within the models' 64 positions, which MDLM's and BD3-LM's decoders never
pass. Runs of 2026-12-05 and before decoded 52 (set diffusion's sampler may run past the context;
no solution needs it)."""
PLACEMENT = Placement(batch_size=BATCH_SIZE, device="cpu", progress=False)
ROOT = Path(__file__).resolve().parents[2]
TIMINGS, INVOCATIONS = "timings.json", "invocations.jsonl"


def run_dir(out: Path, model: Model) -> Path:
    return out / "runs" / model.key


def overrides(out: Path, model: Model, steps: int | None) -> list[str]:
    """Recipe overrides of a study run: where it goes, the shared data cache, its training seed and
    budget, a smoke run's steps (which win over the budget). No showcase accuracy at the end of
    training: the study decodes each run over its own grid, and the showcase's two passes over
    250 problems took most of a smoke run's time for MDLM (its decoder is the slowest)."""
    return [
        f"checkpoint.dir={run_dir(out, model)}",
        f"data.cache_dir={out / 'data'}",
        "eval.showcase_problems=0",
        *([f"train.seed={model.seed}"] if model.seed is not None else []),
        *([f"train.steps={model.budget}"] if model.budget is not None else []),
        *([f"train.steps={steps}", f"checkpoint.interval={steps}"] if steps else []),
    ]


def trained(out: Path, model: Model, steps: int | None) -> bool:
    """The run's final checkpoint exists and verifies."""
    steps = load_recipe(model.recipe, overrides(out, model, steps)).train.steps
    final = [c for c in find_checkpoints(run_dir(out, model) / CHECKPOINTS) if c.name == f"step_{steps:08d}"]
    return bool(final) and verify(final[0]) is None


def train(out: Path, model: Model, steps: int | None) -> None:
    """Train `model` unless done."""
    if trained(out, model, steps):
        print(f"study: {model.key} is trained", flush=True)
        return
    log = out / "logs" / f"{model.key}.train.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "setdiff_megatron.cli", "train", str(model.recipe), *overrides(out, model, steps)]
    print(f"study: training {model.key}: {' '.join(cmd[2:])} (log {log})", flush=True)
    with open(log, "ab") as stream:  # from the checkout: adapted recipes name assets/ relative to it
        code = subprocess.call(cmd, stdout=stream, stderr=subprocess.STDOUT, cwd=ROOT, env=child_env())
    if code != 0:
        raise SystemExit(f"study: training {model.key} failed with exit code {code}; see {log}")


def prepare_tasks(out: Path, per_level: int) -> tuple[ReasoningCorpus, Path, Path]:
    """(corpus, the test task file with `per_level` problems of each training level in turn,
    the same problems as {"text"} documents for the likelihood jobs)."""
    corpus = prepare_reasoning_corpus(out / "data" / "reasoning", progress=False)
    by_level = [corpus.test_tasks(level).read_text(encoding="utf-8").splitlines() for level in TRAIN_LEVELS]
    if min(map(len, by_level)) < per_level:
        raise SystemExit(
            f"study: --per-level {per_level} is more than the corpus's {min(map(len, by_level))} "
            "test problems per level"
        )
    by_level = [lines[:per_level] for lines in by_level]
    lines = [line for group in zip(*by_level) for line in group]
    tasks, docs = out / "tasks" / "test.jsonl", out / "tasks" / "test-docs.jsonl"
    tasks.parent.mkdir(parents=True, exist_ok=True)
    tasks.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    records = [json.loads(line) for line in lines]
    docs.write_text(
        "".join(json.dumps({"text": r["prompt"] + r["reference"]}) + "\n" for r in records), encoding="utf-8"
    )
    return corpus, tasks, docs


def prepare_infill_task(out: Path, per_level: int) -> tuple[Path, dict]:
    """(the infill task with `per_level` chains of each level in turn, the exact match of the rules
    on it: data/chains.py rule_baselines), from the chains corpus the infill models train on."""
    corpus = prepare_chains_corpus(out / "data" / "reasoning-chains", progress=False)
    records = [json.loads(line) for line in corpus.infill_tasks.read_text(encoding="utf-8").splitlines()]
    levels = len({r["level"] for r in records})
    if len(records) < per_level * levels:
        raise SystemExit(
            f"study: --infill-per-level {per_level} is more than the corpus's {len(records) // levels} "
            "infill chains per level"
        )
    records = records[: per_level * levels]  # the levels come in turn
    task = out / "tasks" / "infill-chains.jsonl"
    task.parent.mkdir(parents=True, exist_ok=True)
    task.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    with open(corpus.directory / "raw" / "train.jsonl", encoding="utf-8") as train:
        baselines = rule_baselines((json.loads(line)["text"] for line in train), records)
    return task, baselines


def trivial_baseline(tasks: Path) -> float:
    """The accuracy of answering every problem with the test set's most common answer."""
    answers = Counter(
        gsm8k_answer(json.loads(line)["reference"]) for line in tasks.read_text(encoding="utf-8").splitlines()
    )
    return answers.most_common(1)[0][1] / sum(answers.values())


def likelihood(out: Path, model: Model, docs: Path) -> dict:
    """Exact left-to-right NLL and the NELBO under the model's own order policy (4 orders)."""
    results = {}
    for key, order, num_orders in (("nll_left_to_right", "left_to_right", 1), ("nelbo_own_policy", "training", 4)):
        summary = run_likelihood_job(
            LikelihoodJob(
                source=str(run_dir(out, model)),
                data=str(docs),
                out=str(out / "eval" / model.key / key),
                order=order,
                num_orders=num_orders,
                placement=PLACEMENT,
            )
        )
        results[key] = summary
    return results


def sweep(out: Path, model: Model, tasks: Path, quick: bool) -> list[dict]:
    """The model's decoding points on the test task (a `setdiff eval sweep` spec), each with the
    invocation that measured its speed."""
    import yaml

    points, grid = model.grid(quick)
    spec = {
        "task": str(tasks),
        "metric": "gsm8k",
        "checkpoints": {model.key: str(run_dir(out, model))},
        "out": str(out / "eval" / model.key / "sweep"),
        "batch_size": BATCH_SIZE,
        # Every point names its window and, where it uses one, its threshold: the rest is off.
        "decoding": {"max_new_tokens": MAX_NEW_TOKENS, "threshold": None, **model.decoding_defaults()},
        "points": points,
        "grid": grid,
    }
    path = out / "specs" / f"{model.key}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    rows = run_sweep(path, placement=PLACEMENT)
    return [r | {"invocation": invocation_of(out, Path(r["dir"]) / "generations.jsonl")} for r in rows]


def infill(out: Path, model: Model, task: str, data: Path | None, max_examples: int | None, variant: str = "") -> dict:
    """Infilling with the context the model can use, one token per step (plan.Model.infills'
    `variant`); for records with levels (the chains task), also the exact match per level; and
    the invocation that measured its speed."""
    settings = model.infills()[variant]
    decoding = DecodingConfig(
        window=settings["window"],
        block_size=settings.get("block_size"),
        cache_infill_input=settings.get("cache_infill_input", False),
        max_new_tokens=0,
    )
    directory = out / "eval" / model.key / "-".join(filter(None, ("infill", task, variant)))
    metrics = run_infill_job(
        InfillJob(
            source=str(run_dir(out, model)),
            task=task,
            data=None if data is None else str(data),
            out=str(directory),
            decoding=decoding,
            max_examples=max_examples,
            placement=replace(PLACEMENT, batch_size=BATCH_SIZE),
            context=settings["context"],
        )
    )
    samples = directory / "samples.jsonl"
    hits: dict[str, list[float]] = defaultdict(list)
    for line in samples.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        if "level" in record:
            hits[record["level"]].append(exact_match(record["infills"][0], record["reference"]))
    levels = {level: sum(v) / len(v) for level, v in hits.items()}
    return metrics | ({"levels": levels} if levels else {}) | {"invocation": invocation_of(out, samples)}


def invocation_of(out: Path, timed: Path) -> str:
    """The study invocation that measured the speeds in `timed` (a file of per-row decode
    seconds). A job that finds its work done leaves that file as it was or writes it again with
    the same content, so OUT/timings.json keeps the invocation that first wrote each content;
    content it has not seen was written by the last invocation to start before the file was
    written (OUT/invocations.jsonl, `new_invocation`), which may have been stopped before it
    could record it."""
    path = out / TIMINGS
    ledger = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    key, digest = str(timed.relative_to(out)), hashlib.sha256(timed.read_bytes()).hexdigest()
    if ledger.get(key, {}).get("sha256") != digest:
        written = timed.stat().st_mtime
        lines = (out / INVOCATIONS).read_text(encoding="utf-8").splitlines()
        started = [i for i in map(json.loads, lines) if i["start"] <= written]
        who = started[-1]["id"] if started else f"unrecorded (written {_utc(written)})"
        ledger[key] = {"sha256": digest, "invocation": who}
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(ledger, indent=1, sort_keys=True) + "\n", encoding="utf-8")
        tmp.replace(path)
    return ledger[key]["invocation"]


def new_invocation(out: Path) -> str:
    """This invocation's id (its start, UTC, to the second), appended with its start time to
    OUT/invocations.jsonl before it measures anything."""
    start = time.time()
    record = {"id": _utc(start), "start": int(start), "load_average": os.getloadavg()[0], "cpus": os.cpu_count()}
    out.mkdir(parents=True, exist_ok=True)
    with open(out / INVOCATIONS, "a", encoding="utf-8") as stream:
        stream.write(json.dumps(record) + "\n")
    return record["id"]


def _utc(seconds: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def _metrics(out: Path, model: Model) -> list[dict]:
    """The rows of the run's metrics.jsonl, in the order they were written."""
    lines = (run_dir(out, model) / "logs" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [json.loads(line) for line in lines]


def valid_curve(out: Path, model: Model) -> list[tuple[int, float]]:
    """(step, validation loss); a resumed run logs its steps again: the last one counts."""
    return sorted({r["step"]: r["valid/loss"] for r in _metrics(out, model) if "valid/loss" in r}.items())


def train_minutes(out: Path, model: Model) -> float:
    """Wall time between consecutive logged rows while the step count rises, so that the time a run
    spent interrupted (the step count restarts at its checkpoint) does not count."""
    rows, seconds = _metrics(out, model), 0.0
    for before, after in zip(rows, rows[1:]):
        if after["step"] > before["step"]:
            seconds += after["time"] - before["time"]
    return seconds / 60
