"""`setdiff sample`: a JSONL file of prompts through the cached set sampler, over many processes.

Prompts are cut into blocks of `batch_size` consecutive prompts, and block b belongs to shard
b mod S (S = data-parallel ranks x explicit shards, e.g. of a SLURM array). Each process feeds
all of its prompts to one continuous-batching engine of `batch_size` rows: a row that finishes
is written at once and the next prompt takes its place, so the batch stays full to the end.
Prompt i samples with seed decoding.seed + i and decodes exactly as it would alone, so outputs
do not depend on how the job was spread, sampled ones included. Every TP rank of a group runs
the sampler (the megatron model gathers logits, so they agree); the first writes. Results are
resumable and merged by `ShardedResults`.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from setdiff_megatron.checkpoint.manifest import sha256_file
from setdiff_megatron.distributed.runtime import join
from setdiff_megatron.errors import UserError
from setdiff_megatron.inference.prompts import PromptRecord, encode_prompt, read_prompts
from setdiff_megatron.inference.results import ShardedResults
from setdiff_megatron.inference.sampling_model import SamplingModel, load_sampling_model
from setdiff_megatron.inference.sharding import Placement, Shard
from setdiff_megatron.log import say
from setdiff_megatron.recipes.decoding_settings import with_stops
from setdiff_megatron.sampling.decoding import DecodingConfig, DecodingRequest, resolve_decoding, settings_off_default
from setdiff_megatron.sampling.engine import Sampler
from setdiff_megatron.sampling.sample_output import RowResult
from setdiff_megatron.sampling.sample_request import Request

__all__ = ["SampleJob", "run_sample_job", "job_decoding"]


@dataclass
class SampleJob:
    source: str
    prompts: str
    out: str
    decoding: DecodingRequest = field(default_factory=dict)
    """A whole DecodingConfig, or settings over the model's own policy ({}: the policy itself)."""
    placement: Placement = field(default_factory=Placement)
    add_bos: bool | None = None
    """None: as the model was trained (recipe method.keep_clean_bos)."""
    context_len: int | None = None
    """None: the model's max_seq_len."""
    stop_at_eos: bool = True
    stop: tuple[str, ...] = ()
    """Stop strings, each tokenized on its own: a completion ends where those tokens appear (kept in
    it). Best effort, since a string may tokenize otherwise in context; callers that need an exact
    cut also cut the text."""


def _span_texts(record: PromptRecord, row: RowResult, prompt_ids: list[int], sm: SamplingModel) -> list[str]:
    """The decoded text of each infilled span, in order."""
    masked = [i for i, t in enumerate(prompt_ids) if t == sm.tokenizer.mask_id]
    texts, start = [], 0
    for length in (s for s in record.segments if isinstance(s, int)):
        texts.append(sm.tokenizer.decode([row.tokens[i] for i in masked[start : start + length]]))
        start += length
    return texts


def _record(record: PromptRecord, row: RowResult, prompt_ids: list[int], sm: SamplingModel) -> dict:
    out = {"index": record.index, **record.extra}
    if any(isinstance(s, int) for s in record.segments):
        out["segments"] = list(record.segments)
        out["infills"] = _span_texts(record, row, prompt_ids, sm)
    elif record.messages is not None:
        out["messages"] = list(record.messages)
    else:
        out["prompt"] = record.segments[0]
    out |= {
        "completion": sm.tokenizer.decode(row.completion, skip_special_tokens=True),
        "finish_reason": row.finish_reason,
        "num_decoded": row.num_decoded,
        "nfe": row.nfe,
        "steps": row.steps,
        "tokens_per_step": round(row.tokens_per_step, 4),
        "seconds": round(row.seconds, 4),
        "busy_seconds": round(row.busy_s, 6),
    }
    return out


def job_decoding(request: DecodingRequest, policy: DecodingConfig) -> DecodingConfig:
    """What a job decodes with (sampling/decoding.py resolve_decoding), refused in one line."""
    try:
        return resolve_decoding(request, policy)
    except ValueError as exc:
        raise UserError(f"decoding: {exc}") from None


def run_sample_job(job: SampleJob) -> DecodingConfig:
    """Decode, write and merge; returns the decoding the job used (recorded in its results)."""
    place = job.placement
    place.check()
    ranks = join(place.tp)
    records = read_prompts(job.prompts)
    sm = load_sampling_model(job.source, ranks, device=place.device, dtype=place.dtype)
    decoding = with_stops(job_decoding(job.decoding, sm.decoding), sm.tokenizer, job.stop, eos=job.stop_at_eos)
    context_len = job.context_len or sm.config.max_seq_len
    if context_len > sm.config.max_seq_len:
        raise UserError(f"--context-len {context_len} exceeds the model's max_seq_len {sm.config.max_seq_len}")
    sampler = sm.sampler(
        context_len=context_len, max_rows=place.batch_size, compile=place.compile if place.tp == 1 else "off"
    )
    add_bos = sm.add_bos if job.add_bos is None else job.add_bos
    fmt = sm.prompt_format(add_bos)
    encoded = [encode_prompt(r, sm.tokenizer, fmt) for r in records]
    if decoding.cache_infill_input and (
        sm.family != "bd3lm" or not any(sm.tokenizer.mask_id in ids for ids in encoded)
    ):
        # Not BD3-LM, or nothing to infill: the setting cannot act, so the job records it off and
        # matches jobs of the same prompts and model saved without it (BD3-LM's policy holds it on).
        decoding = replace(decoding, cache_infill_input=False)
    if not decoding.align_inputs_to_blocks and (
        sm.family not in ("mdlm", "bd3lm") or all(sm.tokenizer.mask_id in ids for ids in encoded)
    ):
        # Set diffusion, or infilling only: the baselines' block placement cannot act, recorded on.
        decoding = replace(decoding, align_inputs_to_blocks=True)
    for record, ids in zip(records, encoded):
        problem = sampler.request_problem(ids, decoding)
        if problem:
            raise UserError(f"{job.prompts}:{record.line}: the prompt {problem}")

    results = ShardedResults(
        job.out,
        {
            "source": str(Path(job.source).resolve()),
            "prompts_sha256": sha256_file(Path(job.prompts)),
            "decoding": asdict(decoding),
            "batch_size": place.batch_size,
            "context_len": context_len,
            "add_bos": add_bos,
            "dtype": str(next(sm.model.parameters()).dtype),
        },
        same_as={"decoding": settings_off_default},
    )
    results.check_job()
    if ranks.rank == 0:
        results.start()
    ranks.barrier()
    done = results.done()

    shard = Shard.of(ranks, place)
    writer = results.part(shard.name) if ranks.writes else None
    todo = [i for _, batch in shard.batches(len(records), place.batch_size, done) for i in batch]
    tokens, seconds = _sample(
        sampler, decoding, todo, records, encoded, sm, writer, progress=place.progress and ranks.rank == 0
    )
    ranks.barrier()
    if ranks.rank == 0:
        _report(job, results, len(records), len(done), tokens, seconds)
    return decoding


def _sample(
    sampler: Sampler,
    decoding: DecodingConfig,
    todo: list[int],
    records: list[PromptRecord],
    encoded: list[list[int]],
    sm: SamplingModel,
    writer,
    *,
    progress: bool,
) -> tuple[int, float]:
    """Decode the prompts `todo` through the engine, writing each row as it finishes."""
    from setdiff_megatron.progress import progress_bar

    for i in todo:
        sampler.submit(Request(key=i, prompt=tuple(encoded[i]), cfg=decoding, seed=decoding.seed + i))
    total_tokens, start = 0, time.perf_counter()
    with progress_bar(total=len(todo), unit="prompt", disable=not progress, file=sys.stderr, dynamic_ncols=True) as bar:
        while not sampler.idle:
            finished = sorted(sampler.step(), key=lambda item: item[0])
            if not finished:
                continue
            if writer is not None:
                writer.write([_record(records[i], row, encoded[i], sm) for i, row in finished])
            total_tokens += sum(row.num_decoded for _, row in finished)
            bar.update(len(finished))
            bar.set_postfix(
                tok_s=f"{total_tokens / (time.perf_counter() - start):.1f}",
                tok_step=f"{sum(r.tokens_per_step for _, r in finished) / len(finished):.2f}",
            )
    return total_tokens, time.perf_counter() - start


def _report(job: SampleJob, results: ShardedResults, total: int, skipped: int, tokens: int, seconds: float) -> None:
    rate = f"{tokens} tokens in {seconds:.1f} s ({tokens / max(seconds, 1e-9):.1f} tokens/s on this rank)"
    skipped_text = f", {skipped} already written" if skipped else ""
    if job.placement.shard is not None:
        say(
            f"setdiff: shard {job.placement.shard} of {job.placement.num_shards} done: {rate}{skipped_text}; rerun without "
            f"--shard to merge into {job.out}",
            file=sys.stderr,
        )
        return
    missing = results.merge(total)
    if missing:
        raise UserError(
            f"{len(missing)} prompts are still missing from {results.parts} (e.g. index {missing[0]}); "
            "rerun the job to finish them"
        )
    say(f"setdiff: wrote {total} results to {job.out}: {rate}{skipped_text}", file=sys.stderr)
