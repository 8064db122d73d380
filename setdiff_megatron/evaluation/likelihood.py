"""`setdiff eval likelihood`: NLL, perplexity and bits per byte of a model on a text dataset.

Cuts the documents into windows of seq_len tokens and averages the training loss (a one-sample
estimate of the NELBO under an order policy, core/loss.py) over --num-orders orders per window,
with a 95 % Monte Carlo interval over orders; under --order left_to_right the order is fixed and
the NLL is the exact autoregressive one (interval 0). Each window seeds its own orders, so the
numbers do not depend on the sharding or batch size (docs/evaluation.md).
"""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from setdiff_megatron.core.loss import set_diffusion_loss
from setdiff_megatron.core.orders import make_order_policy
from setdiff_megatron.core.streams import sample_two_stream_batch
from setdiff_megatron.distributed.runtime import join
from setdiff_megatron.errors import UserError
from setdiff_megatron.inference.results import ShardedResults
from setdiff_megatron.inference.sampling_model import SamplingModel, load_sampling_model
from setdiff_megatron.inference.sharding import Placement, Shard
from setdiff_megatron.log import say

__all__ = ["LikelihoodJob", "run_likelihood_job", "read_documents", "summarize", "add_parser"]

ORDERS = ("training", "left_to_right", "staggered", "uniform", "block")
SUMMARY = "likelihood.json"


@dataclass
class LikelihoodJob:
    source: str
    data: str
    out: str
    order: str = "training"
    """'training' (the checkpoint recipe's order policy) or a policy name of core/orders.py."""
    d: int | None = None
    """Desired set size of 'staggered' (default: the recipe's)."""
    num_orders: int = 8
    seq_len: int | None = None
    """None: the model's max_seq_len."""
    max_docs: int | None = None
    seed: int = 0
    placement: Placement = field(default_factory=Placement)


@dataclass(frozen=True)
class Window:
    index: int
    tokens: list[int]
    num_bytes: int
    """The document's UTF-8 bytes on its first window, 0 on the others: they sum to the data's."""


def read_documents(path: str | Path, max_docs: int | None = None) -> list[str]:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"data file {path} does not exist")
    if path.suffix != ".jsonl":
        return [path.read_text(encoding="utf-8")]
    docs = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                text = json.loads(line)["text"]
                if not isinstance(text, str):
                    raise TypeError
            except (json.JSONDecodeError, KeyError, TypeError):
                raise UserError(f"{path}:{number}: expected a JSON object with a string 'text'") from None
            docs.append(text)
            if max_docs is not None and len(docs) == max_docs:
                break
    if not docs:
        raise UserError(f"data file {path} holds no documents")
    return docs


def _windows(docs: list[str], sm: SamplingModel, seq_len: int) -> list[Window]:
    windows = []
    for text in docs:
        ids = ([sm.tokenizer.bos_id] if sm.add_bos else []) + sm.tokenizer.encode(text)
        for first in range(0, len(ids), seq_len):
            windows.append(
                Window(len(windows), ids[first : first + seq_len], len(text.encode("utf-8")) if first == 0 else 0)
            )
    return windows


def _policy(job: LikelihoodJob, sm: SamplingModel, recipe_method):
    if sm.family != "set_diffusion":
        raise UserError(
            f"setdiff eval likelihood scores set diffusion's orders; {job.source} is a {sm.family} model, whose "
            "NELBO it does not estimate (its validation loss in metrics.jsonl is its training objective)"
        )
    name = job.order
    if name == "training":
        if recipe_method is None:
            raise UserError("--order training needs a checkpoint that records its recipe; give --order explicitly")
        return recipe_method.order_policy()
    if name not in ORDERS:
        raise UserError(f"--order must be one of {', '.join(ORDERS)}; got {name!r}")
    if name == "staggered":
        d = job.d or (recipe_method.d if recipe_method is not None else None)
        if d is None:
            raise UserError("--order staggered needs --d (the desired set size)")
        return make_order_policy("staggered", d=d)
    if name == "block":
        size = recipe_method.block_size if recipe_method is not None and recipe_method.block_size else None
        if size is None:
            raise UserError("--order block needs a checkpoint trained with block orders")
        return make_order_policy("block", size=size)
    return make_order_policy(name)


@torch.no_grad()
def window_nll(
    model,
    windows: list[Window],
    policy,
    *,
    mask_token_id: int,
    keep_clean_bos: bool,
    num_orders: int,
    seed: int,
    device,
) -> list[list[float]]:
    """NLL (nats, summed over the window's targets) of each window under each of its orders."""
    length = max(len(w.tokens) for w in windows)
    tokens = torch.zeros(len(windows), length, dtype=torch.long)
    pad = torch.ones(len(windows), length, dtype=torch.bool)
    for row, w in enumerate(windows):
        tokens[row, : len(w.tokens)] = torch.tensor(w.tokens)
        pad[row, : len(w.tokens)] = False
    ragged = bool(pad.any())
    out = [[0.0] * num_orders for _ in windows]
    for s in range(num_orders):
        rows = []
        for row, w in enumerate(windows):  # each window draws its own orders: independent of the batch
            generator = torch.Generator().manual_seed(seed * 1_000_003 + w.index * 1009 + s)
            rows.append(
                sample_two_stream_batch(
                    tokens[row : row + 1],
                    policy,
                    mask_token_id=mask_token_id,
                    pad_mask=pad[row : row + 1],
                    keep_clean_bos=keep_clean_bos,
                    generator=generator,
                )
            )
        batch = {
            f: torch.cat([getattr(r, f) for r in rows]).to(device)
            for f in ("clean_tokens", "query_tokens", "position_ids", "targets", "loss_mask", "valid_len")
        }
        logits = model(
            batch["clean_tokens"], batch["query_tokens"], batch["position_ids"], batch["valid_len"] if ragged else None
        )
        nll = set_diffusion_loss(logits, batch["targets"], batch["loss_mask"], mask_token_id=mask_token_id).nll_sum
        for row, value in enumerate(nll.tolist()):
            out[row][s] = value
    return out


def _num_targets(window: Window, keep_clean_bos: bool) -> int:
    return len(window.tokens) - int(keep_clean_bos)


def summarize(records: list[dict]) -> dict:
    """NLL per token with its 95 % Monte Carlo interval over orders, perplexity, bits per byte."""
    tokens = sum(r["num_tokens"] for r in records)
    num_bytes = sum(r["num_bytes"] for r in records)
    nll = sum(sum(r["nll"]) / len(r["nll"]) for r in records)
    num_orders = len(records[0]["nll"])
    if num_orders > 1:
        var = sum(torch.tensor(r["nll"], dtype=torch.float64).var().item() / num_orders for r in records)
        half_width = 1.96 * math.sqrt(var) / tokens
    else:
        half_width = None
    per_token = nll / tokens
    return {
        "nll_per_token": per_token,
        "ci95_half_width": half_width,
        "perplexity": math.exp(per_token),
        "bits_per_byte": nll / math.log(2) / num_bytes if num_bytes else None,
        "num_windows": len(records),
        "num_tokens": tokens,
        "num_bytes": num_bytes,
        "num_orders": num_orders,
    }


def run_likelihood_job(job: LikelihoodJob) -> dict | None:
    """Returns the summary on the rank that merged (None elsewhere, or for an explicit shard)."""
    place = job.placement
    place.check()
    if job.num_orders < 1:
        raise UserError(f"--num-orders must be >= 1; got {job.num_orders}")
    ranks = join(place.tp)
    docs = read_documents(job.data, job.max_docs)
    sm = load_sampling_model(job.source, ranks, device=place.device, dtype=place.dtype)
    seq_len = job.seq_len or sm.config.max_seq_len
    if not 1 <= seq_len <= sm.config.max_seq_len:
        raise UserError(f"--seq-len must be in [1, {sm.config.max_seq_len}] (the model's max_seq_len); got {seq_len}")
    recipe_method = sm.recipe.method if sm.recipe is not None else None
    policy = _policy(job, sm, recipe_method)
    windows = _windows(docs, sm, seq_len)
    out_dir = Path(job.out)
    results = ShardedResults(
        out_dir / "windows.jsonl",
        {
            "source": str(Path(job.source).resolve()),
            "data": str(Path(job.data).resolve()),
            "order": repr(policy),
            "num_orders": job.num_orders,
            "seq_len": seq_len,
            "max_docs": job.max_docs,
            "seed": job.seed,
            "add_bos": sm.add_bos,
        },
    )
    results.check_job()
    if ranks.rank == 0:
        results.start()
    ranks.barrier()
    shard = Shard.of(ranks, place)
    writer = results.part(shard.name) if ranks.writes else None
    batches = shard.batches(len(windows), place.batch_size, results.done())
    device = next(sm.model.parameters()).device

    from setdiff_megatron.progress import progress_bar

    for _, todo in progress_bar(
        batches, desc="likelihood", unit="batch", file=sys.stderr, disable=not (place.progress and ranks.rank == 0)
    ):
        chunk = [windows[i] for i in todo]
        nll = window_nll(
            sm.model,
            chunk,
            policy,
            mask_token_id=sm.tokenizer.mask_id,
            keep_clean_bos=sm.add_bos,
            num_orders=job.num_orders,
            seed=job.seed,
            device=device,
        )
        if writer is not None:
            writer.write(
                [
                    {
                        "index": w.index,
                        "nll": values,
                        "num_tokens": _num_targets(w, sm.add_bos),
                        "num_bytes": w.num_bytes,
                    }
                    for w, values in zip(chunk, nll)
                ]
            )
    ranks.barrier()
    if ranks.rank != 0 or place.shard is not None:
        if place.shard is not None:
            say(
                f"setdiff: likelihood shard {place.shard} of {place.num_shards} done; rerun without --shard to merge",
                file=sys.stderr,
            )
        return None
    missing = results.merge(len(windows))
    if missing:
        raise UserError(f"{len(missing)} windows are still missing from {results.parts}; rerun the job to finish them")
    records = [json.loads(line) for line in results.out.read_text().splitlines()]
    summary = {**summarize(records), "order": repr(policy), "seq_len": seq_len, "source": str(job.source)}
    (out_dir / SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    ci = summary["ci95_half_width"]
    say(
        f"setdiff: NLL {summary['nll_per_token']:.4f} nats/token"
        + (f" ± {ci:.4f} (95 %, orders)" if ci else "")
        + f", perplexity {summary['perplexity']:.2f}, {summary['bits_per_byte']:.4f} bits/byte over "
        f"{summary['num_tokens']} tokens; {out_dir / SUMMARY}",
        file=sys.stderr,
    )
    return summary


def _run(args) -> int:
    from setdiff_megatron.inference.cli_args import placement_from_args, relaunch

    code = relaunch(args)
    if code is not None:
        return code
    run_likelihood_job(
        LikelihoodJob(
            source=args.source,
            data=args.data,
            out=args.out,
            order=args.order,
            d=args.d,
            num_orders=args.num_orders,
            seq_len=args.seq_len,
            max_docs=args.max_docs,
            seed=args.seed,
            placement=placement_from_args(args),
        )
    )
    return 0


def add_parser(jobs) -> None:
    from setdiff_megatron.inference.cli_args import add_job_arguments

    parser = jobs.add_parser(
        "likelihood",
        help="NLL / perplexity / bits per byte over sampled orders",
        description=__doc__.split("\n\n")[1].replace("\n", " "),
    )
    add_job_arguments(parser)
    parser.add_argument("--data", required=True, help="JSONL with a 'text' per line, or a plain text file")
    parser.add_argument("--out", required=True, help=f"directory for windows.jsonl and {SUMMARY}")
    parser.add_argument(
        "--order",
        default="training",
        help=f"order policy: {', '.join(ORDERS)} (default: the recipe's; left_to_right gives the exact AR NLL)",
    )
    parser.add_argument("--d", type=int, default=None, help="set size of --order staggered")
    parser.add_argument("--num-orders", type=int, default=8, help="orders sampled per window (default 8)")
    parser.add_argument("--seq-len", type=int, default=None, help="window length (default: max_seq_len)")
    parser.add_argument("--max-docs", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.set_defaults(func=_run)
