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
dP, dQ/dK/dV). Tests only: O(S^2) memory.

The real libraries' rules are enforced, so a call the GPU would refuse, or read wrongly, fails
here too. Each rule names its source (read at the tags named; "fa" = Dao-AILab/flash-attention
csrc/flash_attn/flash_api.cpp and flash_attn/flash_attn_interface.py at v2.8.3, the same at
v2.7.x unless said; "te" = NVIDIA/TransformerEngine at v2.9-v2.11):
  flash-attn   fp16/bf16 only, k/v/out/dout of q's dtype (fa mha_fwd/mha_bwd "only support fp16
               and bf16"); head dim a multiple of 8 up to 256 for the bare forward/backward (fa
               mha_fwd/mha_bwd), up to 256 for the cache call, which pads itself (fa
               mha_fwd_kvcache); q/k/v/out/dout made unit-stride by maybe_contiguous, softmax_lse
               NOT (fa _flash_attn_backward): mha_bwd reads it by its data pointer as contiguous
               fp32 [b, h, s] (fa mha_bwd; src/flash_bwd_kernel.h), so a strided one is refused
               here where the GPU would read wrong values; dq/dk/dv of q's dtype, unit last stride,
               exact shape (fa mha_bwd); cache_seqlens an int32 [b] tensor or an int (fa
               mha_fwd_kvcache "seqlens_k must have dtype int32"); window (left, right), -1
               unbounded, bottom-right aligned, causal forcing right = 0 (fa mha_fwd); +inf as the
               log-sum-exp of a row with no key (fa src/softmax.h).
  TE           q/k/v bf16 or fp16 on the F16 backends, FP8 on the FP8 one (te
               dot_product_attention/utils.py get_attention_backend: other qkv dtypes disable
               FusedAttention); backend selection (`fused_backend`) by te
               common/fused_attn/fused_attn.cpp nvte_get_fused_attn_backend: arbitrary seqlen on
               sm80+ (cuDNN >= 9.7; sm80-sm99 from 8.9.3), head dim a multiple of 8 up to 128 (256
               on sm90), sliding windows only (left >= 0, right = 0) and sq <= skv; max512 on sm80
               and sm90 only for head dim 64, sq and skv <= 512 and multiples of 64, no GQA, chosen
               only where arbitrary is not; FP8 on sm90+ with cuDNN >= 9.7 and head dim a
               multiple of 16 (training: 128 below sm100, <= 128 from sm100), masks no/causal/
               padding; max512 returns the whole softmax [b, h, sq, skv] in q's dtype as aux[0]
               with no rng state (te fused_attn_f16_max512_seqlen.cu), arbitrary its log-sum-exp
               [b, h, sq, 1] fp32 and the rng state; `window_size` bounds the keys a row sees.
"""

from __future__ import annotations

import contextvars
import functools
from dataclasses import dataclass
from types import SimpleNamespace

import torch

__all__ = ["EmulatedQuantizer", "EmulatedFloat8Tensor", "te_api", "flash_api"]

FP8_DTYPES = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_FP32 = contextvars.ContextVar("emulation_fp32", default=False)
"""Set by an api built with allow_fp32: fp32 tensors pass the dtype rules (tests of the adapters'
exactness at 1e-5; the GPU libraries refuse fp32, and their real entry points never send it)."""


def _allowing_fp32(fn):
    @functools.wraps(fn)
    def call(*args, **kwargs):
        token = _FP32.set(True)
        try:
            return fn(*args, **kwargs)
        finally:
            _FP32.reset(token)

    return call


def _half(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16) or (_FP32.get() and dtype == torch.float32)


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
        if not isinstance(x, EmulatedFloat8Tensor) and not _half(x.dtype):
            raise ValueError(f"emulation: TE fused attention takes bf16, fp16 or FP8 tensors; got {x.dtype}")
        out.append(_values(x).permute(*_PHYSICAL_TO_BHSD[fmt]))
    return fmt, out


def _te_window(allowed: torch.Tensor, mask_type: str, window_size: tuple[int, int]) -> torch.Tensor:
    """Keys within (left, right) of each row's diagonal (bottom-right aligned for those masks)."""
    left, right = window_size
    sq, sk = allowed.shape[-2:]
    i = torch.arange(sq, device=allowed.device)[:, None] + (sk - sq if "bottom_right" in mask_type else 0)
    j = torch.arange(sk, device=allowed.device)[None, :]
    if left >= 0:
        allowed = allowed & (j >= i - left)
    if right >= 0:
        allowed = allowed & (j <= i + right)
    return allowed


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
    allowed = _te_window(allowed, attn_mask_type, window_size)
    out, lse = attention_forward(q_, k_, v_, scale, allowed, s_quantizer.round if fp8 else None)
    # What a fully masked row holds is unspecified; use the hostile choice so callers must cope.
    lse = lse.masked_fill(~allowed.any(-1), float("inf"))
    out = out.permute(*_BHSD_TO_PHYSICAL[fmt]).contiguous()
    out = o_quantizer(out.to(fake_dtype)) if fp8 else out.to(fake_dtype)
    if fused_attention_backend == "F16_max512_seqlen":  # the softmax itself, in q's dtype, no rng state
        return out, [torch.zeros(*lse.shape, max_seqlen_kv, dtype=fake_dtype, device=q_.device)]
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
    allowed = _te_window(allowed, attn_mask_type, window_size)
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


def fused_backend_rule(capability, cudnn, is_training, dtype, mask, num_heads, num_kv_heads, sq, sk, head_dim, window):
    """nvte_get_fused_attn_backend's choice (te common/fused_attn/fused_attn.cpp, 2.9-2.11) for
    the BSHD/SBHD layouts, no bias, no dropout, vanilla softmax: 'FP8', 'F16_arbitrary_seqlen',
    'F16_max512_seqlen' or None."""
    if dtype in FP8_DTYPES:
        if capability < (9, 0) or cudnn == (9, 10, 0) or window not in ((-1, -1), (-1, 0)):
            return None  # (a sliding window: TE's Python filter turns FP8 attention off)
        square_128 = cudnn >= (9, 2, 1) and capability < (10, 0) and sq % 128 == 0 and sk % 128 == 0
        if square_128 and head_dim == 128 and mask in ("no_mask", "causal"):
            return "FP8"
        if cudnn < (9, 7) or mask not in ("no_mask", "causal", "padding", "padding_causal") or head_dim % 16:
            return None
        if capability >= (10, 0):
            return "FP8" if head_dim <= 128 else None
        return "FP8" if (head_dim == 128 if is_training else head_dim <= 256) else None
    if not _half(dtype):
        return None
    arch = capability >= (8, 0) and ((capability < (10, 0) and cudnn >= (8, 9, 3)) or cudnn >= (9, 7))
    excluded = (9, 10) <= cudnn < (9, 10, 2)
    long_head = capability == (9, 0) and head_dim <= 256 and (not is_training or cudnn >= (9, 5))
    head = head_dim % 8 == 0 and (head_dim <= 128 or long_head)
    windowed = window == (-1, -1) or (window[1] == 0 and "causal" in mask and sq <= sk)
    bottom_right = "bottom_right" not in mask or sq <= sk
    if arch and not excluded and head and windowed and bottom_right:
        return "F16_arbitrary_seqlen"
    max512 = (
        capability in ((8, 0), (9, 0))
        and sq <= 512
        and sk <= 512
        and sq % 64 == 0
        and sk % 64 == 0
        and head_dim == 64
        and num_heads == num_kv_heads
        and window in ((-1, -1), (-1, 0))
    )
    return "F16_max512_seqlen" if max512 else None


def te_api(
    *, capability: tuple[int, int] = (9, 0), cudnn: tuple[int, ...] = (9, 13, 0), fp8=None, allow_fp32: bool = False
) -> SimpleNamespace:
    """The namespace te_fused.load_te_api() builds from Transformer Engine, on the emulation.

    `fp8`: the FP8Settings an fp8 autocast would report (None: not in one). `allow_fp32`: fp32
    tensors pass (see _FP32)."""

    def fused_backend(is_training, dtype, layout, mask, num_heads, num_kv_heads, sq, sk, head_dim):
        window = (-1, 0) if "causal" in mask else (-1, -1)
        args = (is_training, dtype, mask, num_heads, num_kv_heads, sq, sk, head_dim, window)
        return fused_backend_rule(capability, cudnn, *args)

    wrap = _allowing_fp32 if allow_fp32 else (lambda fn: fn)
    return SimpleNamespace(
        name=f"emulation sm{capability[0]}{capability[1]} cuDNN {'.'.join(map(str, cudnn))}{' fp32' * allow_fp32}",
        fused_attn_fwd=wrap(te_fused_attn_fwd),
        fused_attn_bwd=wrap(te_fused_attn_bwd),
        fused_backend=wrap(fused_backend),
        backend_names={"FP8": "FP8", "F16": "F16_arbitrary_seqlen", "max512": "F16_max512_seqlen"},
        te_dtype=lambda dtype: dtype,
        fp8_settings=lambda: fp8,
        capability=lambda device: capability,
        make_quantizer=lambda scale, fp8_dtype: EmulatedQuantizer(scale, torch.zeros_like(scale), fp8_dtype),
    )


# --------------------------------------------------------------------------------------------
# flash-attn 2: _flash_attn_forward / _flash_attn_backward / flash_attn_with_kvcache


def _maybe_contiguous(x: torch.Tensor) -> torch.Tensor:
    """flash-attn's own: a copy only where the last dim's stride is not 1."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _fa_inputs(*tensors, head_dim_multiple: int = 8):
    """[b, s, h, d] -> [b, h, s, d], after flash-attn's dtype and head-dim checks."""
    dtype = tensors[0].dtype
    for x in tensors:
        if not _half(x.dtype):
            raise RuntimeError("emulation: FlashAttention only support fp16 and bf16 data type")
        if x.dtype != dtype:
            raise RuntimeError("emulation: flash-attn takes q, k, v (and out, dout) of one dtype")
        if x.stride(-1) != 1:
            raise RuntimeError("emulation: flash-attn's kernels need a unit-stride last dimension")
    head_dim = tensors[0].shape[-1]
    if head_dim > 256 or head_dim % head_dim_multiple:
        raise RuntimeError(f"emulation: flash-attn takes head dims that are multiples of 8 up to 256; got {head_dim}")
    return [x.transpose(1, 2) for x in tensors]


def _fa_mask(b, sq, sk, causal, window_size_left, window_size_right, device, kv_len=None):
    """flash-attn's band: query i (bottom-right aligned, offset sk - sq) sees keys in
    [i + sk - sq - left, i + sk - sq + right], -1 unbounded; causal forces right = 0."""
    if causal:
        window_size_right = 0
    allowed = _allowed(b, sq, sk, "no_mask", None, kv_len, device)
    i = torch.arange(sq, device=device)[:, None] + (sk - sq)
    j = torch.arange(sk, device=device)[None, :]
    if window_size_right >= 0:
        allowed = allowed & (j <= i + window_size_right)
    if window_size_left >= 0:
        allowed = allowed & (j >= i - window_size_left)
    return allowed


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
    q_, k_, v_ = _fa_inputs(*map(_maybe_contiguous, (q, k, v)))
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
    do_, q_, k_, v_, o_ = _fa_inputs(*map(_maybe_contiguous, (dout, q, k, v, out)))
    b, h, sq = q_.shape[0], q_.shape[1], q_.shape[2]
    if softmax_lse.shape != (b, h, sq) or not softmax_lse.is_contiguous() or softmax_lse.dtype != torch.float32:
        raise RuntimeError(
            "emulation: flash-attn's mha_bwd reads softmax_lse by its data pointer as contiguous fp32 "
            f"[b, h, s] = {[b, h, sq]}; got {list(softmax_lse.shape)} {softmax_lse.dtype} strides "
            f"{softmax_lse.stride()} (the GPU would read other rows' values)"
        )
    for name, target, like in (("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        if target.dtype != like.dtype or target.stride(-1) != 1 or target.shape != like.shape:
            raise RuntimeError(f"emulation: {name} must have q's dtype, a unit last stride and its input's shape")
    allowed = _fa_mask(b, sq, k_.shape[2], causal, window_size_left, window_size_right, q.device)
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
    if isinstance(cache_seqlens, int):
        cache_seqlens = torch.full((q.shape[0],), cache_seqlens, dtype=torch.int32, device=q.device)
    if cache_seqlens is not None and (
        cache_seqlens.dtype != torch.int32 or cache_seqlens.shape != (q.shape[0],) or not cache_seqlens.is_contiguous()
    ):
        raise RuntimeError("emulation: seqlens_k must have dtype int32, shape [b] and be contiguous")
    q_, k_, v_ = _fa_inputs(_maybe_contiguous(q), k_cache, v_cache, head_dim_multiple=1)
    kv_len = None if cache_seqlens is None else cache_seqlens.long()
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    allowed = _fa_mask(q_.shape[0], q_.shape[2], k_.shape[2], causal, *window_size, q.device, kv_len)
    out, lse = attention_forward(q_, k_, v_, scale, allowed)
    lse = lse.masked_fill(~allowed.any(-1), float("inf"))
    out = out.to(q.dtype).transpose(1, 2).contiguous()
    return (out, lse) if return_softmax_lse else out


def flash_api(*, allow_fp32: bool = False) -> SimpleNamespace:
    """The namespace flash_attn.load_flash_api() builds from flash-attn 2, on the emulation
    (`allow_fp32`: fp32 tensors pass, see _FP32)."""
    wrap = _allowing_fp32 if allow_fp32 else (lambda fn: fn)
    return SimpleNamespace(
        name=f"emulation{' fp32' * allow_fp32}",
        forward=wrap(fa_flash_attn_forward),
        backward=wrap(fa_flash_attn_backward),
        with_kvcache=wrap(fa_flash_attn_with_kvcache),
    )
