"""Set-causal ring attention: context parallelism over the rank-ordered sequence.

Each of the `cp` ranks holds two of the 2·cp equal chunks of each stream, chunk r and chunk
2·cp-1-r ("zigzag"), so every rank does the same causal work. Only the clean stream's keys and
values travel around the ring (a query's own key is local). Partial results merge by log-sum-exp,
then the diagonal (docs/method.md, "Fused kernels"): exact against single-rank attention.

Shapes: B batch, H query heads, G key/value heads, C ranks per chunk, D head dim; q/k/v are
[B, heads, 4C, D], the clean stream's 2C local ranks then the query stream's (q: [B, H, 2C, D]
with the query rows only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from setdiff_megatron.core.merged_attention import ATEN_FLASH, PartialAttention

__all__ = ["ring_set_causal_attention", "zigzag_ranks"]


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of a stream's 2·cp chunks that context-parallel rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_ranks(length: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global ranks (positions in the order) of one stream's local rows, [2C]."""
    if length % (2 * cp):
        raise ValueError(
            f"context parallelism splits each stream into 2 x cp = {2 * cp} chunks: the sequence "
            f"length ({length}) must be divisible by {2 * cp}"
        )
    size = length // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in zigzag_chunks(cp, rank)])


@dataclass
class _Ring:
    """The context-parallel group seen as a ring: who sends to whom."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> _Ring:
        if group is None or not dist.is_initialized():
            return cls(None, 1, 0)
        return cls(group, dist.get_world_size(group), dist.get_rank(group))

    def source(self, step: int) -> int:
        """The ring rank whose block this rank holds at `step`."""
        return (self.rank - step) % self.size

    def pass_on(self, tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list]:
        """Start sending `tensors` to the next rank and receiving the previous rank's; returns the
        receive buffers and the pending requests (wait on them before reading the buffers)."""
        nxt = dist.get_global_rank(self.group, (self.rank + 1) % self.size)
        prv = dist.get_global_rank(self.group, (self.rank - 1) % self.size)
        received = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t.contiguous(), nxt, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, r, prv, self.group) for r in received]
        return received, dist.batch_isend_irecv(ops)


def _rotated(x: torch.Tensor, last: torch.Tensor | float) -> torch.Tensor:
    """Rows moved up one slot along dim 2 (slot j holds row j+1), `last` in the final slot."""
    out = torch.empty_like(x)
    out[:, :, :-1] = x[:, :, 1:]
    out[:, :, -1] = last
    return out


def _unrotated(x: torch.Tensor, first: float = 0.0) -> torch.Tensor:
    """The inverse for rows 1..: slot j's result belongs to row j+1; row 0 gets `first`."""
    out = torch.full_like(x, first)
    out[:, :, 1:] = x[:, :, :-1]
    return out


def _blocks(row_chunks: tuple[int, int], key_chunks: tuple[int, int], size: int):
    """(row slice, key slice, kind) of every pair with work: kind 'full' or 'diagonal'.

    For row chunk a and key chunk b: a > b, every row sees every key (one non-causal call); a == b,
    clean rows are causal and query rows strictly causal (one causal call each, the query rows
    rotated by one slot); a < b, nothing."""
    for i, a in enumerate(row_chunks):
        for j, b in enumerate(key_chunks):
            if a >= b:
                yield slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size), "full" if a > b else "diagonal"


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor, o_lse: torch.Tensor) -> None:
    """Fold a partial result (o, o_lse) into rows `rows` of (out, lse). A row that saw no key in a
    block has o_lse = -inf and is left as it was (a row that has seen none at all stays 0, -inf)."""
    o, o_lse = o.to(out.dtype), o_lse.to(lse.dtype)
    old = lse[:, :, rows]
    new = torch.logaddexp(old, o_lse)
    seen = ~torch.isneginf(new)
    keep = torch.where(seen, torch.exp(old - new), 0.0)[..., None]
    take = torch.where(seen, torch.exp(o_lse - new), 0.0)[..., None]
    out[:, :, rows] = out[:, :, rows] * keep + o * take
    lse[:, :, rows] = new


@dataclass
class _KernelBlocks:
    """A block's attention by the fixed-mask kernel: all, causal (clean rows) or strictly causal
    (query rows, rotated by one slot so that plain causal attention gives keys < row). Each
    forward returns the kernel's `aux`, and the backward of the same block gets it back: TE's
    backward needs its rng state and backend, PyTorch's CUDA flash backward its sequence data."""

    kernel: PartialAttention
    scale: float

    def forward(self, stream: str, kind: str, q, k, v, rows, keys):
        if kind == "full" or stream == "x":
            return self.kernel.forward(q, k, v, scale=self.scale, causal=kind == "diagonal")
        o, o_lse, aux = self.kernel.forward(_rotated(q, q[:, :, 0]), k, v, scale=self.scale, causal=True)
        return _unrotated(o), _unrotated(o_lse, float("-inf")), aux  # a chunk's first query sees none of it

    def backward(self, stream: str, kind: str, dout, q, k, v, out, lse, aux, rows, keys):
        causal = kind == "diagonal"
        if not (causal and stream == "m"):
            return self.kernel.backward(dout, q, k, v, out, lse, aux, scale=self.scale, causal=causal)
        # The dropped last slot (the chunk's first query) gets no gradient: dO = 0, and lse = inf makes P = 0.
        dq, dk, dv = self.kernel.backward(
            _rotated(dout, 0.0),
            _rotated(q, q[:, :, 0]),
            k,
            v,
            _rotated(out, out[:, :, 0]),
            _rotated(lse, float("inf")),
            aux,
            scale=self.scale,
            causal=True,
        )
        return _unrotated(dq), dk, dv


@dataclass
class _DocumentBlocks:
    """A block's attention under the set-causal rule AND same-document, as explicit masked
    attention (the documents make the mask arbitrary in rank order); `document_ids` [B, L] of the
    whole sequence, so any rank's chunks can be masked without sending them."""

    document_ids: torch.Tensor
    scale: float

    def _mask(self, stream: str, rows: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
        causal = rows[:, None] >= keys[None, :] if stream == "x" else rows[:, None] > keys[None, :]
        same = self.document_ids[:, rows, None] == self.document_ids[:, None, keys]
        return (causal & same)[:, None]  # [B, 1, R, K]

    def _probs(self, stream, q, k, lse, rows, keys) -> tuple[torch.Tensor, torch.Tensor]:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
        mask = self._mask(stream, rows, keys)
        scores = (q @ k.transpose(-1, -2)) * self.scale
        if lse is None:
            lse = torch.logsumexp(scores.masked_fill(~mask, float("-inf")), dim=-1)
        safe = torch.where(torch.isneginf(lse), 0.0, lse)[..., None]
        return torch.where(mask, torch.exp(scores - safe), 0.0), lse

    def forward(self, stream, kind, q, k, v, rows, keys):
        probs, lse = self._probs(stream, q, k, None, rows, keys)
        return probs @ v.repeat_interleave(q.shape[1] // v.shape[1], dim=1), lse, None

    def backward(self, stream, kind, dout, q, k, v, out, lse, aux, rows, keys):
        g = q.shape[1] // k.shape[1]
        probs, _ = self._probs(stream, q, k, lse, rows, keys)
        dp = dout @ v.repeat_interleave(g, dim=1).transpose(-1, -2)
        ds = probs * (dp - (dout * out).sum(-1, keepdim=True)) * self.scale
        dq = ds @ k.repeat_interleave(g, dim=1)
        dk = (ds.transpose(-1, -2) @ q).unflatten(1, (k.shape[1], g)).sum(2)
        dv = (probs.transpose(-1, -2) @ dout).unflatten(1, (k.shape[1], g)).sum(2)
        return dq, dk, dv


class _RingSetCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring: _Ring, blocks: _KernelBlocks | _DocumentBlocks, length: int):
        local = k.shape[2] // 2  # 2C ranks per stream on this rank
        size, num_kv = local // 2, k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        query_only = q.shape[2] == local
        q_x, q_m = (None, q) if query_only else (q[:, :, :local], q[:, :, local:])
        streams = {"x": q_x, "m": q_m} if q_x is not None else {"m": q_m}
        mine = zigzag_ranks(length, ring.size, ring.rank, device=q.device)
        out = {s: torch.zeros(x.shape, dtype=acc, device=q.device) for s, x in streams.items()}
        lse = {s: torch.full(x.shape[:3], float("-inf"), dtype=acc, device=q.device) for s, x in streams.items()}
        block = [k[:, :, :local].contiguous(), v[:, :, :local].contiguous()]
        auxes = {}  # (step, row chunk, key chunk, stream) -> the kernel's aux, for the backward
        for step in range(ring.size):
            # The next block's transfer overlaps this step's kernel calls where the backend runs
            # sends in the background (gloo, NCCL).
            pending = ring.pass_on(block) if step + 1 < ring.size else None
            source = ring.source(step)
            theirs = zigzag_ranks(length, ring.size, source, device=q.device)
            for r, c, kind in _blocks(zigzag_chunks(ring.size, ring.rank), zigzag_chunks(ring.size, source), size):
                for name, qs in streams.items():
                    o, o_lse, auxes[step, r.start, c.start, name] = blocks.forward(
                        name, kind, qs[:, :, r], block[0][:, :, c], block[1][:, :, c], mine[r], theirs[c]
                    )
                    _merge(out[name], lse[name], r, o, o_lse)
            if pending is not None:
                block, requests = pending
                for request in requests:
                    request.wait()
        # The diagonal: each query's own key and value (local), merged last.
        g = q_m.shape[1] // num_kv
        k_m, v_m = (t[:, :, local:].repeat_interleave(g, dim=1).to(acc) for t in (k, v))
        s_diag = (q_m.to(acc) * k_m).sum(-1) * blocks.scale
        lse_m = torch.logaddexp(lse["m"], s_diag)
        out["m"] = out["m"] * torch.exp(lse["m"] - lse_m)[..., None] + v_m * torch.exp(s_diag - lse_m)[..., None]
        lse["m"] = lse_m
        result = torch.cat(list(out.values()), dim=2).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, torch.cat(list(lse.values()), dim=2))
        ctx.ring, ctx.blocks, ctx.length, ctx.auxes = ring, blocks, length, auxes
        return result

    @staticmethod
    def backward(ctx, dout):
        # The ring again, the kernel backward fed the MERGED output and log-sum-exp (exact, as in
        # ring attention); each visiting block's dK/dV travel with it back to its owner.
        q, k, v, out, lse = ctx.saved_tensors
        ring, blocks, length, scale = ctx.ring, ctx.blocks, ctx.length, ctx.blocks.scale
        local = k.shape[2] // 2
        size, num_kv = local // 2, k.shape[1]
        g = q.shape[1] // num_kv
        acc = torch.promote_types(q.dtype, torch.float32)
        query_only = q.shape[2] == local
        dout = dout.contiguous()
        split = 0 if query_only else local
        streams = {"m": slice(split, None)} | ({} if query_only else {"x": slice(0, local)})
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        mine = zigzag_ranks(length, ring.size, ring.rank, device=q.device)
        block = [
            k[:, :, :local].contiguous(),
            v[:, :, :local].contiguous(),
            torch.zeros(k[:, :, :local].shape, dtype=acc, device=k.device),
            torch.zeros(v[:, :, :local].shape, dtype=acc, device=v.device),
        ]
        for step in range(ring.size):
            source = ring.source(step)
            theirs = zigzag_ranks(length, ring.size, source, device=q.device)
            kx, vx, dkx, dvx = block
            for r, c, kind in _blocks(zigzag_chunks(ring.size, ring.rank), zigzag_chunks(ring.size, source), size):
                for name, span in streams.items():
                    rr = slice(span.start + r.start, span.start + r.stop)
                    dqb, dkb, dvb = blocks.backward(
                        name,
                        kind,
                        dout[:, :, rr],
                        q[:, :, rr],
                        kx[:, :, c],
                        vx[:, :, c],
                        out[:, :, rr],
                        lse[:, :, rr].contiguous(),
                        ctx.auxes[step, r.start, c.start, name],
                        mine[r],
                        theirs[c],
                    )
                    dq[:, :, rr] += dqb.to(acc)
                    dkx[:, :, c] += dkb.to(acc)
                    dvx[:, :, c] += dvb.to(acc)
            if ring.size > 1:
                # The block (and its gradients so far) goes on; after the last step only the
                # gradients travel, the one hop that returns each block's to its owner.
                sent = block if step + 1 < ring.size else block[2:]
                received, requests = ring.pass_on(sent)
                for request in requests:
                    request.wait()
                block = received if step + 1 < ring.size else block[:2] + received
        dk_x, dv_x = block[2], block[3]
        # The diagonal's gradient, analytically (docs/method.md, "Fused kernels").
        m = streams["m"]
        q_m, o_m, l_m, d_m = (t[:, :, m].to(acc) for t in (q, out, lse, dout))
        k_m, v_m = (t[:, :, local:].repeat_interleave(g, dim=1).to(acc) for t in (k, v))
        p_d = torch.exp((q_m * k_m).sum(-1) * scale - l_m)
        delta = (d_m * o_m).sum(-1)
        ds = p_d * ((d_m * v_m).sum(-1) - delta)
        dq[:, :, m] += scale * ds[..., None] * k_m
        dk_m = (scale * ds[..., None] * q_m).unflatten(1, (num_kv, g)).sum(2)
        dv_m = (p_d[..., None] * d_m).unflatten(1, (num_kv, g)).sum(2)
        dk = torch.cat([dk_x, dk_m], dim=2).to(k.dtype)
        dv = torch.cat([dv_x, dv_m], dim=2).to(v.dtype)
        return dq.to(q.dtype), dk, dv, None, None, None


def ring_set_causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: float,
    group: dist.ProcessGroup | None = None,
    valid_len: torch.Tensor | None = None,
    document_ids: torch.Tensor | None = None,
    kernel: PartialAttention = ATEN_FLASH,
) -> torch.Tensor:
    """Set-causal attention of this rank's zigzag slice of the two streams, exact against the
    single-rank attention of the whole sequence. q [B, H, 4C or 2C (query rows only), D], k/v
    [B, G, 4C, D]; valid_len [B] and document_ids [B, L] describe the WHOLE sequence (global
    ranks): padding rows are zeroed, and with document ids no row attends across documents (the
    blocks then run as explicit masked attention instead of the kernel)."""
    ring = _Ring.of(group)
    local = k.shape[2] // 2
    if k.shape[2] % 4 or q.shape[2] not in (k.shape[2], local):
        raise ValueError(
            f"ring attention takes a rank's two chunks of both streams: k [B, G, 4C, D] and q with "
            f"4C or 2C rows; got q {tuple(q.shape)}, k {tuple(k.shape)}"
        )
    length = local * ring.size
    blocks = _KernelBlocks(kernel, scale) if document_ids is None else _DocumentBlocks(document_ids, scale)
    out = _RingSetCausal.apply(q, k, v, ring, blocks, length)
    if valid_len is None:
        return out
    ranks = zigzag_ranks(length, ring.size, ring.rank, device=q.device)
    streams = q.shape[2] // local
    real = (ranks[None, :] < valid_len[:, None]).repeat(1, streams)[:, None, :, None]
    return out * real.to(out.dtype)
