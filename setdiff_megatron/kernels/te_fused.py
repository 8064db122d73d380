"""Set-causal attention on Transformer Engine's low-level fused (cuDNN) attention, BF16 and FP8.

TE's DotProductAttention module cannot run the set-causal mask fused, so this calls `fused_attn_fwd`
and `fused_attn_bwd` for the causal and no-mask pieces of core/merged_attention.py's decomposition,
merged by log-sum-exp (docs/method.md, "Fused kernels"). FP8 attention runs only where megatron-core
and TE would run it. Nothing imports TE at module import: `load_te_api` does, and tests substitute
tests/kernels/emulation.py's `te_api()`, which has the same call signatures and enforces TE's rules.
"""

from __future__ import annotations

import functools
import logging
import os
from dataclasses import dataclass, field
from types import SimpleNamespace

import torch

from setdiff_megatron.core.merged_attention import merged_set_causal_attention
from setdiff_megatron.core.step_attention import merged_step_attention
from setdiff_megatron.errors import UserError

__all__ = ["FP8Settings", "KERNEL_STATS", "load_te_api", "te_status", "te_attention", "te_step_attention"]

log = logging.getLogger("setdiff_megatron.kernels")

TE_INSTALL = "pip install --no-build-isolation 'transformer-engine[pytorch]>=2.9,<2.12'"
HALF = (torch.bfloat16, torch.float16)


@dataclass(frozen=True)
class FP8Settings:
    """What the active fp8 autocast asks for (megatron wraps each layer in one when train.fp8 is set)."""

    recipe: str  # class name: DelayedScaling, Float8CurrentScaling, ...
    delayed: bool
    fwd_dtype: object  # TE DType of Q, K, V, S, O (E4M3)
    bwd_dtype: object  # of dO, dP, dQ/dK/dV (E5M2 under the HYBRID format)
    fwd_max: float
    bwd_max: float
    margin: int = 0
    dpa: bool = False
    """The recipe's fp8_dpa: FP8 attention asked for (megatron: fp8_dot_product_attention)."""


@dataclass
class KernelStats:
    """What the TE calls of this process cost beyond their math, for benchmarks/gpu_check.py."""

    shapes: set = field(default_factory=set)
    """Distinct (batch, heads, kv heads, sq, skv, head dim, mask, dtype, layout, training, fp8): cuDNN
    builds a graph for each new one and keeps it (te fused_attn_f16_arbitrary_seqlen.cu's cache)."""
    copied_bytes: int = 0
    """Bytes copied to hand TE tensors contiguous in its layout."""

    def reset(self) -> None:
        self.shapes.clear()
        self.copied_bytes = 0


KERNEL_STATS = KernelStats()


@functools.cache
def load_te_api() -> SimpleNamespace:
    """The handful of TE entry points this module calls (TE 2.9-2.11; megatron-core 0.16 pins them).

    Raises whatever TE raises: a RuntimeError, not an ImportError, where cuDNN is missing.
    """
    import transformer_engine
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.constants import TE_DType
    from transformer_engine.pytorch.cpp_extensions import fused_attn as fa
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager, get_fp8_max, get_fp8_te_dtype
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    def fused_backend(is_training, dtype, layout, mask, num_heads, num_kv_heads, sq, sk, head_dim):
        args = (
            is_training,
            dtype,
            dtype,
            fa.QKVLayout[f"{layout}_{layout}_{layout}"],
            fa.AttnBiasType["no_bias"],
            fa.AttnMaskType[mask],
            fa.SoftmaxType["vanilla"],
            0.0,
            num_heads,
            num_kv_heads,
            sq,
            sk,
            head_dim,
            head_dim,
            *_window(mask),
            False,
        )
        try:
            backend = tex.get_fused_attn_backend(*args, False)  # TE >= 2.10 appends cuda_graph
        except TypeError:
            backend = tex.get_fused_attn_backend(*args)
        return None if backend == fa.FusedAttnBackend["No_Backend"] else backend

    def fp8_settings():
        if not FP8GlobalStateManager.is_fp8_enabled():
            return None
        recipe = FP8GlobalStateManager.get_fp8_recipe()
        return FP8Settings(
            type(recipe).__name__,
            recipe.delayed(),
            get_fp8_te_dtype(recipe, True),
            get_fp8_te_dtype(recipe, False),
            get_fp8_max(recipe, True),
            get_fp8_max(recipe, False),
            getattr(recipe, "margin", 0),
            bool(getattr(recipe, "fp8_dpa", False)),
        )

    def make_quantizer(scale, fp8_dtype):
        return Float8Quantizer(
            scale=scale, amax=torch.zeros_like(scale), fp8_dtype=fp8_dtype, rowwise=True, columnwise=False
        )

    return SimpleNamespace(
        name=f"Transformer Engine {getattr(transformer_engine, '__version__', '?')}",
        fused_attn_fwd=fa.fused_attn_fwd,
        fused_attn_bwd=fa.fused_attn_bwd,
        fused_backend=fused_backend,
        backend_names={
            "FP8": fa.FusedAttnBackend["FP8"],
            "F16": fa.FusedAttnBackend["F16_arbitrary_seqlen"],
            "max512": fa.FusedAttnBackend["F16_max512_seqlen"],
        },
        te_dtype=TE_DType.__getitem__,
        fp8_settings=fp8_settings,
        capability=torch.cuda.get_device_capability,
        make_quantizer=make_quantizer,
    )


@functools.cache
def te_status() -> tuple[bool, str]:
    """(usable, why) for this machine: a CUDA GPU and a Transformer Engine that imports."""
    if not torch.cuda.is_available():
        return False, "no CUDA GPU"
    try:
        return True, load_te_api().name
    except Exception as exc:  # noqa: BLE001 - TE raises RuntimeError without cuDNN
        return False, f"Transformer Engine does not import ({type(exc).__name__}: {str(exc).splitlines()[0]})"


# --------------------------------------------------------------------------------------------
# Layouts: TE takes bshd or sbhd tensors contiguous in that order; megatron hands out sbhd views.


def physical_layout(x_BHSD: torch.Tensor) -> str:
    """'sbhd' when tokens are outermost in memory (megatron's [s, b, h, d]), else 'bshd'."""
    return "sbhd" if x_BHSD.shape[0] > 1 and x_BHSD.stride(2) > x_BHSD.stride(0) else "bshd"


def _to(x_BHSD: torch.Tensor, fmt: str) -> torch.Tensor:
    view = x_BHSD.transpose(1, 2) if fmt == "bshd" else x_BHSD.permute(2, 0, 1, 3)
    if not view.is_contiguous():
        KERNEL_STATS.copied_bytes += view.numel() * view.element_size()
    return view.contiguous()


def _from(x: torch.Tensor, fmt: str) -> torch.Tensor:
    return x.transpose(1, 2) if fmt == "bshd" else x.permute(1, 2, 0, 3)


def _window(mask: str) -> tuple[int, int]:
    return (-1, 0) if "causal" in mask else (-1, -1)


def deterministic() -> bool:
    """TE's own test (dot_product_attention/utils.py): NVTE_ALLOW_NONDETERMINISTIC_ALGO=0 or torch's
    deterministic mode."""
    return (
        os.environ.get("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "1") == "0" or torch.are_deterministic_algorithms_enabled()
    )


def fused_unavailable_reason(capability: tuple[int, int]) -> str | None:
    """TE's Python-level guard on any fused attention in training (get_attention_backend, 2.9-2.11):
    none under deterministic training on sm100 and newer."""
    if deterministic() and capability >= (10, 0):
        return (
            f"Transformer Engine has no deterministic fused attention for training on sm{capability[0]}{capability[1]}"
        )
    return None


def _plain(x) -> torch.Tensor:
    """A TE Float8Tensor (or the emulation's) dequantized; a plain tensor as it is."""
    return x if type(x) is torch.Tensor else x.dequantize()


def _row_norm_max(x: torch.Tensor) -> torch.Tensor:
    return x.float().norm(dim=-1).amax()


def _scale(fp8_max: float, bound: torch.Tensor, margin: int) -> torch.Tensor:
    """Delayed-scaling scale fp8_max / amax / 2^margin, as a [1] float32 device tensor.

    A core attention called as a function has no module to keep an amax history in, so the scales
    come from this call's amaxes (or bounds): DelayedScaling's format and margin, with a history of
    one and no lag."""
    return (fp8_max / 2.0**margin / bound.float().clamp(min=1e-12)).reshape(1)


_BACKENDS: dict[tuple, object] = {}


class TEFusedKernel:
    """core.merged_attention.PartialAttention on fused_attn_fwd/bwd; `fp8` selects cuDNN's FP8 kernels."""

    def __init__(self, api: SimpleNamespace, fp8: FP8Settings | None = None, *, strict: bool = True):
        self.api, self.fp8, self.strict = api, fp8, strict

    def layout(self, k: torch.Tensor) -> str:
        return physical_layout(k)

    def _backend(self, dtype, fmt, mask, q, k, *, fp8: bool = False):
        """The backend TE picks for this call. Only its arbitrary-seqlen and FP8 backends return the
        log-sum-exp the merge needs (its max512 backend returns the softmax itself): any other is
        refused, and `forward` checks what a call returned."""
        key = (self.api.name, dtype, fmt, mask, q.shape[1], k.shape[1], q.shape[2], k.shape[2], q.shape[3])
        if key not in _BACKENDS:
            _BACKENDS[key] = self.api.fused_backend(True, dtype, fmt, mask, *key[4:])
        backend = _BACKENDS[key]
        if backend is not None and backend not in (self.api.backend_names["F16"], self.api.backend_names["FP8"]):
            raise UserError(
                f"{self.api.name} would run this attention on its max512 backend, which returns the softmax "
                f"instead of its log-sum-exp ({q.shape[2]}x{k.shape[2]}, head_dim {q.shape[3]}): use a cuDNN "
                "other than 9.10.0-9.10.1, unset NVTE_FUSED_ATTN_BACKEND, or model.attention_impl: fused"
            )
        if backend is None:
            what = "FP8" if fp8 else str(q.dtype).removeprefix("torch.")
            if fp8 and not self.strict:
                log_once(
                    ("te-fp8-backend", key),
                    f"attention: {self.api.name} has no fused FP8 attention for "
                    f"{key[4:]} (heads, kv heads, sq, sk, head dim); this call runs in {q.dtype}",
                )
                return None
            raise UserError(
                f"{self.api.name} has no fused {what} attention for head_dim {q.shape[3]}, {q.shape[1]}/{k.shape[1]} "
                f"heads, {q.shape[2]}x{k.shape[2]} '{mask}': use model.attention_impl: auto or fused"
            )
        return backend

    def forward(self, q, k, v, *, scale, causal, kv_len=None):
        fmt = self.layout(k)
        b, _, sq, _ = q.shape
        sk = k.shape[2]
        mask = "causal" if causal else "no_mask" if kv_len is None else "padding"
        cu_q = torch.arange(0, (b + 1) * sq, sq, dtype=torch.int32, device=q.device)
        cu_kv = (
            torch.arange(0, (b + 1) * sk, sk, dtype=torch.int32, device=q.device)
            if kv_len is None
            else (torch.nn.functional.pad(kv_len.cumsum(0), (1, 0)).to(torch.int32))
        )
        qp, kp, vp = (_to(x, fmt) for x in (q, k, v))
        call = dict(attn_scale=scale, qkv_layout=f"{fmt}_{fmt}_{fmt}", attn_mask_type=mask, window_size=_window(mask))
        fp8 = self.fp8
        backend = None if fp8 is None else self._backend(fp8.fwd_dtype, fmt, mask, q, k, fp8=True)
        if backend is None:
            backend = self._backend(self.api.te_dtype(q.dtype), fmt, mask, q, k)
            out, aux = self.api.fused_attn_fwd(True, sq, sk, cu_q, cu_kv, qp, kp, vp, q.dtype, backend, **call)
            quantized = None
        else:
            # Q, K and V share one scale: cuDNN reads a single descale for them.
            amax_qkv = torch.stack([x.abs().amax().float() for x in (qp, kp, vp)]).amax()
            qkv_q = self.api.make_quantizer(_scale(fp8.fwd_max, amax_qkv, fp8.margin), fp8.fwd_dtype)
            s_q = self.api.make_quantizer(
                _scale(fp8.fwd_max, torch.ones((), device=q.device), fp8.margin), fp8.fwd_dtype
            )  # softmax probabilities are <= 1
            o_q = self.api.make_quantizer(
                _scale(fp8.fwd_max, vp.abs().amax(), fp8.margin), fp8.fwd_dtype
            )  # rows of O are convex combinations of rows of V
            q8, k8, v8 = qkv_q(qp), qkv_q(kp), qkv_q(vp)
            out, aux = self.api.fused_attn_fwd(
                True, sq, sk, cu_q, cu_kv, q8, k8, v8, q.dtype, backend, s_quantizer=s_q, o_quantizer=o_q, **call
            )
            quantized = (q8, k8, v8, s_q)
        # aux: [Stats, rng_state] (F16) or [Stats, ZInv, rng_state] (FP8; cuDNN fills Stats only).
        # Stats [b, h, sq, 1] is the natural-log log-sum-exp of the scaled scores: TE's own
        # return_max_logit path rebuilds it as max + log(sum exp), and its context-parallel code
        # merges it exactly like flash-attn's softmax_lse.
        stats = aux[0] if aux else None
        if stats is None or tuple(stats.shape) != (b, q.shape[1], sq, 1) or stats.dtype != torch.float32:
            raise UserError(
                f"{self.api.name} returned no log-sum-exp [b, h, sq, 1] float32 for this attention (got "
                f"{None if stats is None else (tuple(stats.shape), stats.dtype)}); use model.attention_impl: fused"
            )
        KERNEL_STATS.shapes.add(
            (b, q.shape[1], k.shape[1], sq, sk, q.shape[3], mask, str(q.dtype), fmt, True, quantized is not None)
        )
        saved = (backend, fmt, mask, cu_q, cu_kv, aux[-1], quantized)
        return _from(_plain(out), fmt), stats[..., 0], saved

    def backward(self, dout, q, k, v, out, lse, aux, *, scale, causal):
        """One fused_attn_bwd fed the MERGED output and log-sum-exp, as TE's context-parallel code
        does (cp_p2p_bwd_fused_attn); the caller adds the diagonal's gradient. Under FP8, dO is
        scaled from its amax, and dP and dQ/dK/dV from Cauchy-Schwarz bounds, so nothing can overflow."""
        backend, fmt, mask, cu_q, cu_kv, rng_state, quantized = aux
        sq, sk = q.shape[2], k.shape[2]
        dop, op = _to(dout, fmt), _to(out, fmt)
        stats = lse.unsqueeze(-1).float().contiguous()
        call = dict(
            attn_scale=scale,
            qkv_layout=f"{fmt}_{fmt}_{fmt}",
            attn_mask_type=mask,
            window_size=_window(mask),
            deterministic=torch.are_deterministic_algorithms_enabled(),
        )
        fp8 = self.fp8
        if quantized is None:
            qp, kp, vp = (_to(x, fmt) for x in (q, k, v))
            grads = self.api.fused_attn_bwd(
                sq,
                sk,
                cu_q,
                cu_kv,
                qp,
                kp,
                vp,
                op,
                dop,
                dout.dtype,
                self.api.te_dtype(dout.dtype),
                [stats, rng_state],
                backend,
                **call,
            )
        else:
            q8, k8, v8, s_q = quantized
            bwd_max, margin = fp8.bwd_max, fp8.margin
            # |dP_ij| = |dO_i . V_j| <= max|dO_i| max|V_j| =: B; |dS_ij| <= 2 B P_ij; the dQ/dK/dV
            # bounds follow (a column of P sums to at most sq, a row to at most 1).
            do_norm, v_norm = _row_norm_max(dop), _row_norm_max(v)
            bound_dp = do_norm * v_norm
            bound_dqkv = torch.stack(
                [2 * scale * bound_dp * _row_norm_max(k), 2 * scale * bound_dp * _row_norm_max(q) * sq, do_norm * sq]
            ).amax()
            o_q = self.api.make_quantizer(_scale(fp8.fwd_max, op.abs().amax(), margin), fp8.fwd_dtype)
            do_q = self.api.make_quantizer(_scale(bwd_max, dop.abs().amax(), margin), fp8.bwd_dtype)
            dp_q = self.api.make_quantizer(_scale(bwd_max, bound_dp, margin), fp8.bwd_dtype)
            dqkv_q = self.api.make_quantizer(_scale(bwd_max, bound_dqkv, margin), fp8.bwd_dtype)
            grads = self.api.fused_attn_bwd(
                sq,
                sk,
                cu_q,
                cu_kv,
                q8,
                k8,
                v8,
                o_q(op),
                do_q(dop),
                dout.dtype,
                fp8.bwd_dtype,
                [stats, stats, rng_state],
                backend,
                s_quantizer=s_q,
                dp_quantizer=dp_q,
                dqkv_quantizer=dqkv_q,
                **call,
            )
        return tuple(_from(_plain(g), fmt) for g in grads[:3])


# --------------------------------------------------------------------------------------------
# The 'te' implementation


def fp8_unsupported_reason(capability: tuple[int, int], head_dim: int) -> str | None:
    """Why FP8 attention cannot train at this head dim on this GPU, or None: cuDNN's rules, and TE's
    Python guards that turn it off on sm120 and under deterministic training (docs/method.md,
    "Fused kernels")."""
    sm = f"sm{capability[0]}{capability[1]}"
    if capability < (9, 0):
        return f"cuDNN's FP8 attention needs Hopper (sm90) or newer; this GPU is {sm}"
    if capability[0] == 12:
        return f"Transformer Engine turns FP8 attention off on {sm}"
    if deterministic():
        return "Transformer Engine has no FP8 fused attention for deterministic training"
    if capability < (10, 0) and head_dim != 128:
        return f"cuDNN's FP8 attention trains only head_dim 128 on {sm}; got {head_dim}"
    if head_dim > 128:
        return f"cuDNN's FP8 attention takes head_dim <= 128 on {sm}; got {head_dim}"
    return None


_LOGGED: set = set()


def log_once(key, message: str) -> None:
    if key not in _LOGGED:
        _LOGGED.add(key)
        log.info(message)


def require_cuda_half(q: torch.Tensor, impl: str) -> None:
    if q.device.type != "cuda":
        raise UserError(
            f"model.attention_impl '{impl}' got {q.device.type} tensors; it runs on CUDA GPUs only "
            "(use model.attention_impl: auto)"
        )
    if q.dtype not in HALF:
        raise UserError(
            f"model.attention_impl '{impl}' takes bf16/fp16 activations; got {q.dtype} "
            "(set train.precision: bf16, or model.attention_impl: auto)"
        )


def te_kernel_for(q: torch.Tensor, api: SimpleNamespace, *, strict: bool = True) -> TEFusedKernel:
    """The kernel for this call: FP8 when an fp8 autocast with DelayedScaling and fp8_dpa is active
    (train.fp8_dot_product_attention, megatron's fp8_dot_product_attention, off by default) and the
    GPU and head dim allow it (cuDNN's FP8 sub-backend; TE's own guards: not on sm120, not under
    deterministic training). `strict` (forced 'te'): an FP8 request it cannot honour is a UserError;
    otherwise ('auto') attention stays in BF16 and the reason is logged once."""
    fp8 = api.fp8_settings()
    if (reason := fused_unavailable_reason(api.capability(q.device))) is not None:
        raise UserError(f"model.attention_impl te: {reason}; use model.attention_impl: auto or fused")
    if fp8 is None or not fp8.dpa:  # FP8 GEMMs only: attention stays BF16, as in megatron-core
        return TEFusedKernel(api)
    if not fp8.delayed:
        log_once(
            ("te-fp8-recipe", fp8.recipe),
            f"attention: FP8 recipe {fp8.recipe} has no FP8 attention below sm100 (TE needs DelayedScaling, "
            f"train.fp8_recipe: delayed); set-causal attention runs in {q.dtype}",
        )
        return TEFusedKernel(api)
    reason = fp8_unsupported_reason(api.capability(q.device), q.shape[-1])
    if reason is None:
        return TEFusedKernel(api, fp8, strict=strict)
    if strict:
        raise UserError(
            f"FP8 attention (train.fp8_dot_product_attention): {reason}; set model.head_dim: 128, or "
            "train.fp8_dot_product_attention: false (FP8 GEMMs, BF16 attention), or model.attention_impl: auto"
        )
    log_once(("te-fp8-shape", reason), f"attention: {reason}; set-causal attention runs in {q.dtype}")
    return TEFusedKernel(api)


def te_attention(q, k, v, scale, valid_len, *, api: SimpleNamespace | None = None, strict: bool = True):
    """The 'te' training implementation (`api`: tests pass tests/kernels/emulation.py's)."""
    if api is None:
        require_cuda_half(q, "te")
        api = load_te_api()
    return merged_set_causal_attention(q, k, v, te_kernel_for(q, api, strict=strict), scale=scale, valid_len=valid_len)


def te_step_attention(
    q,
    k,
    v,
    k_cache,
    v_cache,
    *,
    num_commit,
    cache_len=None,
    commit_len=None,
    scale=None,
    api: SimpleNamespace | None = None,
):
    """The 'te' sampling step (BF16/FP16; sampling needs no FP8): no-mask attention over the cache
    with per-row key lengths ('padding', cu_seqlens_kv), merged with the step block and each
    query's diagonal (core.step_attention.merged_step_attention)."""
    if api is None:
        require_cuda_half(q, "te")
        api = load_te_api()
    return merged_step_attention(
        q,
        k,
        v,
        k_cache,
        v_cache,
        TEFusedKernel(api),
        num_commit=num_commit,
        cache_len=cache_len,
        commit_len=commit_len,
        scale=scale,
    )
