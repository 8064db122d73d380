"""The KV cache on the kernel step (attention_impl 'te' / 'flash_attn'), run on the kernels'
pure-PyTorch emulation, against the masked SDPA cache path: the sampler's step logits (fp32,
1e-5) and greedy decodes for mixed-length batches with infill spans, ragged rows (different
numbers of commits per step, rows without a cache) and eviction; and how the models choose the
path. The megatron body runs the same checks in kv_cache_kernels_worker.py."""

from functools import partial

import pytest
import torch

from setdiff_megatron.core import step_attention
from setdiff_megatron.kernels import Choice, flash_attn, te_fused
from setdiff_megatron.models import torch_model
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling import kv_cache
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.kv_cache import KVCache
from setdiff_megatron.sampling.sampler import SetSampler
from tests.conftest import debug_config
from tests.kernels import emulation
from tests.models.megatron_cases import run_worker
from tests.sampling.test_sampler import MASK, Recorder, random_prompts

KERNELS = {
    "te": (te_fused.te_step_attention, emulation.te_api),
    "flash_attn": (flash_attn.flash_step_attention, emulation.flash_api),
}


def emulated_step(name: str, calls: list | None = None, *, allow_fp32: bool = True):
    """The kernel step `name` on the emulated kernel API, noting each call in `calls`; fp32 passes
    unless the emulation is to be strict (the GPU libraries take half precision only)."""
    step, api = KERNELS[name]
    step = partial(step, api=api(allow_fp32=allow_fp32))

    def counted(*args, **kwargs):
        if calls is not None:
            calls.append(name)
        return step(*args, **kwargs)

    return counted


def emulate_kernels(monkeypatch, calls: list | None = None, *, allow_fp32: bool = True) -> None:
    """Make 'te' and 'flash_attn' usable here, their steps running on the emulated kernels."""
    monkeypatch.setattr(te_fused, "te_status", lambda: (True, "emulation"))
    monkeypatch.setattr(flash_attn, "flash_status", lambda: (True, "emulation"))
    for name in KERNELS:
        monkeypatch.setitem(step_attention.STEP_IMPLS, name, emulated_step(name, calls, allow_fp32=allow_fp32))


@pytest.fixture(scope="module")
def reference():
    """fp32 debug model (GQA, q/k norm) whose cache takes the masked SDPA path."""
    torch.manual_seed(0)
    return SetDiffusionTransformer(debug_config(qk_norm=True, attention_impl="fused")).eval()


def kernel_model(reference, impl):
    model = SetDiffusionTransformer(debug_config(qk_norm=True, attention_impl=impl)).eval()
    model.load_state_dict(reference.state_dict())
    return model


# name -> (decoding config, prompt lengths, infill spans, context_len)
CASES = {
    # equal rows, one commit each per step: the cache never turns ragged (no key lengths)
    "uniform": (DecodingConfig(window=4, max_new_tokens=6), [5, 5, 5], (), 128),
    # ragged prefill (different visible counts, one row with nothing to cache), threshold sets
    "mixed-infill": (
        DecodingConfig(window=4, threshold=0.025, max_new_tokens=5),
        [12, 10, 7, 0, 3],
        ((2, 3), (7, 2)),
        128,
    ),
    "fill-k2-tau": (
        DecodingConfig(window=4, fill_window=True, tokens_per_step=2, threshold=0.025, max_new_tokens=6),
        [6, 2, 9, 11],
        ((1, 2), (5, 3)),
        128,
    ),
    # outputs past the context: rows evict their oldest generated entries (cache.drop)
    "evict": (DecodingConfig(window=3, threshold=0.025, max_new_tokens=30), [6, 4, 9], ((1, 2),), 16),
}


def sample(model, case):
    cfg, lengths, spans, context = CASES[case]
    prompts = random_prompts(torch.Generator().manual_seed(len(case)), lengths, spans)
    recorder = Recorder(model)
    out = SetSampler(recorder, mask_token_id=MASK, context_len=context).generate(prompts, cfg)
    return out, recorder.logits


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("impl", sorted(KERNELS))
def test_sampler_on_kernel_step_matches_sdpa_cache(reference, monkeypatch, impl, case):
    drops, ragged_steps = [], []
    real_drop, real_step = KVCache.drop, SetDiffusionTransformer.step

    def counted_drop(self, start, count):
        drops.append(int(count.sum()))
        real_drop(self, start, count)

    def noting_step(self, tokens, position_ids, cache, num_commit, commit_valid=None):
        layout = cache.layout  # rows commit different numbers of tokens: the cache turns ragged
        counts = commit_valid.sum(1) if commit_valid is not None else None if layout is None else layout.commit_count
        ragged_steps.append(counts is not None and bool((counts != counts.max()).any()))
        return real_step(self, tokens, position_ids, cache, num_commit, commit_valid)

    monkeypatch.setattr(KVCache, "drop", counted_drop)
    monkeypatch.setattr(SetDiffusionTransformer, "step", noting_step)
    expected, expected_logits = sample(reference, case)
    ragged, evictions, ragged_steps[:], drops[:] = any(ragged_steps), sum(drops), [], []

    calls = []
    emulate_kernels(monkeypatch, calls)
    model = kernel_model(reference, impl)

    def no_dense_mask(*args, **kwargs):
        raise AssertionError("the kernel path built the dense step mask")

    monkeypatch.setattr(kv_cache, "step_attention_mask", no_dense_mask)
    got, got_logits = sample(model, case)

    assert [r.tokens for r in got.rows] == [r.tokens for r in expected.rows]
    assert [r.nfe for r in got.rows] == [r.nfe for r in expected.rows]
    assert len(got_logits) == len(expected_logits) == got.metrics.forwards
    for step, (a, e) in enumerate(zip(got_logits, expected_logits)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=f"step {step}")
    assert calls == [impl] * (model.config.num_layers * got.metrics.forwards)
    assert any(ragged_steps) == ragged == (case != "uniform")
    assert sum(drops) == evictions and (evictions > 0) == (case == "evict")


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 2e-2)])
def test_cache_steps_with_dummy_commits_eviction_and_retired_rows(monkeypatch, dtype, tolerance):
    """KVCache alone: dummy commits, a row without a cache, drop and select_rows give the masked
    SDPA path's outputs on the kernel path, which select_rows and drop carry along; in bf16 on the
    strict emulation too (relative to the largest output)."""
    emulate_kernels(monkeypatch, allow_fp32=dtype == torch.float32)
    gen = torch.Generator()
    g, h, d = 2, 4, 16

    def step(cache, num_commit, num_query, commit_valid):
        b = cache.lengths.shape[0]
        q = torch.randn(b, h, num_commit + num_query, d, generator=gen).to(dtype)
        k, v = (torch.randn(b, g, num_commit + num_query, d, generator=gen).to(dtype) for _ in range(2))
        out = cache.attend(0, q, k, v, num_commit=num_commit, commit_valid=commit_valid)
        cache.advance()
        return out

    outs = {}
    for impl in ("sdpa", "te", "flash_attn"):
        gen.manual_seed(0)
        cache = KVCache.allocate(
            num_layers=1, batch_size=3, num_kv_heads=g, head_dim=d, capacity=32, attention_impl=impl, dtype=dtype
        )
        outs[impl] = [
            step(cache, 4, 0, torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]]).bool()),
            step(cache, 2, 3, torch.tensor([[1, 1], [1, 0], [1, 1]]).bool()),
            step(cache, 1, 2, None),
        ]
        cache.length = int(cache.lengths.max())
        cache.drop(torch.tensor([1, 0, 0]), torch.tensor([2, 1, 0]))
        cache = cache.select_rows(torch.tensor([2, 0]))
        assert cache.attention_impl == impl and cache.ragged and cache.uses_kernel == (impl != "sdpa")
        assert cache.keys.transpose(2, 3).is_contiguous() == (impl == "te")  # TE reads tokens-major storage
        outs[impl].append(step(cache, 2, 2, None))
    for impl in ("te", "flash_attn"):
        for a, e in zip(outs[impl], outs["sdpa"]):
            scale = 1.0 if dtype == torch.float32 else e.float().abs().max().item()
            torch.testing.assert_close(a.float() / scale, e.float() / scale, rtol=tolerance, atol=tolerance)


def test_te_decode_steps_build_one_graph_and_copy_no_cache(monkeypatch):
    """Eager decode steps on the TE kernel: every call over the cache has the same shape (cuDNN
    builds a graph per new shape and keeps it), and the only bytes copied for TE are the step's
    queries, never the cache (its storage is tokens-major: TE reads it in place)."""
    emulate_kernels(monkeypatch, allow_fp32=False)
    te_fused.KERNEL_STATS.reset()
    b, g, h, d, steps = 2, 2, 4, 16, 12
    cache = KVCache.allocate(
        num_layers=1, batch_size=b, num_kv_heads=g, head_dim=d, capacity=64, attention_impl="te", dtype=torch.bfloat16
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        q = torch.randn(b, h, 3, d, generator=gen).bfloat16()
        k, v = (torch.randn(b, g, 3, d, generator=gen).bfloat16() for _ in range(2))
        cache.attend(0, q, k, v, num_commit=2)
        cache.advance()
    assert cache.length == 2 * steps
    assert len(te_fused.KERNEL_STATS.shapes) == 1, te_fused.KERNEL_STATS.shapes
    assert te_fused.KERNEL_STATS.copied_bytes == steps * q.numel() * q.element_size()


def test_models_choose_the_cache_path(reference, monkeypatch):
    """'auto' resolves for the weights' device and dtype (CPU: 'fused', the SDPA cache path; a
    GPU with TE: 'te', the kernel path); forced names pass through."""
    assert reference.new_cache(2, 8).attention_impl == "fused" and not reference.new_cache(2, 8).uses_kernel
    auto = kernel_model(reference, "auto")
    assert auto.new_cache(2, 8).attention_impl == "fused"
    asked = []
    monkeypatch.setattr(
        torch_model,
        "choose_attention_impl",
        lambda *key: asked.append(key) or Choice("te", "a GPU with Transformer Engine"),
    )
    assert auto.new_cache(2, 8).attention_impl == "te" and asked == [("cpu", torch.float32, 16)]
    for impl in ("sdpa", "dense"):
        assert kernel_model(reference, impl).new_cache(1, 4).attention_impl == impl
    emulate_kernels(monkeypatch)
    for impl in KERNELS:
        cache = kernel_model(reference, impl).new_cache(1, 4)
        assert cache.attention_impl == impl and cache.uses_kernel
    assert KVCache.allocate(num_layers=1, batch_size=1, num_kv_heads=1, head_dim=2, capacity=2).attention_impl == "sdpa"


@pytest.mark.multiproc
def test_megatron_body_on_kernel_step_matches_torch_sdpa_cache(tmp_path):
    """TP=1 megatron model (sbhd activations) with an emulated kernel cache against the torch
    model's SDPA cache: step logits and greedy decodes (kv_cache_kernels_worker.py)."""
    results = run_worker("tests.sampling.kv_cache_kernels_worker", tmp_path / "kernels.json")
    for impl in KERNELS:
        r = results[impl]
        assert r["cache_impl"] == impl and r["kernel_calls"] > 0 and r["other_calls"] == 0
        assert r["step_logits_diff"] <= 1e-5
        assert all(r["tokens_equal"]) and all(r["nfe_equal"]) and len(r["tokens_equal"]) == 4
