"""Set-causal ring attention: context parallelism over the rank-ordered sequence.

Each of the `cp` ranks of a context-parallel group holds two of the 2·cp equal chunks of each
stream, chunk r and chunk 2·cp-1-r ("zigzag"), laid out [clean chunks ; query chunks]; with the
causal pattern every rank then does the same work. Only the clean stream's keys and values are
ever read by other ranks (a query's own key, the diagonal, is local), so the clean K/V blocks
pass around the ring by P2P, each step's transfer overlapping the step's kernel calls where the
backend runs sends in the background (gloo, NCCL). Per pair of chunks (a rows, b keys):

  a > b   every row sees every key                   one non-causal kernel call
  a == b  clean rows: causal; query rows: strictly    one causal call each; the query rows are
          causal (keys < row)                         rotated by one slot (KERNELS.md 3)
  a < b   nothing

and the partial results merge by log-sum-exp, then the query rows' diagonal as in
core/attention.py's fused implementation. The backward runs the ring again with the kernel
backward fed the MERGED output and log-sum-exp (exact, as in ring attention); each visiting
block's dK/dV travel with it and reach their owner after the last step.

Shapes: B batch, H query heads, G key/value heads, C ranks per chunk, D head dim; a rank's
local stream holds 2C ranks, so q/k/v are [B, heads, 4C, D] (q: [B, H, 2C, D] with the query
rows only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from setdiff_megatron.core.attention import ATEN_FLASH, PartialAttention

__all__ = ["ring_set_causal_attention", "zigzag_chunks", "zigzag_ranks"]


def zigzag_chunks(cp: int, rank: int) -> tuple[int, int]:
    """The two of a stream's 2·cp chunks that context-parallel rank `rank` holds."""
    return rank, 2 * cp - 1 - rank


def zigzag_ranks(length: int, cp: int, rank: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global ranks (positions in the order) of one stream's local rows, [2C]."""
    if length % (2 * cp):
        raise ValueError(f"context parallelism splits each stream into 2 x cp = {2 * cp} chunks: the sequence "
                         f"length ({length}) must be divisible by {2 * cp}")
    size = length // (2 * cp)
    return torch.cat([torch.arange(c * size, (c + 1) * size, device=device) for c in zigzag_chunks(cp, rank)])


@dataclass
class _Ring:
    """The context-parallel group seen as a ring: who sends to whom."""

    group: dist.ProcessGroup | None
    size: int
    rank: int

    @classmethod
    def of(cls, group: dist.ProcessGroup | None) -> "_Ring":
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


def _unrotated(x: torch.Tensor) -> torch.Tensor:
    """The inverse for rows 1..: slot j's result belongs to row j+1; row 0's is left zero."""
    out = torch.zeros_like(x)
    out[:, :, 1:] = x[:, :, :-1]
    return out


def _blocks(row_chunks: tuple[int, int], key_chunks: tuple[int, int], size: int):
    """(row slice, key slice, kind) of every pair with work: kind 'full' or 'diagonal'."""
    for i, a in enumerate(row_chunks):
        for j, b in enumerate(key_chunks):
            if a >= b:
                yield slice(i * size, (i + 1) * size), slice(j * size, (j + 1) * size), "full" if a > b else "diagonal"


def _merge(out: torch.Tensor, lse: torch.Tensor, rows: slice, o: torch.Tensor, l: torch.Tensor,
           valid: slice = slice(None)) -> None:
    """Fold a partial result (o, l) into rows `rows` of (out, lse); `valid` picks o's rows kept."""
    o, l = o[:, :, valid].to(out.dtype), l[:, :, valid].to(lse.dtype)
    old = lse[:, :, rows]
    new = torch.logaddexp(old, l)
    out[:, :, rows] = out[:, :, rows] * torch.exp(old - new)[..., None] + o * torch.exp(l - new)[..., None]
    lse[:, :, rows] = new


class _RingSetCausal(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, scale: float, ring: _Ring, kernel: PartialAttention):
        local = k.shape[2] // 2  # 2C ranks per stream on this rank
        size, num_kv = local // 2, k.shape[1]
        acc = torch.promote_types(q.dtype, torch.float32)
        query_only = q.shape[2] == local
        k_x, v_x = k[:, :, :local].contiguous(), v[:, :, :local].contiguous()
        q_x, q_m = (None, q) if query_only else (q[:, :, :local], q[:, :, local:])
        rows = zigzag_chunks(ring.size, ring.rank)
        out = {s: torch.zeros(x.shape, dtype=acc, device=q.device) for s, x in (("x", q_x), ("m", q_m)) if x is not None}
        lse = {s: torch.full(x.shape[:3], float("-inf"), dtype=acc, device=q.device) for s, x in (("x", q_x), ("m", q_m))
               if x is not None}
        block = [k_x, v_x]
        for step in range(ring.size):
            pending = ring.pass_on(block) if step + 1 < ring.size else None
            keys = zigzag_chunks(ring.size, ring.source(step))
            for r, c, kind in _blocks(rows, keys, size):
                kb, vb = block[0][:, :, c], block[1][:, :, c]
                if q_x is not None:
                    o, l, _ = kernel.forward(q_x[:, :, r], kb, vb, scale=scale, causal=kind == "diagonal")
                    _merge(out["x"], lse["x"], r, o, l)
                if kind == "full":
                    o, l, _ = kernel.forward(q_m[:, :, r], kb, vb, scale=scale, causal=False)
                    _merge(out["m"], lse["m"], r, o, l)
                else:  # strictly causal: rotate, then slot j (row j+1) sees keys <= j
                    qr = q_m[:, :, r]
                    o, l, _ = kernel.forward(_rotated(qr, qr[:, :, 0]), kb, vb, scale=scale, causal=True)
                    first = r.start + 1
                    _merge(out["m"], lse["m"], slice(first, r.stop), o, l, slice(0, -1))
            if pending is not None:
                block, requests = pending
                for request in requests:
                    request.wait()
        # The diagonal: each query's own key and value (local), merged last.
        g = q_m.shape[1] // num_kv
        k_m, v_m = (t[:, :, local:].repeat_interleave(g, dim=1).to(acc) for t in (k, v))
        s_diag = (q_m.to(acc) * k_m).sum(-1) * scale
        lse_m = torch.logaddexp(lse["m"], s_diag)
        out_m = out["m"] * torch.exp(lse["m"] - lse_m)[..., None] + v_m * torch.exp(s_diag - lse_m)[..., None]
        outs, lses = [out_m], [lse_m]
        if q_x is not None:
            outs, lses = [out["x"], out_m], [lse["x"], lse_m]
        result = torch.cat(outs, dim=2).to(q.dtype)
        ctx.save_for_backward(q, k, v, result, torch.cat(lses, dim=2))
        ctx.scale, ctx.ring, ctx.kernel = scale, ring, kernel
        return result

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        scale, ring, kernel = ctx.scale, ctx.ring, ctx.kernel
        local = k.shape[2] // 2
        size, num_kv = local // 2, k.shape[1]
        g = q.shape[1] // num_kv
        acc = torch.promote_types(q.dtype, torch.float32)
        query_only = q.shape[2] == local
        dout = dout.contiguous()
        split = 0 if query_only else local
        streams = {"m": slice(split, None)} | ({} if query_only else {"x": slice(0, local)})
        dq = torch.zeros(q.shape, dtype=acc, device=q.device)
        rows = zigzag_chunks(ring.size, ring.rank)
        block = [k[:, :, :local].contiguous(), v[:, :, :local].contiguous(),
                 torch.zeros(k[:, :, :local].shape, dtype=acc, device=k.device),
                 torch.zeros(v[:, :, :local].shape, dtype=acc, device=v.device)]
        for step in range(ring.size):
            keys = zigzag_chunks(ring.size, ring.source(step))
            kx, vx, dkx, dvx = block
            for r, c, kind in _blocks(rows, keys, size):
                for name, span in streams.items():
                    rr = slice(span.start + r.start, span.start + r.stop)
                    qb, ob, lb, db = q[:, :, rr], out[:, :, rr], lse[:, :, rr], dout[:, :, rr]
                    rotate = name == "m" and kind == "diagonal"
                    if rotate:  # the last slot (the chunk's first query) is dropped: no gradient, P = 0
                        qb, ob, db = _rotated(qb, qb[:, :, 0]), _rotated(ob, ob[:, :, 0]), _rotated(db, 0.0)
                        lb = _rotated(lb, float("inf"))
                    dqb, dkb, dvb = kernel.backward(db, qb, kx[:, :, c], vx[:, :, c], ob, lb, None,
                                                    scale=scale, causal=kind == "diagonal")
                    dq[:, :, rr] += _unrotated(dqb).to(acc) if rotate else dqb.to(acc)
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
        # The diagonal's gradient, analytically (KERNELS.md 3, 5a).
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


def ring_set_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                              group: dist.ProcessGroup | None = None, length: int | None = None,
                              valid_len: torch.Tensor | None = None,
                              kernel: PartialAttention = ATEN_FLASH) -> torch.Tensor:
    """Set-causal attention of this rank's zigzag slice of the two streams, exact against the
    single-rank attention of the whole sequence. q [B, H, 4C or 2C (query rows only), D], k/v
    [B, G, 4C, D]; `length` is the global L (needed with valid_len, whose padding rows are zeroed)."""
    ring = _Ring.of(group)
    local = k.shape[2] // 2
    if k.shape[2] % 4 or q.shape[2] not in (k.shape[2], local):
        raise ValueError(f"ring attention takes a rank's two chunks of both streams: k [B, G, 4C, D] and q with "
                         f"4C or 2C rows; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    out = _RingSetCausal.apply(q, k, v, scale, ring, kernel)
    if valid_len is None:
        return out
    ranks = zigzag_ranks(length or local * ring.size, ring.size, ring.rank, device=q.device)
    streams = q.shape[2] // local
    real = (ranks[None, :] < valid_len[:, None]).repeat(1, streams)[:, None, :, None]
    return out * real.to(out.dtype)
