"""Decoding of the paper's masked-diffusion baselines, MDLM and BD3-LM, as the reference decodes them.

It serves the engine API of sampling/engine.py (submit, step, cancel, progress, generate), so
every entry point (sample, eval, lm-eval, serve, the Hugging Face export) runs the baselines as it runs
set diffusion.
Rows decode in blocks of cfg.block_size positions, left to right: BD3-LM over a KV cache of clean
blocks, updated once per block; MDLM without a cache, running its whole canvas every step. A row
decodes token for token as it would alone. Block placement, infilling and what counts as a step:
docs/method.md, "The baselines".
"""

from __future__ import annotations

import time
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field

import torch

from setdiff_megatron.sampling.block_cache import BlockKVCache
from setdiff_megatron.sampling.decoding import DecodingConfig, RowPolicy, choose_tokens, process_logits, select_queries
from setdiff_megatron.sampling.engine import Sampler
from setdiff_megatron.sampling.sample_output import Progress, RowResult, StepTrace
from setdiff_megatron.sampling.sample_request import Request

__all__ = ["FAMILIES", "MaskedDiffusionSampler"]

FAMILIES = ("mdlm", "bd3lm")


@dataclass
class _Row:
    request: Request
    canvas: list[int]
    prompt_len: int
    end: int
    """The end of the canvas asked for (prompt and max_new_tokens); MDLM's may run past it."""
    blocks: list[int]
    """The start of each block left to decode."""
    block_size: int
    generator: torch.Generator | None
    admitted_s: float
    pending: list[tuple[int, int, int]] = field(default_factory=list)
    """(token, position, group) of clean tokens to commit in the next step: the prompt prefix,
    or the block just decided."""
    prefilled: bool = False
    shift: int = 0
    """Model position minus canvas position of the blocks (cfg.cache_infill_input), else 0."""
    steps: int = 0
    nfe: int = 0
    decoded: int = 0
    busy_s: float = 0.0
    prefill_s: float = 0.0
    trace: list[StepTrace] | None = None
    reported: int = 0
    stop_end: int | None = None

    @property
    def block(self) -> tuple[int, int]:
        """(start, end) of the block being decoded; a block cut short by the prompt's end runs without
        the MASK padding the reference gives it."""
        start = self.blocks[0]
        return start, min(start + self.block_size, len(self.canvas))


class MaskedDiffusionSampler(Sampler):
    """The MDLM or BD3-LM decoder over a model body's `step` (sampling/step_runner.py StepModel)."""

    def __init__(
        self,
        model,
        *,
        family: str,
        mask_token_id: int,
        context_len: int,
        max_rows: int | None = None,
        trace: bool = False,
    ):
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}; got {family!r}")
        super().__init__(model, mask_token_id=mask_token_id, context_len=context_len, max_rows=max_rows, trace=trace)
        self.family = family
        self.rows: list[_Row] = []
        self._cache: BlockKVCache | None = None

    # ----------------------------------------------------------------------------------------
    # requests

    def request_problem(self, prompt: Sequence[int], cfg: DecodingConfig) -> str | None:
        """Why `prompt` cannot be decoded under `cfg` (to follow the prompt's name), or None."""
        mask = self.mask_token_id
        if any(int(t) < 0 for t in prompt):
            return "must hold token ids >= 0"
        for seq in (*((t,) for t in cfg.eos_token_ids), *cfg.stop_sequences):
            if mask in seq:
                return f"has stop sequences or eos_token_ids containing the MASK token {mask}: {seq}"
        if cfg.block_size is None:
            return f"needs a block size: {self.family} decodes block by block (block_size)"
        if not any(int(t) == mask for t in prompt) and cfg.max_new_tokens == 0:
            return "has nothing to decode: no MASK token and max_new_tokens=0"
        if len(prompt) + cfg.max_new_tokens > self.context_len:
            return (
                f"is longer than the context: its {len(prompt)} tokens plus max_new_tokens "
                f"({cfg.max_new_tokens}) must be <= context_len = {self.context_len}"
            )
        cached = _cached_input(prompt, cfg, mask) if self.family == "bd3lm" else None
        if cached is not None:
            size, length = cfg.block_size, len(prompt) + cfg.max_new_tokens
            masked = [i for i, t in enumerate([*prompt, *[mask] * cfg.max_new_tokens]) if t == mask]
            first, last = masked[0] // size * size, masked[-1] // size * size
            end = cached + last - first + min(size, length - last)  # a last block cut short runs short
            if end > self.context_len:
                return (
                    f"is too long for cache_infill_input: its {cached} cached tokens and the blocks from its first "
                    f"MASK to its last run to position {end}, past context_len = {self.context_len}; decode it "
                    "without cache_infill_input"
                )
        return None

    def warm_up(self, cfg: DecodingConfig, prompt_len: int, progress=None) -> float:
        """Nothing to compile: these decoders run eagerly."""
        return 0.0

    def _fresh(self, max_rows: int, trace: bool) -> MaskedDiffusionSampler:
        return MaskedDiffusionSampler(
            self.model,
            family=self.family,
            mask_token_id=self.mask_token_id,
            context_len=self.context_len,
            max_rows=max_rows,
            trace=trace,
        )

    # ----------------------------------------------------------------------------------------
    # admission

    def _new_row(self, request: Request) -> _Row:
        cfg, mask, size = request.cfg, self.mask_token_id, request.cfg.block_size
        canvas = list(request.prompt) + [mask] * cfg.max_new_tokens
        end = len(canvas)
        masked = [i for i, t in enumerate(canvas) if t == mask]
        generating = masked[0] >= len(request.prompt)
        if generating:  # ceil(N / S) blocks from the prompt's end, aligned or not
            first = masked[0] // size * size if cfg.align_inputs_to_blocks else masked[0]
            starts = [first + j * size for j in range(-(-cfg.max_new_tokens // size))]
            if self.family == "mdlm":  # the last block whole, on the reference's MASK padding
                canvas += [mask] * (min(starts[-1] + size, self.context_len) - end)
        else:  # infilling: every block that holds a MASK
            starts = sorted({i // size * size for i in masked})
        row = _Row(
            request=request,
            canvas=canvas,
            prompt_len=len(request.prompt),
            end=end,
            blocks=[s for s in starts if s < len(canvas)],
            block_size=size,
            generator=torch.Generator().manual_seed(request.seed) if cfg.temperature > 0 else None,
            admitted_s=time.perf_counter(),
            trace=[] if self.trace else None,
        )
        if self.family == "bd3lm":  # clean x0 blocks: the prompt before the first block, or the input's whole blocks
            cached = _cached_input(request.prompt, cfg, mask)
            row.pending = [(canvas[p], p, p // size) for p in range(row.blocks[0] if cached is None else cached)]
            row.shift = 0 if cached is None else cached - row.blocks[0]
        return row

    def _admit(self) -> None:
        joining = []
        while self.waiting and (self.max_rows is None or len(self.rows) + len(joining) < self.max_rows):
            joining.append(self._new_row(self.waiting.pop(0)))
        if not joining:
            return
        self.rows += joining
        if self.family == "bd3lm":  # the cache's rows are the live rows, in order
            new = BlockKVCache(self.model.cache_spec(), len(joining), self.context_len)
            self._cache = new if self._cache is None else self._cache.cat(new)

    # ----------------------------------------------------------------------------------------
    # a step

    def _step_inputs(self, device) -> tuple[torch.Tensor | None, ...]:
        """(tokens, positions, commit_valid, commit_groups, query_valid, query_groups) [R, T] of the
        live rows: each row's pending commits then its queries, padded; BD3-LM's cache rows in row
        order. A query's group is its model position // S (BD3-LM); MDLM's window is one group
        (None: no group mask to build over its whole canvas)."""
        mask = self.mask_token_id
        commits = [r.pending for r in self.rows]
        if self.family == "mdlm":  # the whole canvas, padded with MASKs to the context length
            queries = [r.canvas + [mask] * (self.context_len - len(r.canvas)) for r in self.rows]
            query_pos = [list(range(len(q))) for q in queries]
        else:
            queries = [[] if r.pending and not r.prefilled else r.canvas[slice(*r.block)] for r in self.rows]
            query_pos = [
                list(range(r.block[0] + r.shift, r.block[1] + r.shift)) if q else [] for r, q in zip(self.rows, queries)
            ]
        num_commit = max((len(c) for c in commits), default=0)
        num_query = max(len(q) for q in queries)
        tokens, positions, commit_valid, commit_groups, query_valid, query_groups = [], [], [], [], [], []
        for r, c, q, qp in zip(self.rows, commits, queries, query_pos):
            pad_c, pad_q = num_commit - len(c), num_query - len(q)
            tokens.append([t for t, _, _ in c] + [mask] * pad_c + q + [mask] * pad_q)
            positions.append([p for _, p, _ in c] + [0] * pad_c + qp + [0] * pad_q)
            commit_valid.append([True] * len(c) + [False] * pad_c)
            commit_groups.append([g for _, _, g in c] + [0] * pad_c)
            query_valid.append([True] * len(q) + [False] * pad_q)
            query_groups.append([p // r.block_size for p in qp] + [0] * pad_q)

        def tensor(values, dtype=torch.long):
            return torch.tensor(values, dtype=dtype, device=device).view(len(self.rows), -1)

        return (
            tensor(tokens),
            tensor(positions),
            tensor(commit_valid, torch.bool),
            tensor(commit_groups),
            tensor(query_valid, torch.bool),
            tensor(query_groups) if self.family == "bd3lm" else None,
        )

    @torch.inference_mode()
    def step(self) -> list[tuple[Hashable, RowResult]]:
        """One engine step: admit, one forward, decide, retire; the rows that finished."""
        finished = self._retire([i for i, r in enumerate(self.rows) if r.request.key in self._cancelled], "cancelled")
        self._admit()
        if not self.rows:
            return finished
        t0 = time.perf_counter()
        device = next(iter(self.model.parameters())).device
        tokens, positions, commit_valid, commit_groups, query_valid, query_groups = self._step_inputs(device)
        num_commit = commit_valid.shape[1]
        cache = self._cache if self.family == "bd3lm" else BlockKVCache(self.model.cache_spec(), len(self.rows), 0)
        cache.begin_step(commit_valid, commit_groups, query_valid, query_groups)
        t_model = time.perf_counter()
        logits = self.model.step(tokens, positions, cache, num_commit, commit_valid)  # advances the cache
        self.metrics.forward_s += time.perf_counter() - t_model
        self.metrics.forwards += 1
        prefilling = [not bool(v.any()) for v in query_valid]
        self._decide(logits, tokens[:, num_commit:], query_valid)
        elapsed = time.perf_counter() - t0
        if any(prefilling):
            self.metrics.prefill_s += elapsed
        for r, prefill in zip(self.rows, prefilling):
            r.busy_s += elapsed / len(self.rows)
            r.prefill_s += elapsed if prefill else 0.0
        done = [i for i, r in enumerate(self.rows) if not r.blocks or r.stop_end is not None]
        return finished + self._retire(done, "auto")

    def _decide(self, logits: torch.Tensor, query_tokens: torch.Tensor, query_valid: torch.Tensor) -> None:
        """Commit each deciding row's tokens in its block; rows that only prefilled go on next step."""
        deciding = [i for i, r in enumerate(self.rows) if query_valid[i].any()]
        for r in self.rows:
            r.nfe += 1
            if r.pending and self.family == "bd3lm":
                r.prefilled, r.pending = True, []
        if not deciding:
            return
        index = torch.tensor(deciding, device=logits.device)
        rows = [self.rows[i] for i in deciding]
        starts = [(r.block[0] if self.family == "bd3lm" else 0) for r in rows]
        width = max(r.block[1] - r.block[0] for r in rows)
        # Each row's block positions, as query slots (BD3-LM: its queries are the block; MDLM: the canvas).
        slot = torch.tensor(
            [
                [r.block[0] - s + j if j < r.block[1] - r.block[0] else 0 for j in range(width)]
                for r, s in zip(rows, starts)
            ],
            device=logits.device,
        )
        in_block = torch.tensor(
            [[j < r.block[1] - r.block[0] for j in range(width)] for r in rows], device=logits.device
        )
        block_logits = logits[index].gather(1, slot[..., None].expand(-1, -1, logits.shape[-1]))
        block_tokens = query_tokens[index].gather(1, slot)
        todo = (block_tokens == self.mask_token_id) & in_block
        policy = RowPolicy.from_configs([r.request.cfg for r in rows], device=logits.device)
        processed = process_logits(
            block_logits, _padded_canvas(rows, self.mask_token_id, logits.device), policy, self.mask_token_id
        )
        token, confidence = choose_tokens(processed, policy, [r.generator for r in rows], [width] * len(rows))
        chosen = select_queries(confidence, todo, policy)
        logp = confidence.double().log().tolist()
        for r, picks, tok, open_, lp in zip(rows, chosen.tolist(), token.tolist(), todo.tolist(), logp):
            start, end = r.block
            new = [(start + j, tok[j]) for j in range(end - start) if picks[j]]
            for p, t in new:
                r.canvas[p] = t
            r.decoded += len(new)
            r.steps += 1
            if r.trace is not None:
                r.trace.append(
                    StepTrace(
                        queried=[start + j for j in range(end - start) if open_[j]],
                        decoded=new,
                        logprobs=[lp[j] for j in range(end - start) if picks[j]],
                    )
                )
            if self.mask_token_id not in r.canvas[start:end]:
                self._block_done(r)

    def _block_done(self, r: _Row) -> None:
        start, end = r.block
        r.blocks.pop(0)
        r.stop_end = _stop_end(r.canvas, r.prompt_len, min(end, r.end), r.request.cfg)
        while r.blocks and self.mask_token_id not in r.canvas[slice(*r.block)]:  # nothing to decode there
            r.blocks.pop(0)
        if self.family == "bd3lm" and r.blocks and r.stop_end is None:
            nxt = r.blocks[0]
            r.pending = [(r.canvas[p], p + r.shift, (p + r.shift) // r.block_size) for p in range(start, nxt)]

    # ----------------------------------------------------------------------------------------
    # retirement

    def progress(self, keys: set[Hashable] | None = None) -> list[Progress]:
        """The live rows (of `keys`, or all) whose decided completion prefix grew since the last call."""
        out = []
        for r in self.rows:
            if keys is not None and r.request.key not in keys:
                continue
            tail = r.canvas[r.prompt_len : r.end]
            upto = next((i for i, t in enumerate(tail) if t == self.mask_token_id), len(tail))
            if upto > r.reported:
                out.append(Progress(r.request.key, tail[r.reported : upto]))
                r.reported = upto
        return out

    def _retire(self, index: list[int], reason: str) -> list[tuple[Hashable, RowResult]]:
        if not index:
            return []
        now, out = time.perf_counter(), []
        for i in index:
            r = self.rows[i]
            self._cancelled.discard(r.request.key)
            end = r.stop_end if r.stop_end is not None else r.end
            kept = [t for t in r.canvas[:end] if t != self.mask_token_id]  # undecided positions dropped
            finish = reason if reason == "cancelled" else ("stop" if r.stop_end is not None else "length")
            out.append(
                (
                    r.request.key,
                    RowResult(
                        tokens=kept,
                        prompt_len=sum(1 for t in r.canvas[: r.prompt_len] if t != self.mask_token_id),
                        num_decoded=r.decoded,
                        finish_reason=finish,
                        steps=r.steps,
                        nfe=r.nfe,
                        seconds=now - r.admitted_s,
                        prefill_s=r.prefill_s,
                        busy_s=r.busy_s,
                        trace=r.trace,
                    ),
                )
            )
        keep = [i for i in range(len(self.rows)) if i not in set(index)]
        self.rows = [self.rows[i] for i in keep]
        if self._cache is not None:
            self._cache = self._cache.select(keep) if keep else None
        return out


def _cached_input(prompt: Sequence[int], cfg: DecodingConfig, mask: int) -> int | None:
    """How many of an infilling prompt's tokens BD3-LM caches under cfg.cache_infill_input (its
    whole blocks, as the reference's prefill: none when it is shorter than a block), else None."""
    if not cfg.cache_infill_input or not any(int(t) == mask for t in prompt):
        return None
    return len(prompt) // cfg.block_size * cfg.block_size


def _padded_canvas(rows: list[_Row], mask: int, device) -> torch.Tensor:
    """The rows' canvases [R, longest] padded with MASK (the repetition penalty reads the tokens present)."""
    width = max(len(r.canvas) for r in rows)
    return torch.tensor([r.canvas + [mask] * (width - len(r.canvas)) for r in rows], device=device)


def _stop_end(canvas: list[int], prompt_len: int, upto: int, cfg: DecodingConfig) -> int | None:
    """The end of the first EOS or stop sequence in the completion's decided part canvas[prompt_len:upto]."""
    stops = [(t,) for t in cfg.eos_token_ids] + [tuple(s) for s in cfg.stop_sequences]
    best = None
    for seq in stops:
        n = len(seq)
        for end in range(prompt_len + n, upto + 1):
            if tuple(canvas[end - n : end]) == seq:
                best = end if best is None else min(best, end)
                break
    return best
