"""The Transformer Engine and flash-attn adapters, run on their pure-PyTorch emulation (the same
low-level call signatures, CPU math), against the dense reference: outputs and gradients of q, k,
v, with padding and GQA, in both memory layouts the models hand over; FP8 with emulated rounding;
and the sampling step against the masked step. GPU kernels themselves: benchmarks/gpu_check.py."""

import pytest
import torch

from setdiff_megatron.core.attention import set_causal_attention
from setdiff_megatron.core.step_attention import set_causal_step_attention
from setdiff_megatron.errors import UserError
from setdiff_megatron.kernels.flash_attn import flash_attention, flash_step_attention
from setdiff_megatron.kernels.te_fused import FP8Settings, physical_layout, te_attention, te_step_attention
from tests.kernels import emulation

TRAIN = {
    "te": lambda *args, api=None: te_attention(*args, api=api or emulation.te_api()),
    "flash_attn": lambda *args, api=None: flash_attention(*args, api=api or emulation.flash_api()),
}
FP32 = {"te": emulation.te_api(allow_fp32=True), "flash_attn": emulation.flash_api(allow_fp32=True)}
"""The emulation letting fp32 through, for the adapters' exactness at 1e-5 (the GPUs take half precision)."""
STEP = {
    "te": lambda *args, **kw: te_step_attention(*args, **kw, api=emulation.te_api(allow_fp32=True)),
    "flash_attn": lambda *args, **kw: flash_step_attention(*args, **kw, api=emulation.flash_api(allow_fp32=True)),
}
SHAPES = [  # (batch, heads, kv_heads, L, head_dim)
    (1, 1, 1, 1, 8),
    (2, 4, 2, 5, 16),
    (3, 6, 2, 17, 8),
    (2, 8, 1, 33, 32),
]
DELAYED_HYBRID = FP8Settings("DelayedScaling", True, "e4m3", "e5m2", 448.0, 57344.0, dpa=True)


def inputs(shape, dtype, seed, layout="bhsd"):
    """q [B, H, 2L, D], k, v [B, G, 2L, D] as views of storage in `layout` order, and a dout."""
    b, h, g_, length, d = shape
    gen = torch.Generator().manual_seed(seed)
    perm = {"bhsd": (0, 1, 2, 3), "bshd": (0, 2, 1, 3), "sbhd": (2, 0, 1, 3)}[layout]

    def make(heads):
        logical = torch.randn(b, heads, 2 * length, d, generator=gen, dtype=torch.float64)
        return logical.permute(*perm).contiguous().permute(*torch.argsort(torch.tensor(perm)).tolist()).to(dtype)

    return make(h), make(g_), make(g_), torch.randn(b, h, 2 * length, d, generator=gen, dtype=torch.float64).to(dtype)


def outputs_and_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout.to(out.dtype)))


def dense(q, k, v, valid_len=None):
    return set_causal_attention(q, k, v, impl="dense", valid_len=valid_len)


def assert_all_close(got, expected, tol, what):
    for name, a, e in zip(["out", "dq", "dk", "dv"], got, expected):
        torch.testing.assert_close(a.double(), e.double(), rtol=tol, atol=tol, msg=f"{what}: {name} differs")


@pytest.mark.parametrize("kernel", sorted(TRAIN))
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_matches_dense_fp32(kernel, shape, padded):
    """fp32: within 1e-5 of the fp64 dense reference (observed <= 1e-6)."""
    q, k, v, dout = inputs(shape, torch.float32, hash((shape, padded)) % 2**31)
    scale = shape[-1] ** -0.5
    gen = torch.Generator().manual_seed(1)
    valid_len = torch.randint(0, shape[3] + 1, (shape[0],), generator=gen) if padded else None
    expected = outputs_and_grads(lambda *a: dense(*a, valid_len), *(t.double() for t in (q, k, v, dout)))
    got = outputs_and_grads(lambda *a: TRAIN[kernel](*a, scale, valid_len, api=FP32[kernel]), q, k, v, dout)
    assert_all_close(got, expected, 1e-5, kernel)


@pytest.mark.parametrize("kernel", sorted(TRAIN))
@pytest.mark.parametrize("layout", ["bhsd", "sbhd"])
def test_query_rows_only_match_dense(kernel, layout):
    """The last layer's mode (q of the query stream only) through each adapter, with padding."""
    shape = (2, 4, 2, 9, 16)
    q, k, v, dout = inputs(shape, torch.float32, 7, layout)
    q, dout = q[:, :, shape[3] :], dout[:, :, shape[3] :]
    valid_len = torch.tensor([9, 4])
    expected = outputs_and_grads(lambda *a: dense(*a, valid_len), *(t.double() for t in (q, k, v, dout)))
    got = outputs_and_grads(lambda *a: TRAIN[kernel](*a, shape[-1] ** -0.5, valid_len, api=FP32[kernel]), q, k, v, dout)
    assert_all_close(got, expected, 1e-5, kernel)


@pytest.mark.parametrize("layout", ["bshd", "sbhd"])
def test_te_works_in_place_on_the_models_layouts(layout):
    """Megatron hands over [s, b, h, d] storage, the torch model [b, s, h, d]: TE gets that layout
    (no transposing copy of q) and the output comes back in it."""
    q, k, v, dout = inputs((2, 4, 2, 9, 16), torch.float32, 7, layout)
    assert physical_layout(k) == layout
    expected = outputs_and_grads(dense, *(t.double() for t in (q, k, v, dout)))
    got = outputs_and_grads(lambda *a: TRAIN["te"](*a, 0.25, None, api=FP32["te"]), q, k, v, dout)
    assert_all_close(got, expected, 1e-5, layout)
    order = (0, 2, 1, 3) if layout == "bshd" else (2, 0, 1, 3)
    assert got[0].permute(*order).is_contiguous()


@pytest.mark.parametrize("kernel", sorted(TRAIN))
def test_bf16_matches_dense(kernel):
    """bf16 inputs, fp32 statistics: within 3e-2 of the fp64 reference (observed ~1e-2)."""
    q, k, v, dout = inputs((2, 4, 2, 24, 32), torch.bfloat16, 3)
    expected = outputs_and_grads(dense, *(t.double() for t in (q, k, v, dout)))
    got = outputs_and_grads(lambda *a: TRAIN[kernel](*a, 32**-0.5, None), q, k, v, dout)
    assert_all_close(got, expected, 3e-2, kernel)


def test_te_fp8_within_fp8_rounding():
    """FP8 (E4M3 forward, E5M2 backward, emulated rounding of Q/K/V, P, O, dO, dP, dQ/dK/dV):
    max error / max |reference| below 0.12 for the output and 0.25 for the gradients (observed
    ~0.07 and ~0.15); and it really is the FP8 path: far from the BF16 result."""
    q, k, v, dout = inputs((2, 4, 2, 16, 128), torch.bfloat16, 5)
    expected = outputs_and_grads(dense, *(t.double() for t in (q, k, v, dout)))
    fp8 = outputs_and_grads(
        lambda *a: TRAIN["te"](*a, 128**-0.5, None, api=emulation.te_api(fp8=DELAYED_HYBRID)), q, k, v, dout
    )
    for name, a, e, tol in zip(["out", "dq", "dk", "dv"], fp8, expected, [0.12, 0.25, 0.25, 0.25]):
        rel = ((a.double() - e).abs().max() / e.abs().max()).item()
        assert rel < tol, f"FP8 {name}: relative max error {rel:.3f}"
    bf16 = outputs_and_grads(lambda *a: TRAIN["te"](*a, 128**-0.5, None), q, k, v, dout)
    assert (fp8[0].float() - bf16[0].float()).abs().max() > 1e-2


STEPS = [(5, 2, 3), (0, 2, 2), (4, 0, 3), (6, 3, 0), (0, 0, 2)]  # (cached, commits, queries)


@pytest.mark.parametrize("kernel", sorted(STEP))
@pytest.mark.parametrize("cached,commits,queries", STEPS)
def test_step_matches_masked_step(kernel, cached, commits, queries):
    """Cache part on the kernel, step block and diagonal merged in: within 1e-5 (fp32) of the
    fp64 masked step, with every row full, and with ragged cache lengths and dummy commits."""
    gen = torch.Generator().manual_seed(cached * 100 + commits * 10 + queries)
    b, h, g_, d, t = 3, 4, 2, 8, commits + queries
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, g_, t, d, generator=gen, dtype=torch.float64) for _ in range(2))
    kc, vc = (torch.randn(b, g_, cached, d, generator=gen, dtype=torch.float64) for _ in range(2))
    cache_len, commit_len = torch.tensor([cached, max(cached - 2, 0), 0]), torch.tensor([commits, commits // 2, 0])
    cache_mask = torch.arange(cached) < cache_len[:, None]
    for lengths in ({}, {"cache_len": cache_len, "commit_len": commit_len}):
        expected = set_causal_step_attention(q, k, v, kc, vc, num_commit=commits, **lengths)
        got = STEP[kernel](*(x.float() for x in (q, k, v, kc, vc)), num_commit=commits, **lengths)
        torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-5)
    # core's entry point turns prefix masks into lengths for the kernel path
    masked = set_causal_step_attention(q, k, v, kc, vc, num_commit=commits, cache_mask=cache_mask)
    got = STEP[kernel](*(x.float() for x in (q, k, v, kc, vc)), num_commit=commits, cache_len=cache_len)
    torch.testing.assert_close(got.double(), masked, rtol=1e-5, atol=1e-5)


def test_step_kernel_path_refuses_holes():
    x, cache = torch.zeros(1, 2, 2, 4), torch.zeros(1, 2, 3, 4)
    with pytest.raises(ValueError, match="prefix"):
        set_causal_step_attention(
            x, x, x, cache, cache, num_commit=1, cache_mask=torch.tensor([[True, False, True]]), impl="te"
        )


def test_the_emulation_refuses_what_the_libraries_refuse():
    """fp32 (both), a flash head dim off the multiples of 8 (bare call), an int64 cache_seqlens
    and a strided softmax_lse in flash's backward, which mha_bwd would read by its data pointer."""
    q, k, v, _ = inputs((1, 2, 2, 4, 16), torch.float32, 0)
    with pytest.raises(UserError, match="no fused float32 attention"):  # TE picks no backend for fp32
        te_attention(q, k, v, 0.25, None, api=emulation.te_api())
    cu = torch.tensor([0, 4], dtype=torch.int32)
    x = torch.randn(1, 4, 2, 16)
    with pytest.raises(ValueError, match="takes bf16, fp16 or FP8"):
        emulation.te_api().fused_attn_fwd(True, 4, 4, cu, cu, x, x, x, torch.float32, "F16_arbitrary_seqlen",
                                          qkv_layout="bshd_bshd_bshd", attn_mask_type="causal")  # fmt: skip
    with pytest.raises(RuntimeError, match="only support fp16 and bf16"):
        flash_attention(q, k, v, 0.25, None, api=emulation.flash_api())
    fa = emulation.flash_api()
    x = torch.randn(1, 8, 2, 12, dtype=torch.bfloat16)  # [b, s, h, d], head dim 12
    with pytest.raises(RuntimeError, match="multiples of 8 up to 256"):
        fa.forward(x, x, x, 0.0, 0.3, True, -1, -1, 0.0, None, False)
    q = torch.randn(2, 3, 2, 16, dtype=torch.bfloat16)
    cache = torch.randn(2, 5, 2, 16, dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="int32"):
        fa.with_kvcache(q, cache, cache, cache_seqlens=torch.tensor([5, 3]), return_softmax_lse=True)
    out, lse, _, rng = fa.forward(q, q, q, 0.0, 0.25, True, -1, -1, 0.0, None, False)
    grads = [torch.empty_like(q) for _ in range(3)]
    strided = torch.cat([lse, lse], dim=2)[:, :, 3:]
    with pytest.raises(RuntimeError, match="by its data pointer as contiguous fp32"):
        fa.backward(q, q, q, q, out, strided, *grads, 0.0, 0.25, True, -1, -1, 0.0, None, False, rng)


@pytest.mark.parametrize("window", [(2, 0), (1, 1), (-1, 0)])
def test_the_emulations_honour_window_size(window):
    """flash-attn's (left, right) band and TE's window_size, against a dense banded softmax."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 6, 16, generator=gen, dtype=torch.bfloat16) for _ in range(3))  # [b, h, s, d]
    i, j = torch.arange(6)[:, None], torch.arange(6)[None, :]
    band = (j >= i - window[0] if window[0] >= 0 else True) & (j <= i + window[1])
    scores = (q.float() @ k.float().transpose(-1, -2) * 0.25).masked_fill(~band, float("-inf"))
    expected = scores.softmax(-1) @ v.float()
    fa_out = emulation.flash_api().forward(
        *(x.transpose(1, 2) for x in (q, k, v)), 0.0, 0.25, False, *window, 0.0, None, False
    )[0]
    torch.testing.assert_close(fa_out.transpose(1, 2).float(), expected, rtol=2e-2, atol=2e-2)
    cu = torch.tensor([0, 6], dtype=torch.int32)
    te_out, _ = emulation.te_api().fused_attn_fwd(
        True, 6, 6, cu, cu, *(x.transpose(1, 2).contiguous() for x in (q, k, v)), torch.bfloat16,
        "F16_arbitrary_seqlen", attn_scale=0.25, qkv_layout="bshd_bshd_bshd", attn_mask_type="no_mask",
        window_size=window,
    )  # fmt: skip
    torch.testing.assert_close(te_out.transpose(1, 2).float(), expected, rtol=2e-2, atol=2e-2)
