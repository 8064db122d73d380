"""Our models inside EleutherAI's lm-evaluation-harness (lm-eval 0.4.x) as the model type "setdiff".

lm-eval finds models only in its own registry and its command line imports no plugins, so
importing this module registers the model, and running it (`python -m
setdiff_megatron.evaluation.lm_eval_adapter`, or `setdiff eval lm-eval`) runs lm-eval's own
command line. loglikelihood is exact autoregressive scoring; generate_until runs the set sampler
with the model's own decoding policy. One process holds the whole model (no tensor parallelism);
under torchrun the processes run data parallel. Usage: docs/evaluation.md.
"""

from __future__ import annotations

import logging
import os
import sys
import time
from dataclasses import asdict, replace
from typing import Any

import torch

from setdiff_megatron.errors import UserError, require

require("lm_eval", "lm-eval", "the lm-evaluation-harness adapter")

from lm_eval.api.model import LM  # noqa: E402
from lm_eval.api.registry import register_model  # noqa: E402

from setdiff_megatron.core.orders import make_order_policy, sample_order  # noqa: E402
from setdiff_megatron.core.streams import build_two_stream_batch  # noqa: E402
from setdiff_megatron.distributed.runtime import join  # noqa: E402
from setdiff_megatron.inference.job import job_decoding  # noqa: E402
from setdiff_megatron.inference.sampling_model import load_sampling_model  # noqa: E402
from setdiff_megatron.recipes.decoding_settings import with_stops  # noqa: E402
from setdiff_megatron.sampling.decoding import SETTINGS, DecodingConfig  # noqa: E402

__all__ = ["SetDiffLM", "main"]

log = logging.getLogger(__name__)
_GEN_KWARGS = {"until", "max_gen_toks", "do_sample", "temperature", "top_k", "top_p"}


def _batch_size(value: Any) -> int:
    """lm-eval passes an int, a digit string, or 'auto[:N]' (taken as 16: no memory probing here)."""
    if isinstance(value, int):
        return max(value, 1)
    return int(value) if str(value).isdigit() else 16


@register_model("setdiff")
class SetDiffLM(LM):
    """The model type "setdiff". Model arguments: pretrained (required), every decoding setting of
    sampling/decoding.py SETTINGS by name (window, threshold, tokens_per_step, ...; window=1 is one
    token per step, threshold=none turns the threshold off), max_gen_toks (lm-eval's name for
    max_new_tokens), dtype, add_bos, context_len. Batch size and device come from lm-eval's
    --batch_size and --device. Decoding speed (tokens/s, tokens per step, NFE of generate_until)
    and the decoding policy used go to the results' "config" section (`get_model_info`)."""

    def __init__(
        self,
        pretrained: str,
        max_gen_toks: int = 256,
        dtype: str | None = None,
        add_bos: bool | None = None,
        context_len: int | None = None,
        batch_size: int | str = 16,
        max_batch_size: int | None = None,
        device: str | None = None,
        **settings: Any,
    ):
        super().__init__()
        unused = sorted(set(settings) - set(SETTINGS))
        if unused:
            log.warning("setdiff: ignoring model arguments %s", unused)
        ranks = join(1)
        self._rank, self._world_size = ranks.rank, ranks.world_size
        where = "auto" if device in (None, "auto") else "cuda" if str(device).startswith("cuda") else str(device)
        if where == "cuda" and not torch.cuda.is_available():
            # lm-eval's command line asks for cuda:0 unless told otherwise.
            log.warning("setdiff: --device %s but no GPU is visible; running on the CPU", device)
            where = "cpu"
        self.sm = load_sampling_model(pretrained, ranks, device=where, dtype=dtype)
        self.model, self.tokenizer = self.sm.model, self.sm.tokenizer
        self._device = next(self.model.parameters()).device
        self.add_bos = self.sm.add_bos if add_bos is None else add_bos
        self.max_length = context_len or self.sm.config.max_seq_len
        self.batch_size = _batch_size(batch_size)
        self.max_gen_toks = max_gen_toks
        given = {k: v for k, v in settings.items() if k in SETTINGS}
        self.decoding = with_stops(
            job_decoding({**given, "max_new_tokens": max_gen_toks}, self.sm.decoding), self.tokenizer
        )
        self.pretrained = pretrained
        self.speed = {"num_rows": 0, "num_tokens": 0, "row_steps": 0, "nfe": 0, "seconds": 0.0}

    # ----------------------------------------------------------------------------------------
    # scoring

    def _prefix(self) -> list[int]:
        return [self.tokenizer.bos_id] if self.add_bos else []

    def _pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Token ids of context and continuation. The pair is encoded whole and split where the
        context's own tokens end (so a merge across the boundary is not scored twice); when the
        tokens do not split there, each part is encoded on its own. A trailing space moves to the
        continuation, where BPE vocabularies keep it."""
        stripped = context.rstrip(" ")
        continuation = context[len(stripped) :] + continuation
        ctx = self.tokenizer.encode(stripped) if stripped else []
        whole = self.tokenizer.encode(stripped + continuation)
        cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else self.tokenizer.encode(continuation)
        prefix = self._prefix() or ([] if ctx else [self.tokenizer.eos_id])
        return prefix + ctx, cont

    @torch.no_grad()
    def _score_batch(self, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
        """Sum of log p(continuation token | everything before it) and whether greedy decoding
        gives the continuation, for (context, continuation) pairs, in one left-to-right forward.

        Exact: under the left-to-right order the query at rank r sees exactly the clean tokens
        before r, so one training forward of the two streams (core/orders.py, core/streams.py)
        gives every log p(x_r | x_<r) of the batch. MASK is excluded from the softmax, as in
        training and sampling."""
        seqs, scored = [], []
        for ctx, cont in pairs:
            seq = (ctx + cont)[-self.max_length :]  # the oldest context goes first when too long
            seqs.append(seq)
            scored.append(min(len(cont), len(seq) - 1))  # every scored token keeps one token before it
        length = max(len(s) for s in seqs)
        tokens = torch.zeros(len(seqs), length, dtype=torch.long)
        pad = torch.ones(len(seqs), length, dtype=torch.bool)
        for row, seq in enumerate(seqs):
            tokens[row, : len(seq)] = torch.tensor(seq)
            pad[row, : len(seq)] = False
        perm = sample_order(make_order_policy("left_to_right"), pad_mask=pad)
        batch = build_two_stream_batch(tokens, perm, mask_token_id=self.tokenizer.mask_id, pad_mask_BL=pad)
        dev = self._device
        logits = self.model(
            batch.clean_tokens.to(dev),
            batch.query_tokens.to(dev),
            batch.position_ids.to(dev),
            batch.valid_len.to(dev) if bool(pad.any()) else None,
        )
        logits = logits.float().index_fill(-1, torch.tensor([self.tokenizer.mask_id], device=dev), float("-inf"))
        logp = logits.log_softmax(-1)
        greedy = logits.argmax(-1)
        out = []
        for row, (seq, n) in enumerate(zip(seqs, scored)):
            target = torch.tensor(seq[len(seq) - n :], device=dev)
            span = slice(len(seq) - n, len(seq))
            value = logp[row, span].gather(-1, target[:, None]).double().sum().item()
            out.append((value, bool((greedy[row, span] == target).all())))
        return out

    def _score(
        self, pairs: list[tuple[list[int], list[int]]], desc: str, disable_tqdm: bool = False
    ) -> list[tuple[float, bool]]:
        from setdiff_megatron.progress import progress_bar

        if self.sm.family != "set_diffusion":
            raise UserError(
                f"{desc}: a {self.sm.family} model has no left-to-right likelihood to score with; "
                "evaluate it on generate_until tasks"
            )

        # Longest first: batches of similar lengths pad little, and a too-large batch fails first.
        order = sorted(range(len(pairs)), key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))
        out: list[tuple[float, bool] | None] = [None] * len(pairs)
        for first in progress_bar(
            range(0, len(order), self.batch_size),
            desc=desc,
            unit="batch",
            file=sys.stderr,
            disable=self.rank != 0 or disable_tqdm,
        ):
            chunk = order[first : first + self.batch_size]
            for i, result in zip(chunk, self._score_batch([pairs[i] for i in chunk])):
                out[i] = result
        return out  # type: ignore[return-value]

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return self._score([self._pair(*req.args) for req in requests], "loglikelihood", disable_tqdm)

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Windows of max_length tokens; each token is scored once, with as much context as fits."""
        pairs, owner = [], []
        step = self.max_length - 1
        for n, req in enumerate(requests):
            ids = (self._prefix() or [self.tokenizer.eos_id]) + self.tokenizer.encode(req.args[0])
            for start in range(1, len(ids), step):
                end = min(start + step, len(ids))
                pairs.append((ids[max(0, end - self.max_length) : start], ids[start:end]))
                owner.append(n)
        totals = [0.0] * len(requests)
        for n, (value, _) in zip(owner, self._score(pairs, "loglikelihood_rolling", disable_tqdm)):
            totals[n] += value
        return totals

    # ----------------------------------------------------------------------------------------
    # generation

    def _decoding(self, gen_kwargs: dict[str, Any]) -> tuple[DecodingConfig, tuple[str, ...]]:
        unknown = set(gen_kwargs) - _GEN_KWARGS
        if unknown:
            log.warning("setdiff: ignoring gen_kwargs %s", sorted(unknown))
        until = gen_kwargs.get("until") or ()
        until = (until,) if isinstance(until, str) else tuple(u for u in until if u)
        cfg = replace(self.decoding, max_new_tokens=int(gen_kwargs.get("max_gen_toks", self.max_gen_toks)))
        if gen_kwargs.get("do_sample") is False:
            cfg = replace(cfg, temperature=0.0)
        elif gen_kwargs.get("do_sample") or gen_kwargs.get("temperature"):
            cfg = replace(
                cfg,
                temperature=float(gen_kwargs.get("temperature") or 1.0),
                top_k=gen_kwargs.get("top_k", cfg.top_k),
                top_p=gen_kwargs.get("top_p", cfg.top_p),
            )
        return with_stops(cfg, self.tokenizer, until, skip_unusable=True), until

    def _prompt(self, context: str, cfg: DecodingConfig) -> list[int]:
        """The context formatted as the model's training rows began (its BOS, a prompt EOS, as
        `setdiff sample` does), then its last tokens that leave room for one window (the sampler
        evicts beyond that)."""
        ids = self.sm.prompt_format(self.add_bos).prompt(self.tokenizer.encode(context)).tolist()
        room = self.max_length - 1 - min(cfg.max_new_tokens, cfg.window)
        return ids[-room:] if len(ids) > room else ids

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Every request through one continuous-batching engine of batch_size rows, each with the
        policy of its own gen_kwargs (max_gen_toks, do_sample, temperature, top_k, top_p); request
        n samples with seed + n. `until` strings stop decoding (their tokens, best effort) and cut
        the text (exact)."""
        from setdiff_megatron.evaluation.tasks import cut_at_stop
        from setdiff_megatron.progress import progress_bar
        from setdiff_megatron.sampling.sample_request import Request

        engine = self.sm.sampler(context_len=self.max_length, max_rows=self.batch_size)
        untils = {}
        for n, req in enumerate(requests):
            cfg, untils[n] = self._decoding(req.args[1])
            engine.submit(Request(key=n, prompt=tuple(self._prompt(req.args[0], cfg)), cfg=cfg, seed=cfg.seed + n))
        out: list[str | None] = [None] * len(requests)
        start = time.perf_counter()
        with progress_bar(
            total=len(requests),
            desc="generate_until",
            unit="request",
            file=sys.stderr,
            disable=self.rank != 0 or disable_tqdm,
        ) as bar:
            while not engine.idle:
                finished = engine.step()
                for n, row in finished:
                    out[n] = cut_at_stop(self.tokenizer.decode(row.completion, skip_special_tokens=True), untils[n])
                    for key, value in (
                        ("nfe", row.nfe),
                        ("num_rows", 1),
                        ("num_tokens", row.num_decoded),
                        ("row_steps", row.steps),
                    ):
                        self.speed[key] += value
                bar.update(len(finished))
        self.speed["seconds"] += time.perf_counter() - start
        return out  # type: ignore[return-value]

    # ----------------------------------------------------------------------------------------
    # lm-eval plumbing: data parallel over torchrun processes, model info in the results

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return tensor
        import torch.distributed as dist

        parts = [torch.zeros_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor)
        return torch.stack(parts) if tensor.dim() == 0 else torch.cat(parts)

    def gather_object(self, obj, dst: int = 0):
        if self.world_size == 1:
            return [obj]
        import torch.distributed as dist

        gathered = [None] * self.world_size if self.rank == dst else None
        dist.gather_object(obj, gathered, dst=dst)
        return gathered

    def barrier(self) -> None:
        if self.world_size > 1:
            import torch.distributed as dist

            dist.barrier()

    def get_model_info(self) -> dict[str, Any]:
        s = self.speed
        speed = {
            "rows": s["num_rows"],
            "tokens": s["num_tokens"],
            "tokens_per_s": s["num_tokens"] / s["seconds"] if s["seconds"] else None,
            "tokens_per_step": s["num_tokens"] / s["row_steps"] if s["row_steps"] else None,
            "mean_nfe": s["nfe"] / s["num_rows"] if s["num_rows"] else None,
        }
        decoding = {k: v for k, v in asdict(self.decoding).items() if k not in ("eos_token_ids", "stop_sequences")}
        return {
            "setdiff": {
                "pretrained": str(self.pretrained),
                "decoding": decoding,
                "batch_size": self.batch_size,
                "max_length": self.max_length,
                "generate_until_speed": speed,
            }
        }


def main(argv: list[str] | None = None) -> None:
    """lm-eval's own command line, with "setdiff" registered."""
    from lm_eval.__main__ import cli_evaluate

    if argv is not None:
        sys.argv = ["lm-eval", *argv]
    cli_evaluate()


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
