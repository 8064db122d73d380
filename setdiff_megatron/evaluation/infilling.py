"""`setdiff eval infill`: mask the middle of a text, let the model fill it, score the fill.

Tasks: `rocstories` (the paper's benchmark: ROUGE), `code` (function bodies of held-out files of
the built-in corpus: exact match and ROUGE) and `jsonl` (your own {"left", "middle", "right"}
examples). Spans get the original's token count and both contexts are prefilled, as in the paper;
`--context` hides the context a model's training order would not let it use. Decoding goes
through the sharded, resumable sample job. docs/method.md ("Infilling") says how spans are
decoded, docs/evaluation.md what the job writes.
"""

from __future__ import annotations

import ast
import csv
import json
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from setdiff_megatron.errors import UserError
from setdiff_megatron.evaluation.records import write_json, write_jsonl
from setdiff_megatron.evaluation.scoring import ROUGE_KEYS, exact_match, rouge
from setdiff_megatron.inference.job import job_decoding
from setdiff_megatron.inference.sharding import Placement
from setdiff_megatron.log import say
from setdiff_megatron.sampling.decoding import DecodingConfig, DecodingRequest

__all__ = ["InfillExample", "rocstories_examples", "code_examples", "InfillJob", "run_infill_job", "add_parser"]

TASKS = ("rocstories", "code", "jsonl")
PROMPTS, PROMPTS_INFO, SAMPLES = "prompts.jsonl", "prompts.info.json", "samples.jsonl"
CONTEXTS = ("both", "left", "blocks")
_ROC_COLUMNS = (
    "InputStoryid",
    "InputSentence1",
    "InputSentence2",
    "InputSentence3",
    "InputSentence4",
    "RandomFifthSentenceQuiz1",
    "RandomFifthSentenceQuiz2",
    "AnswerRightEnding",
)


@dataclass(frozen=True)
class InfillExample:
    id: str
    left: str
    middle: str
    right: str
    extra: dict = field(default_factory=dict)
    """Other keys of a jsonl example, copied to its prompt and sample."""


def rocstories_examples(path: str | Path, targets: int = 1, max_examples: int | None = None) -> list[InfillExample]:
    """Five-sentence stories of the ROCStories cloze CSV (its four sentences and the right ending)
    with their middle sentence (`targets` 1) or middle three sentences (3) as the span."""
    if targets not in (1, 3):
        raise UserError(f"--targets must be 1 or 3 (middle sentences masked); got {targets}")
    path = Path(path)
    if not path.is_file():
        raise UserError(f"ROCStories CSV {path} does not exist")
    with path.open(encoding="utf-8", newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in _ROC_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise UserError(f"{path} is not a ROCStories cloze CSV: no column {missing[0]}")
        examples = []
        for row in reader:
            ending = row[f"RandomFifthSentenceQuiz{row['AnswerRightEnding']}"]
            story = [row[f"InputSentence{i}"] for i in range(1, 5)] + [ending]
            first = 2 if targets == 1 else 1
            examples.append(
                InfillExample(
                    id=row["InputStoryid"],
                    left=" ".join(story[:first]),
                    middle=" " + " ".join(story[first : first + targets]),
                    right=" " + " ".join(story[first + targets :]),
                )
            )
            if max_examples is not None and len(examples) == max_examples:
                break
    return examples


def _function_bodies(text: str) -> list[tuple[int, int]]:
    """(start, end) character offsets of the bodies of top-level and method definitions with a
    short, docstring-free body, from the first body line to the end of the last."""
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return []
    starts = [0]
    for line in text.splitlines(keepends=True):
        starts.append(starts[-1] + len(line))
    spans = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) or node.body[0].lineno == node.lineno:
            continue
        first, last = node.body[0], node.body[-1]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            continue
        if 2 <= last.end_lineno - first.lineno + 1 <= 6:
            spans.append((starts[first.lineno - 1], starts[last.end_lineno]))
    return sorted(spans)


def code_examples(max_examples: int | None = None, *, context_lines: int = 6) -> list[InfillExample]:
    """Function bodies of held-out stdlib files (those the tiny recipes never train on), with
    `context_lines` lines of code on each side."""
    from setdiff_megatron.data.corpus import is_heldout, stdlib_documents

    examples = []
    for index, (path, text) in enumerate(stdlib_documents()):
        if not is_heldout(index):
            continue
        for start, end in _function_bodies(text):
            left = "".join(text[:start].splitlines(keepends=True)[-context_lines:])
            right = "".join(text[end:].splitlines(keepends=True)[:context_lines])
            examples.append(InfillExample(id=f"{path}:{start}", left=left, middle=text[start:end], right=right))
            if max_examples is not None and len(examples) == max_examples:
                return examples
    return examples


def jsonl_examples(path: str | Path, max_examples: int | None = None) -> list[InfillExample]:
    """{"left", "middle", "right"} records of a JSONL file, checked line by line."""
    from setdiff_megatron.inference.jsonl import jsonl_records

    examples = []
    for _, where, record in jsonl_records(path, "infill file"):
        if not isinstance(record, dict) or not all(isinstance(record.get(k), str) for k in ("left", "middle", "right")):
            raise UserError(f'{where}: expected a JSON object with string "left", "middle" and "right"')
        if not record["middle"]:
            raise UserError(f'{where}: "middle" is empty: nothing to infill')
        extra = {k: v for k, v in record.items() if k not in ("id", "left", "middle", "right")}
        examples.append(
            InfillExample(
                id=str(record.get("id", len(examples))),
                left=record["left"],
                middle=record["middle"],
                right=record["right"],
                extra=extra,
            )
        )
        if max_examples is not None and len(examples) == max_examples:
            break
    return examples


@dataclass
class InfillJob:
    source: str
    task: str
    out: str
    decoding: DecodingRequest = field(default_factory=dict)
    """A whole DecodingConfig, or settings over the model's own policy ({}: the policy itself);
    the spans are infilled, so nothing is generated after them (max_new_tokens 0)."""
    data: str | None = None
    """The ROCStories cloze CSV (task rocstories)."""
    targets: int = 1
    max_examples: int | None = None
    placement: Placement = field(default_factory=Placement)
    add_bos: bool | None = None
    context: str = "both"
    """both | left | blocks: the context the model's training order lets it use (`_visible_right`);
    blocks reads the block size from the decoding's block_size (a block-order model's policy has it)."""

    def check(self) -> None:
        if self.context not in CONTEXTS:
            raise UserError(f"--context must be one of {', '.join(CONTEXTS)}; got {self.context!r}")

    def sample_decoding(self) -> DecodingRequest:
        """What the sample job is asked: this job's decoding, with no tail after the spans."""
        if isinstance(self.decoding, DecodingConfig):
            return replace(self.decoding, max_new_tokens=0)
        return {**self.decoding, "max_new_tokens": 0}


def _examples(job: InfillJob) -> list[InfillExample]:
    if job.task == "rocstories":
        if job.data is None:
            raise UserError("--task rocstories needs --data PATH to the ROCStories cloze CSV")
        return rocstories_examples(job.data, job.targets, job.max_examples)
    if job.task == "code":
        return code_examples(job.max_examples)
    if job.task == "jsonl":
        if job.data is None:
            raise UserError("--task jsonl needs --data PATH to a JSONL file of {left, middle, right} examples")
        return jsonl_examples(job.data, job.max_examples)
    raise UserError(f"--task must be one of {', '.join(TASKS)}; got {job.task!r}")


def _num_tokens(ex: InfillExample, tokenizer) -> int:
    return sum(len(tokenizer.encode(part)) for part in (ex.left, ex.middle, ex.right))


def _fit_code_context(ex: InfillExample, tokenizer, budget: int) -> InfillExample:
    """Drop context lines farthest from the body, from the longer side, until the example fits
    `budget` tokens or only the signature line and one line after remain."""
    left, right = ex.left.splitlines(keepends=True), ex.right.splitlines(keepends=True)
    while _num_tokens(ex, tokenizer) > budget and (len(left) > 1 or len(right) > 1):
        if len(left) > 1 and (len(left) >= len(right) or len(right) <= 1):
            left = left[1:]
        else:
            right = right[:-1]
        ex = replace(ex, left="".join(left), right="".join(right))
    return ex


def _visible_right(ex: InfillExample, tokenizer, context: str, block_size: int | None, bos: bool) -> str:
    """The right context a model may see: all (`both`), none (`left`: an autoregressive model), or
    up to the end of the span's last block of `block_size` positions (`blocks`: a model trained
    with a block order, which sees later blocks only once it has decoded them). A BD3-LM model
    sees the right context through its cache (its policy's cache_infill_input, as the reference
    infills; sampling/masked_sampler.py)."""
    if context == "both":
        return ex.right
    if context == "left":
        return ""
    span_end = int(bos) + len(tokenizer.encode(ex.left)) + len(tokenizer.encode(ex.middle))
    keep = -span_end % block_size
    # Exact for character-level tokenizers; for a BPE the kept text re-encodes to about `keep` tokens.
    return tokenizer.decode(tokenizer.encode(ex.right)[:keep])


def _prompts(job: InfillJob) -> tuple[list[dict], dict[str, int]]:
    """The prompt records that fit the model's context, and their counts."""
    from setdiff_megatron.sources.read import read_source

    examples = _examples(job)
    if not examples:
        raise UserError(f"task {job.task} produced no examples")
    source = read_source(job.source, weights=False)
    tokenizer, max_len = source.tokenizer, source.config.max_seq_len
    bos = source.add_bos if job.add_bos is None else job.add_bos
    block_size = job_decoding(job.decoding, source.decoding).block_size
    if job.context == "blocks" and block_size is None:
        raise UserError(
            "--context blocks needs a block size: the model's policy has none (it was not trained with "
            "block orders); give --block-size S"
        )
    records, skipped = [], 0
    for ex in examples:
        if job.task == "code":
            ex = _fit_code_context(ex, tokenizer, max_len - 2)
        span = len(tokenizer.encode(ex.middle))
        if _num_tokens(ex, tokenizer) > max_len - 2:  # room for a BOS
            skipped += 1
            continue
        right = _visible_right(ex, tokenizer, job.context, block_size, bos)
        records.append({"id": ex.id, **ex.extra, "segments": [ex.left, span, right], "reference": ex.middle})
    if not records:
        raise UserError(f"every {job.task} example is longer than the model's context ({max_len} tokens)")
    return records, {"examples": len(records), "skipped_too_long": skipped}


def _check_out(out: Path, records: list[dict], info: dict[str, int]) -> bool:
    """Whether `out` already holds these prompts (a rerun resumes them); refuses a folder that
    holds another job's prompts, or samples without their prompts. Read-only: every rank checks,
    so all of them stop with the same one-line error."""
    prompts, saved_info = out / PROMPTS, out / PROMPTS_INFO
    sampled = any(out.glob(f"{SAMPLES}*"))  # before the prompts: another shard writes them first
    if prompts.is_file():
        same = [json.loads(line) for line in prompts.read_text(encoding="utf-8").splitlines()] == records
        if not same or not saved_info.is_file() or json.loads(saved_info.read_text()) != info:
            raise UserError(
                f"{out} holds another infill job's prompts (other task, examples, context or model); "
                "choose another --out or delete it"
            )
        return True
    if sampled:
        raise UserError(f"{out} holds samples without the prompts they were made from; choose another --out")
    return False


def score_samples(samples: list[dict]) -> dict:
    """Mean ROUGE-1/2/L and exact match of each fill against its reference."""
    totals = dict.fromkeys((*ROUGE_KEYS, "exact_match"), 0.0)
    for record in samples:
        fill, reference = record["infills"][0], record["reference"]
        for key, value in rouge(fill, reference).items():
            totals[key] += value
        totals["exact_match"] += exact_match(fill, reference)
    return {key: value / len(samples) for key, value in totals.items()}


def run_infill_job(job: InfillJob) -> dict | None:
    """Returns the metrics on the process that merged the samples, else None."""
    from setdiff_megatron.distributed.runtime import join
    from setdiff_megatron.inference.job import SampleJob, run_sample_job

    job.check()
    out = Path(job.out)
    prompts = out / PROMPTS
    ranks = join(job.placement.tp)
    records, info = _prompts(job)
    if not _check_out(out, records, info) and ranks.rank == 0:
        write_json(out / PROMPTS_INFO, info)  # first: prompts.jsonl marks the pair complete
        write_jsonl(prompts, records)
    ranks.barrier()
    samples = out / SAMPLES
    decoding = run_sample_job(
        SampleJob(
            source=job.source,
            prompts=str(prompts),
            out=str(samples),
            decoding=job.sample_decoding(),
            placement=job.placement,
            add_bos=job.add_bos,
            stop_at_eos=False,
        )
    )
    if ranks.rank != 0 or job.placement.shard is not None:
        return None
    records = [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]
    decoded = sum(r["num_decoded"] for r in records)
    metrics = {
        "task": job.task,
        "targets": job.targets if job.task == "rocstories" else None,
        "context": job.context,
        **score_samples(records),
        "examples": len(records),
        "skipped_too_long": info["skipped_too_long"],
        "tokens_per_step": decoded / max(sum(r["steps"] for r in records), 1),
        # As `setdiff eval generate` measures it: each row's share of the engine's time, summed.
        "tokens_per_s": decoded / seconds if (seconds := sum(r["busy_seconds"] for r in records)) > 0 else None,
        "mean_nfe": sum(r["nfe"] for r in records) / len(records),
        "decoding": {k: v for k, v in asdict(decoding).items() if k != "max_new_tokens"},
    }
    (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
    say(
        f"setdiff: {job.task} infilling over {len(records)} examples ({info['skipped_too_long']} too long, skipped): "
        + ", ".join(f"{k} {metrics[k]:.4f}" for k in (*ROUGE_KEYS, "exact_match"))
        + f", {metrics['tokens_per_step']:.2f} tokens/step; {out / 'metrics.json'}",
        file=sys.stderr,
    )
    return metrics


def _run(args) -> int:
    from setdiff_megatron.inference.cli_args import decoding_from_args, placement_from_args, relaunch

    code = relaunch(args)
    if code is not None:
        return code
    run_infill_job(
        InfillJob(
            source=args.source,
            task=args.task,
            out=args.out,
            decoding=decoding_from_args(args),
            data=args.data,
            targets=args.targets,
            max_examples=args.max_examples,
            placement=placement_from_args(args),
            add_bos=args.add_bos,
            context=args.context,
        )
    )
    return 0


def add_parser(jobs) -> None:
    from setdiff_megatron.inference.cli_args import add_decoding_arguments, add_job_arguments

    parser = jobs.add_parser(
        "infill",
        help="fill masked story sentences or function bodies; ROUGE / exact match",
        description=" ".join(__doc__.split("\n\n")[0].split()),
    )
    add_job_arguments(parser)
    parser.add_argument("--task", required=True, choices=TASKS)
    parser.add_argument("--out", required=True, help="directory for prompts.jsonl, samples.jsonl, metrics.json")
    parser.add_argument(
        "--data", default=None, help="the ROCStories cloze CSV (task rocstories), or the examples (task jsonl)"
    )
    parser.add_argument(
        "--context",
        default="both",
        choices=CONTEXTS,
        help="context the model sees: both sides "
        "(default), left only (AR models), or up to the span's block end (blocks; needs --block-size)",
    )
    parser.add_argument("--targets", type=int, default=1, help="middle sentences masked: 1 or 3 (rocstories)")
    parser.add_argument("--max-examples", type=int, default=None)
    add_decoding_arguments(parser, max_new_tokens=0)
    parser.set_defaults(func=_run)
