"""`setdiff eval generate`: a generation task (prompt/reference pairs) decoded and scored.

Decode a task file's prompts through the sample job (sharded, resumed and merged as `setdiff
sample` does) into OUT/generations.jsonl, then score each completion, cut at the first --stop
string, with exact match, ROUGE-1/2/L or GSM8K answer accuracy into OUT/scored.jsonl and
OUT/metrics.json (quality, speed and the settings that produced them). A rerun under the same
settings does nothing; one with another metric re-scores the stored generations without
generating again. The task format and how speed is measured: docs/evaluation.md.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from setdiff_megatron.checkpoint.manifest import sha256_file
from setdiff_megatron.data.answers import gsm8k_answer
from setdiff_megatron.errors import UserError
from setdiff_megatron.evaluation import scoring
from setdiff_megatron.evaluation.records import (
    WandbConfig,
    check_wandb,
    hardware,
    log_to_wandb,
    write_json,
    write_jsonl,
)
from setdiff_megatron.inference.jsonl import jsonl_records
from setdiff_megatron.inference.sharding import Placement
from setdiff_megatron.log import say
from setdiff_megatron.sampling.decoding import (
    DecodingConfig,
    DecodingRequest,
    decoding_request_record,
    settings_off_default,
)

__all__ = [
    "METRICS",
    "PRIMARY",
    "GenerateJob",
    "TaskExample",
    "read_tasks",
    "score_completion",
    "summarize",
    "run_generate_job",
    "add_parser",
]

METRICS = ("exact", "rouge", "gsm8k")
PRIMARY = {"exact": "exact_match", "rouge": "rougeL", "gsm8k": "accuracy"}
"""The quality number of each metric that sweeps plot."""
GENERATIONS, SCORED, SUMMARY = "generations.jsonl", "scored.jsonl", "metrics.json"


@dataclass(frozen=True)
class TaskExample:
    index: int
    line: int
    prompt: str
    references: tuple[str, ...]


@dataclass
class GenerateJob:
    source: str
    tasks: str
    out: str
    """A directory: generations.jsonl, scored.jsonl, metrics.json."""
    metric: str
    decoding: DecodingRequest = field(default_factory=dict)
    """A whole DecodingConfig, or settings over the model's own policy ({}: the policy itself)."""
    stop: tuple[str, ...] = ()
    """Completions are cut before the first of these strings (and decoding stops there, best effort)."""
    placement: Placement = field(default_factory=Placement)
    add_bos: bool | None = None
    context_len: int | None = None
    stop_at_eos: bool = True
    wandb: WandbConfig = field(default_factory=WandbConfig)


def _example(record: Any, where: str, index: int, line: int) -> TaskExample:
    if not isinstance(record, dict):
        raise UserError(f"{where}: expected a JSON object with 'prompt' and 'reference'; got {type(record).__name__}")
    if "messages" in record and "prompt" not in record:
        record = {**record, "prompt": ""}  # a chat prompt: inference/prompts.py checks and renders it
    if not isinstance(record.get("prompt"), str):
        raise UserError(
            f"{where}: 'prompt' must be a string"
            + ("" if "prompt" in record else " (missing; or give the chat's 'messages')")
        )
    reference = record.get("reference")
    refs = [reference] if isinstance(reference, str) else reference
    if not isinstance(refs, list) or not refs or not all(isinstance(r, str) for r in refs):
        raise UserError(
            f"{where}: 'reference' must be a string or a non-empty list of strings"
            + ("" if "reference" in record else " (missing)")
        )
    return TaskExample(index=index, line=line, prompt=record["prompt"], references=tuple(refs))


def read_tasks(path: str | Path) -> list[TaskExample]:
    """The examples of a task file, checked line by line (errors name file:line).

    A line is one JSON object: a "prompt" (or a chat's "messages", rendered with the model's chat
    template as its supervised chat records were; inference/prompts.py) and a "reference" (a
    string, or a list of strings: an example scores its best reference). Other keys travel to
    the results."""
    examples = []
    for number, where, record in jsonl_records(path, "task file"):
        examples.append(_example(record, where, len(examples), number))
    if not examples:
        raise UserError(
            f'task file {path} holds no examples (one JSON object per line: {{"prompt": "...", "reference": "..."}}}})'
        )
    return examples


def check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise UserError(f"--metric must be one of {', '.join(METRICS)}; got {metric!r}")


def cut_at_stop(text: str, stop: tuple[str, ...]) -> str:
    ends = [i for i in (text.find(s) for s in stop) if i >= 0]
    return text[: min(ends)] if ends else text


def score_completion(
    metric: str, completion: str, references: tuple[str, ...] | list[str], stop: tuple[str, ...] = ()
) -> dict[str, Any]:
    """The prediction (the completion cut at a stop string) and its scores, best over references."""
    prediction = cut_at_stop(completion, tuple(stop))
    if metric == "exact":
        return {"prediction": prediction, "exact_match": max(scoring.exact_match(prediction, r) for r in references)}
    if metric == "rouge":
        scores = [scoring.rouge(prediction, r) for r in references]
        return {"prediction": prediction, **{k: max(s[k] for s in scores) for k in scoring.ROUGE_KEYS}}
    answer = gsm8k_answer(prediction)
    correct = answer is not None and any(answer == gsm8k_answer(r) for r in references)
    return {"prediction": prediction, "answer": answer, "accuracy": float(correct)}


def summarize(records: list[dict], metric: str) -> dict[str, Any]:
    """Quality (means of the per-example scores) and speed of scored records."""
    keys = scoring.ROUGE_KEYS if metric == "rouge" else (PRIMARY[metric],)
    quality = {k: sum(r[k] for r in records) / len(records) for k in keys}
    return {
        "quality": quality,
        "score": quality[PRIMARY[metric]],
        "score_name": PRIMARY[metric],
        "num_examples": len(records),
        **decode_speed(records),
    }


def decode_speed(records: list[dict]) -> dict[str, Any]:
    """Tokens, decode time and speeds of a sample job's output rows."""
    # Each row records its share of the engine's time (every step's time divided among the rows
    # in it): their sum is the time the replica spent, however the rows were batched.
    tokens, steps = sum(r["num_decoded"] for r in records), sum(r["steps"] for r in records)
    seconds = sum(r["busy_seconds"] for r in records)
    return {
        "num_tokens": tokens,
        "decode_seconds": round(seconds, 4),
        "tokens_per_s": tokens / seconds if seconds > 0 else None,
        "tokens_per_step": tokens / max(steps, 1),
        "mean_nfe": sum(r["nfe"] for r in records) / len(records),
        "mean_completion_tokens": tokens / len(records),
    }


def _settings(job: GenerateJob) -> dict[str, Any]:
    """What the results depend on: a rerun under equal settings is finished work."""
    return json.loads(
        json.dumps(
            {
                "source": str(Path(job.source).resolve()),
                "tasks": str(Path(job.tasks).resolve()),
                "tasks_sha256": sha256_file(Path(job.tasks)),
                "metric": job.metric,
                "stop": list(job.stop),
                "decoding": decoding_request_record(job.decoding),
                "batch_size": job.placement.batch_size,
                "add_bos": job.add_bos,
                "context_len": job.context_len,
                "stop_at_eos": job.stop_at_eos,
                "dtype": job.placement.dtype,
            }
        )
    )


def finished(out: str | Path, settings: dict[str, Any]) -> dict[str, Any] | None:
    """The metrics of a finished job with these settings, or None."""
    path = Path(out) / SUMMARY
    if not path.is_file():
        return None
    try:
        metrics = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    same = _comparable(metrics.get("settings") or {}) == _comparable(settings)
    return metrics if same and (Path(out) / SCORED).is_file() else None


def _comparable(settings: dict[str, Any]) -> dict[str, Any]:
    """Settings with a whole decoding config's record reduced to its settings off their defaults,
    so a job finished before a setting existed still matches (as the sample job's record does)."""
    decoding = settings.get("decoding")
    if isinstance(decoding, dict) and "model_policy_with" not in decoding:
        return {**settings, "decoding": settings_off_default(decoding)}
    return settings


def _check(job: GenerateJob) -> None:
    check_metric(job.metric)
    job.placement.check()
    if any(not s for s in job.stop):
        raise UserError("--stop strings must not be empty")
    check_wandb(job.wandb)


def score_job(job: GenerateJob, settings: dict[str, Any], decoding: DecodingConfig) -> dict[str, Any]:
    """Score merged generations into scored.jsonl and metrics.json (one process); `decoding` is
    what they were decoded with."""
    from setdiff_megatron.progress import progress_bar

    out = Path(job.out)
    generations = [json.loads(line) for line in (out / GENERATIONS).read_text(encoding="utf-8").splitlines()]
    examples = read_tasks(job.tasks)
    scored = []
    for record in progress_bar(
        generations,
        desc="scoring",
        unit="example",
        file=sys.stderr,
        disable=not job.placement.progress or len(generations) < 256,
    ):
        scores = score_completion(job.metric, record["completion"], examples[record["index"]].references, job.stop)
        scored.append({**record, "references": list(examples[record["index"]].references), **scores})
    write_jsonl(out / SCORED, scored)
    metrics = {
        "task": str(job.tasks),
        "metric": job.metric,
        "source": str(job.source),
        **summarize(scored, job.metric),
        "batch_size": job.placement.batch_size,
        "decoding": asdict(decoding),
        "stop": list(job.stop),
        "hardware": hardware(job.placement.device),
        "settings": settings,
    }
    write_json(out / SUMMARY, metrics)
    return json.loads(json.dumps(metrics))  # as it reads back from disk


def _describe(metrics: dict[str, Any]) -> str:
    quality = ", ".join(f"{k} {v:.4f}" for k, v in metrics["quality"].items())
    speed = f"{metrics['tokens_per_s']:.1f} tokens/s" if metrics["tokens_per_s"] else "- tokens/s"
    return (
        f"{quality} over {metrics['num_examples']} examples; {speed}, {metrics['tokens_per_step']:.2f} "
        f"tokens/step, mean NFE {metrics['mean_nfe']:.1f}"
    )


def run_generate_job(job: GenerateJob) -> dict[str, Any] | None:
    """Generate, merge and score; returns the metrics on the process that scored (None elsewhere
    and for an explicit shard)."""
    from setdiff_megatron.inference.job import SampleJob, run_sample_job

    read_tasks(job.tasks)
    _check(job)
    settings = _settings(job)
    done = finished(job.out, settings)
    if done is not None:
        say(f"setdiff: {Path(job.out) / SUMMARY} is up to date ({_describe(done)})", file=sys.stderr)
        return done
    decoding = run_sample_job(
        SampleJob(
            source=job.source,
            prompts=job.tasks,
            out=str(Path(job.out) / GENERATIONS),
            decoding=job.decoding,
            placement=job.placement,
            add_bos=job.add_bos,
            context_len=job.context_len,
            stop_at_eos=job.stop_at_eos,
            stop=job.stop,
        )
    )
    if job.placement.shard is not None or int(os.environ.get("RANK", "0")) != 0:
        return None
    metrics = score_job(job, settings, decoding)
    say(f"setdiff: {_describe(metrics)}; {Path(job.out) / SUMMARY}", file=sys.stderr)
    log_to_wandb(
        job.wandb,
        job_type="eval-generate",
        config=settings,
        out_dir=job.out,
        summary={
            **metrics["quality"],
            **{k: metrics[k] for k in ("tokens_per_s", "tokens_per_step", "mean_nfe", "num_examples")},
        },
    )
    return metrics


def add_wandb_arguments(parser) -> None:
    group = parser.add_argument_group("logging")
    group.add_argument(
        "--wandb-project", default=None, help="log the metrics to this Weights & Biases project (needs the wandb extra)"
    )
    group.add_argument(
        "--wandb-mode", default="offline", help="offline (default; `wandb sync` later), online or disabled"
    )
    group.add_argument("--wandb-run-name", default=None)


def wandb_from_args(args) -> WandbConfig:
    return WandbConfig(args.wandb_project, args.wandb_mode, args.wandb_run_name)


def _run(args) -> int:
    from setdiff_megatron.inference.cli_args import decoding_from_args, placement_from_args, relaunch

    # Bad input fails here, once, rather than in every launched process.
    read_tasks(args.tasks)
    check_metric(args.metric)
    code = relaunch(args)
    if code is not None:
        return code
    run_generate_job(
        GenerateJob(
            source=args.source,
            tasks=args.tasks,
            out=args.out,
            metric=args.metric,
            decoding=decoding_from_args(args),
            stop=tuple(args.stop),
            placement=placement_from_args(args),
            add_bos=args.add_bos,
            context_len=args.context_len,
            stop_at_eos=not args.ignore_eos,
            wandb=wandb_from_args(args),
        )
    )
    return 0


def add_parser(jobs) -> None:
    from setdiff_megatron.inference.cli_args import add_decoding_arguments, add_job_arguments

    parser = jobs.add_parser(
        "generate",
        help="decode a task's prompts and score them (exact, ROUGE, GSM8K)",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    add_job_arguments(parser)
    parser.add_argument("--tasks", required=True, help='JSONL: {"prompt": ..., "reference": text or [texts]} per line')
    parser.add_argument("--metric", required=True, help=f"one of {', '.join(METRICS)}")
    parser.add_argument("--out", required=True, help=f"directory for {GENERATIONS}, {SCORED} and {SUMMARY}")
    parser.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="cut completions before this string (repeatable), e.g. --stop $'\\n\\n'",
    )
    add_decoding_arguments(parser)
    add_wandb_arguments(parser)
    parser.set_defaults(func=_run)
