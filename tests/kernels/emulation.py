"""Pure-PyTorch stand-ins for the GPU kernels' low-level calls, so their adapters run in CPU CI.

Same call signatures and conventions as
  * Transformer Engine's `fused_attn_fwd` / `fused_attn_bwd` (transformer_engine.pytorch.
    cpp_extensions.fused_attn, 2.9-2.11): bshd/sbhd layouts, cu_seqlens, softmaxStats
    [b, h, sq, 1] float32, [Stats, rng_state] aux; FP8: Float8Tensor inputs that share one scale,
    S/O/dP/dQKV quantizers, [Stats, ZInv, rng_state] aux;
  * flash-attn 2's `_flash_attn_forward` / `_flash_attn_backward` / `flash_attn_with_kvcache`:
    [b, s, h, d] with a unit-stride last dim, lse [b, h, s], +inf for a row with no key.
The math is the kernels' algorithm written out: the forward returns output and log-sum-exp; the
backward takes output and log-sum-exp as INPUTS (P = exp(S - lse), D = rowsum(dO * O)), which is
what the set-causal merge relies on. FP8 rounds where cuDNN's FP8 graph does (Q/K/V, P, O, dO,
dP, dQ/dK/dV). The preconditions the real kernels impose (layout contiguity, unit last stride,
half-precision-or-fp32 inputs) are checked, so adapter bugs fail here. Tests only: O(S^2) memory.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch

__all__ = ["EmulatedQuantizer", "EmulatedFloat8Tensor", "te_api", "flash_api"]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
FP8_MAX = {"e4m3": 448.0, "e5m2": 57344.0}


# --------------------------------------------------------------------------------------------
# FP8 tensors and quantizers (the parts of TE's Float8Quantizer / Float8Tensor the adapter uses)


@dataclass
class EmulatedFloat8Tensor:
    data: torch.Tensor  # torch.float8_*
    scale_inv: torch.Tensor
    nominal_dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    def dequantize(self) -> torch.Tensor:
        return (self.data.float() * self.scale_inv).to(self.nominal_dtype)


class EmulatedQuantizer:
    """Delayed-scaling quantizer: multiply by `scale`, saturate, round to FP8; records amax."""

    def __init__(self, scale: torch.Tensor, amax: torch.Tensor, fp8_dtype: str):
        self.scale, self.amax, self.dtype = scale, amax, fp8_dtype

    def round(self, x: torch.Tensor) -> torch.Tensor:
        """x -> its FP8 value, dequantized (float32)."""
        return self.quantize(x.float()).dequantize()

    def quantize(self, x: torch.Tensor) -> EmulatedFloat8Tensor:
        self.amax.copy_(x.detach().abs().amax().float().reshape(1))
        limit = FP8_MAX[self.dtype]
        data = (x.float() * self.scale).clamp(-limit, limit).to(FP8_DTYPES[self.dtype])
        return EmulatedFloat8Tensor(data, 1.0 / self.scale, x.dtype)

    __call__ = quantize


def _values(x) -> torch.Tensor:
    return x.dequantize().float() if isinstance(x, EmulatedFloat8Tensor) else x.float()


# --------------------------------------------------------------------------------------------
# The math, on [B, H, S, D]


def _allowed(b: int, sq: int, sk: int, mask_type: str, q_len, kv_len, device) -> torch.Tensor:
    """[B, 1, Sq, Sk] keys each query may see, for TE's/flash-attn's mask names."""
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    allowed = torch.ones(b, 1, sq, sk, dtype=torch.bool, device=device)
    if mask_type in ("causal", "padding_causal"):
        allowed = allowed & (j <= i)  # top-left
    elif mask_type in ("causal_bottom_right", "padding_causal_bottom_right"):
        allowed = allowed & (j <= i + sk - sq)
    elif mask_type not in ("no_mask", "padding"):
        raise ValueError(f"emulation: unknown mask type {mask_type!r}")
    if q_len is not None:
        allowed = allowed & (i < q_len[:, None, None, None])
    if kv_len is not None:
        allowed = allowed & (j < kv_len[:, None, None, None])
    return allowed


def _expand(x: torch.Tensor, heads: int) -> torch.Tensor:
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def attention_forward(q, k, v, scale, allowed, s_round=None):
    """-> out [B, H, Sq, D], lse [B, H, Sq] (float32; -inf for a row with no key)."""
    scores = (q.float() @ _expand(k, q.shape[1]).float().transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = scores.logsumexp(-1)
    p = (scores - lse.nan_to_num(neginf=0.0)[..., None]).exp()
    if s_round is not None:
        p = s_round(p)
    return p @ _expand(v, q.shape[1]).float(), lse


def attention_backward(dout, q, k, v, out, lse, scale, allowed, s_round=None, dp_round=None):
    """Kernel backward with out and lse as inputs -> dq, dk, dv (float32; dk/dv summed per group)."""
    h, groups = q.shape[1], q.shape[1] // k.shape[1]
    k_h, v_h = _expand(k, h).float(), _expand(v, h).float()
    scores = (q.float() @ k_h.transpose(-1, -2)) * scale
    p = (scores - lse.float()[..., None]).exp().masked_fill(~allowed, 0.0)
    dout = dout.float()
    dp = dout @ v_h.transpose(-1, -2)
    if dp_round is not None:
        dp = dp_round(dp)
    delta = (dout * out.float()).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = scale * ds @ k_h
    dk = scale * ds.transpose(-1, -2) @ q.float()
    dv = (s_round(p) if s_round is not None else p).transpose(-1, -2) @ dout

    def per_group(x):
        return x.unflatten(1, (k.shape[1], groups)).sum(2)

    return dq, per_group(dk), per_group(dv)


# --------------------------------------------------------------------------------------------
# Transformer Engine: fused_attn_fwd / fused_attn_bwd


_PHYSICAL_TO_BHSD = {"bshd": (0, 2, 1, 3), "sbhd": (1, 2, 0, 3)}
_BHSD_TO_PHYSICAL = {"bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}


def _te_format(qkv_layout: str) -> str:
    fmt = qkv_layout.split("_")[0]
    if qkv_layout != f"{fmt}_{fmt}_{fmt}" or fmt not in _PHYSICAL_TO_BHSD:
        raise ValueError(f"emulation: qkv_layout {qkv_layout!r} is not bshd_bshd_bshd or sbhd_sbhd_sbhd")
    return fmt


def _te_inputs(qkv_layout: str, *tensors):
    fmt = _te_format(qkv_layout)
    out = []
    for x in tensors:
        data = x.data if isinstance(x, EmulatedFloat8Tensor) else x
        if not data.is_contiguous():
            raise ValueError("emulation: TE fused attention takes tensors contiguous in their layout")
        if not isinstance(x, EmulatedFloat8Tensor) and x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
            raise ValueError(f"emulation: TE fused attention got {x.dtype}")
        out.append(_values(x).permute(*_PHYSICAL_TO_BHSD[fmt]))
    return fmt, out


def _seqlens(cu_seqlens: torch.Tensor, max_len: int):
    lengths = cu_seqlens[1:] - cu_seqlens[:-1]
    return None if bool((lengths == max_len).all()) else lengths


def te_fused_attn_fwd(
    is_training,
    max_seqlen_q,
    max_seqlen_kv,
    cu_seqlens_q,
    cu_seqlens_kv,
    q,
    k,
    v,
    fake_dtype,
    fused_attention_backend,
    attn_bias=None,
    cu_seqlens_q_padded=None,
    cu_seqlens_kv_padded=None,
    page_table_k=None,
    page_table_v=None,
    s_quantizer=None,
    o_quantizer=None,
    attn_scale=None,
    dropout=0.0,
    fast_zero_fill=True,
    qkv_layout="sbh3d",
    attn_bias_type="no_bias",
    attn_mask_type="padding",
    softmax_type="vanilla",
    window_size=(-1, -1),
    rng_gen=None,
    softmax_offset=None,
    return_max_logit=False,
    cuda_graph=False,
):
    fp8 = fused_attention_backend == "FP8"
    if fp8 != isinstance(q, EmulatedFloat8Tensor) or (fp8 and (s_quantizer is None or o_quantizer is None)):
        raise ValueError("emulation: the FP8 backend takes FP8 q/k/v and S and O quantizers, the F16 one neither")
    if fp8 and not (torch.equal(q.scale_inv, k.scale_inv) and torch.equal(q.scale_inv, v.scale_inv)):
        raise ValueError("emulation: cuDNN's FP8 attention reads one descale for q, k and v")
    if attn_bias_type != "no_bias" or dropout != 0.0:
        raise ValueError("emulation: no bias, no dropout")
    fmt, (q_, k_, v_) = _te_inputs(qkv_layout, q, k, v)
    scale = attn_scale if attn_scale is not None else q_.shape[-1] ** -0.5
    allowed = _allowed(
        q_.shape[0],
        max_seqlen_q,
        max_seqlen_kv,
        attn_mask_type,
        _seqlens(cu_seqlens_q, max_seqlen_q),
        _seqlens(cu_seqlens_kv, max_seqlen_kv),
        q_.device,
    )
    out, lse = attention_forward(q_, k_, v_, scale, allowed, s_quantizer.round if fp8 else None)
    # What a fully masked row holds is unspecified; use the hostile choice so callers must cope.
    lse = lse.masked_fill(~allowed.any(-1), float("inf"))
    out = out.permute(*_BHSD_TO_PHYSICAL[fmt]).contiguous()
    out = o_quantizer(out.to(fake_dtype)) if fp8 else out.to(fake_dtype)
    if not is_training:
        return out, None
    rng_state = torch.zeros(2, dtype=torch.int64, device=q_.device)
    stats = lse[..., None].contiguous()
    return out, ([stats, torch.ones_like(stats), rng_state] if fp8 else [stats, rng_state])


def te_fused_attn_bwd(
    max_seqlen_q,
    max_seqlen_kv,
    cu_seqlens_q,
    cu_seqlens_kv,
    q,
    k,
    v,
    o,
    d_o,
    fake_dtype,
    dqkv_dtype,
    aux_ctx_tensors,
    fused_attention_backend,
    cu_seqlens_q_padded=None,
    cu_seqlens_kv_padded=None,
    s_quantizer=None,
    dp_quantizer=None,
    dqkv_quantizer=None,
    attn_scale=None,
    dropout=0.0,
    fast_zero_fill=True,
    qkv_layout="sbh3d",
    attn_bias_type="no_bias",
    attn_mask_type="padding",
    softmax_type="vanilla",
    window_size=(-1, -1),
    deterministic=False,
    cuda_graph=False,
):
    fp8 = fused_attention_backend == "FP8"
    if fp8 and (len(aux_ctx_tensors) != 3 or None in (s_quantizer, dp_quantizer, dqkv_quantizer)):
        raise ValueError("emulation: FP8 backward takes [Stats, ZInv, rng_state] and S, dP, dQKV quantizers")
    if not fp8 and len(aux_ctx_tensors) != 2:
        raise ValueError("emulation: F16 backward takes [Stats, rng_state]")
    stats = aux_ctx_tensors[0]
    if stats.dtype != torch.float32 or stats.shape[-1] != 1 or not stats.is_contiguous():
        raise ValueError("emulation: Stats must be contiguous float32 [b, h, sq, 1]")
    fmt, (q_, k_, v_, o_, do_) = _te_inputs(qkv_layout, q, k, v, o, d_o)
    scale = attn_scale if attn_scale is not None else q_.shape[-1] ** -0.5
    allowed = _allowed(
        q_.shape[0],
        max_seqlen_q,
        max_seqlen_kv,
        attn_mask_type,
        _seqlens(cu_seqlens_q, max_seqlen_q),
        _seqlens(cu_seqlens_kv, max_seqlen_kv),
        q_.device,
    )
    grads = attention_backward(
        do_,
        q_,
        k_,
        v_,
        o_,
        stats[..., 0],
        scale,
        allowed,
        s_quantizer.round if fp8 else None,
        dp_quantizer.round if fp8 else None,
    )
    grads = [g.permute(*_BHSD_TO_PHYSICAL[fmt]).contiguous().to(fake_dtype) for g in grads]
    if fp8:
        grads = [dqkv_quantizer(g) for g in grads]
    return [*grads, None, None]


def te_api(*, capability: tuple[int, int] = (9, 0), fp8=None) -> SimpleNamespace:
    """The namespace te_fused.load_te_api() builds from Transformer Engine, on the emulation.

    `fp8`: the FP8Settings an fp8 autocast would report (None: not in one)."""

    def fused_backend(is_training, dtype, layout, mask, num_heads, num_kv_heads, sq, sk, head_dim):
        if dtype in FP8_DTYPES:  # cuDNN's FP8 rules on Hopper/Blackwell (docs/method.md, "Fused kernels")
            ok = capability >= (9, 0) and (head_dim == 128 if capability < (10, 0) else head_dim <= 128)
            return "FP8" if ok and mask in ("no_mask", "causal", "padding", "padding_causal") else None
        return "F16_arbitrary_seqlen" if head_dim <= 256 else None

    return SimpleNamespace(
        name="emulation",
        fused_attn_fwd=te_fused_attn_fwd,
        fused_attn_bwd=te_fused_attn_bwd,
        fused_backend=fused_backend,
        backend_names={"FP8": "FP8", "F16": "F16_arbitrary_seqlen"},
        te_dtype=lambda dtype: dtype,
        fp8_settings=lambda: fp8,
        capability=lambda device: capability,
        make_quantizer=lambda scale, fp8_dtype: EmulatedQuantizer(scale, torch.zeros_like(scale), fp8_dtype),
    )


# --------------------------------------------------------------------------------------------
# flash-attn 2: _flash_attn_forward / _flash_attn_backward / flash_attn_with_kvcache


def _fa_inputs(*tensors):
    for x in tensors:
        if x.stride(-1) != 1:
            raise ValueError("emulation: flash-attn needs a unit-stride last dimension")
    return [x.transpose(1, 2) for x in tensors]  # [b, s, h, d] -> [b, h, s, d]


def _fa_mask(b, sq, sk, causal, window_size_left, window_size_right, device, kv_len=None):
    if window_size_left != -1 or window_size_right not in (-1, 0):
        raise ValueError("emulation: no sliding window")
    # flash-attn's causal mask is aligned to the bottom-right corner.
    return _allowed(b, sq, sk, "causal_bottom_right" if causal else "no_mask", None, kv_len, device)


def fa_flash_attn_forward(
    q,
    k,
    v,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    return_softmax,
):
    if dropout_p or softcap or alibi_slopes is not None or return_softmax:
        raise ValueError("emulation: no dropout, softcap, alibi or returned softmax")
    q_, k_, v_ = _fa_inputs(q, k, v)
    allowed = _fa_mask(q_.shape[0], q_.shape[2], k_.shape[2], causal, window_size_left, window_size_right, q.device)
    out, lse = attention_forward(q_, k_, v_, softmax_scale, allowed)
    lse = lse.masked_fill(~allowed.any(-1), float("inf"))  # flash-attn 2's empty-row convention
    rng_state = torch.zeros(2, dtype=torch.int64, device=q.device)
    return out.to(q.dtype).transpose(1, 2).contiguous(), lse, None, rng_state


def fa_flash_attn_backward(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size_left,
    window_size_right,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    do_, q_, k_, v_, o_ = _fa_inputs(dout, q, k, v, out)
    allowed = _fa_mask(q_.shape[0], q_.shape[2], k_.shape[2], causal, window_size_left, window_size_right, q.device)
    grads = attention_backward(do_, q_, k_, v_, o_, softmax_lse, softmax_scale, allowed)
    for target, g in zip((dq, dk, dv), grads):
        target.copy_(g.transpose(1, 2))
    return (do_.float() * o_.float()).sum(-1)  # softmax_d


def fa_flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    if k is not None or v is not None or rotary_cos is not None or block_table is not None:
        raise ValueError("emulation: read-only, unrotated, unpaged cache only")
    q_, k_, v_ = _fa_inputs(q, k_cache, v_cache)
    kv_len = None if cache_seqlens is None else torch.as_tensor(cache_seqlens, device=q.device).expand(q.shape[0])
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    allowed = _fa_mask(q_.shape[0], q_.shape[2], k_.shape[2], causal, *window_size, q.device, kv_len)
    out, lse = attention_forward(q_, k_, v_, scale, allowed)
    lse = lse.masked_fill(~allowed.any(-1), float("inf"))
    out = out.to(q.dtype).transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out


def flash_api() -> SimpleNamespace:
    """The namespace flash_attn.load_flash_api() builds from flash-attn 2, on the emulation."""
    return SimpleNamespace(
        name="emulation",
        forward=fa_flash_attn_forward,
        backward=fa_flash_attn_backward,
        with_kvcache=fa_flash_attn_with_kvcache,
    )
