"""GPU check for a lent H200 (or any CUDA GPU), one call of a few minutes.

1. Fused set-causal attention on the GPU's flash kernel against the dense reference: outputs and
   gradients of q, k, v in bf16, several L, GQA and padding.
2. A ~1B-parameter model on the megatron body, `local` layers, BF16: step time, tokens/s and MFU
   (model FLOPs of training_flops_per_token against the GPU's dense BF16 peak), and the same
   training step with the reference's dense-mask attention (sdpa) as the baseline ratio.
3. Attention kernels (setdiff_megatron/kernels): each GPU implementation this machine has (TE
   fused BF16, TE FP8 under an fp8_autocast with DelayedScaling and fp8_dpa, flash-attn 2,
   PyTorch's flash) against the dense fp32 reference, outputs and q/k/v gradients, GQA and padding, head dim 128;
   the sampling step (ragged cache) against the masked step; forward+backward time of each
   against masked SDPA over 2L. Tolerances (max error / max |reference|): bf16 2e-2; FP8 0.15
   for the output, 0.35 for gradients (this check on the CPU emulation of the FP8 kernels, with
   shorter L, sees up to 0.09 and 0.26: input quantization to E4M3 dominates, not dP in E5M2).
   A kernel that is not installed is reported as skipped, with the reason: the lent machine has
   CUDA torch but neither TE (its CUDA wheels are 276-729 MB, past what can be carried) nor
   flash-attn (no PyPI wheels), so there only PyTorch's path runs; run it on a machine with them.
4. The sampler on the KV cache's kernel step (KVCache.attention_impl 'te' / 'flash_attn', each
   where installed) against its masked SDPA step, bf16, same weights and prompts:
   a. parity: a small model (head dim 128) trained for a few seconds to copy a repeated token, so
      greedy choices are not near ties; 16 mixed-length rows with an infill span, thresholded
      sets (ragged commits) and outputs past the context (eviction): greedy tokens must be equal;
      the step logits' max error / max |SDPA logits| is reported against 2e-2;
   b. tokens/s at batch 1 and 16 on a random ~0.8B model (head dim 128, 16 prompts of 256-1024
      tokens, 64 new tokens each, set-size 2 in a window of 16): each kernel path against the
      SDPA path; greedy agreement is reported, not required (a random model's bf16 near ties).
      For the TE path also the distinct fused-attention call shapes over the decode (each one a
      cuDNN graph build; expected: a handful, one per batch size and step width, not one per
      step) and the bytes copied per forward to give TE its layout (expected: the step's queries
      only, never the cache; te_fused.KERNEL_STATS).
5. Compiled static-shape decode steps (sampling/step_compiler.py, CUDA graphs per bucket through
   `mode="reduce-overhead"`) against eager steps, bf16: greedy tokens of the copying model of 4a
   must be equal; ms per decode forward at batch 1 and 16 on the model of 4b, with the warm-up
   (compile and capture) time. This is what takes the CUDA path off "GPU-unverified".

    bash benchmarks/gpu_check.sh                      # everything
    bash benchmarks/gpu_check.sh --sections kernels   # only part 3 (a minute or two)
    bash benchmarks/gpu_check.sh --sections sampler   # only part 4 (estimated: a few minutes)
    bash benchmarks/gpu_check.sh --sections compiled  # only part 5
"""

from __future__ import annotations

import argparse
import json
import time
from contextlib import nullcontext

import torch

from benchmarks.machine import best_time, machine_info, save_results
from setdiff_megatron.core.attention import set_causal_attention
from setdiff_megatron.core.step_attention import set_causal_step_attention
from setdiff_megatron.errors import ArgumentParser, UserError
from setdiff_megatron.kernels import choose_attention_impl, flash_attn, te_fused
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.training.metric_sinks import peak_flops, training_flops_per_token

BF16_TOL, FP8_TOL = {"out": 2e-2, "grad": 2e-2}, {"out": 0.15, "grad": 0.35}


def attention_parity() -> list[dict]:
    rows = []
    for length, heads, kv_heads, padded in [
        (1, 8, 8, False),
        (7, 8, 2, True),
        (256, 16, 8, False),
        (1024, 16, 4, True),
        (2048, 16, 16, False),
    ]:
        gen = torch.Generator(device="cuda").manual_seed(length)
        shape = (2, heads, 2 * length, 128)
        q = torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((2, kv_heads, 2 * length, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
        v = torch.randn_like(k)
        dout = torch.randn_like(q)
        valid = torch.tensor([length, max(length - 3, 0)], device="cuda") if padded else None
        results = {}
        for impl, dtype in (("dense", torch.float32), ("fused", torch.bfloat16)):
            args = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
            out = set_causal_attention(*args, impl=impl, valid_len=valid)
            grads = torch.autograd.grad(out, args, dout.to(dtype))
            results[impl] = [out.float(), *(g.float() for g in grads)]
        errors = {
            name: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
            for name, a, b in zip(["out", "dq", "dk", "dv"], results["fused"], results["dense"])
        }
        rows.append(
            {
                "L": length,
                "heads": heads,
                "kv_heads": kv_heads,
                "padded": padded,
                "rel_max_err": errors,
                "ok": all(e < 2e-2 for e in errors.values()),
            }
        )
        print(
            f"attention L={length:>5} heads {heads}/{kv_heads} pad={padded}: "
            + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
            "OK" if rows[-1]["ok"] else "FAIL",
        )
    return rows


def train_step(attention_impl: str, *, steps: int = 6) -> dict:
    from benchmarks.megatron_step import megatron_step
    from setdiff_megatron.core.orders import Staggered
    from setdiff_megatron.core.streams import sample_two_stream_batch

    seq_len, micro = 2048, 4
    recipe = {
        "model": dict(
            hidden_size=2048,
            num_layers=16,
            num_heads=16,
            num_kv_heads=8,
            intermediate_size=5632,
            max_seq_len=seq_len,
            attention_impl=attention_impl,
            qk_norm=True,
        ),
        "data": {"seq_len": seq_len},
        "train": {"precision": "bf16", "steps": 100, "warmup_steps": 0},
        "parallel": {"micro_batch_size": micro, "global_batch_size": micro},
        "launch": {"device": "cuda"},
    }
    gen = torch.Generator(device="cuda").manual_seed(0)
    tokens = torch.randint(0, 31999, (micro, seq_len), device="cuda", generator=gen)
    batch = [sample_two_stream_batch(tokens, Staggered(d=4), mask_token_id=31999, generator=gen)]
    step, cfg = megatron_step(recipe, vocab_size=32000, mask_token_id=31999, batches=batch)
    step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / steps
    tps = micro * seq_len / seconds
    flops = training_flops_per_token(cfg, seq_len) * tps
    peak = peak_flops(torch.cuda.get_device_name())
    row = {
        "attention": attention_impl,
        "params": cfg.num_params(),
        "step_s": seconds,
        "tokens_per_s": tps,
        "tflops": flops / 1e12,
        "mfu": flops / peak if peak else None,
        "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30,
    }
    print(json.dumps(row))
    torch.cuda.empty_cache()
    return row


def kernel_variants() -> dict[str, tuple]:
    """name -> (attention_impl, context manager factory) for the kernels this machine has, or the
    reason it is skipped."""
    variants = {"fused": ("fused", nullcontext)}
    te_ok, te_why = te_fused.te_status()
    if te_ok:
        from transformer_engine.common.recipe import DelayedScaling, Format
        from transformer_engine.pytorch import fp8_autocast

        variants["te"] = ("te", nullcontext)
        variants["te_fp8"] = (
            "te",
            lambda: fp8_autocast(
                enabled=True,
                fp8_recipe=DelayedScaling(
                    fp8_format=Format.HYBRID, amax_history_len=1, amax_compute_algo="most_recent", fp8_dpa=True
                ),
            ),
        )
    else:
        variants["te"] = variants["te_fp8"] = f"skipped: {te_why}"
    fa_ok, fa_why = flash_attn.flash_status()
    variants["flash_attn"] = ("flash_attn", nullcontext) if fa_ok else f"skipped: {fa_why}"
    return variants


def _rel_errors(got, expected) -> dict:
    return {
        name: (a.float() - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
        for name, a, b in zip(["out", "dq", "dk", "dv"], got, expected)
    }


def kernel_parity(variants: dict) -> list[dict]:
    rows = []
    for length, heads, kv_heads, padded in [
        (7, 8, 2, True),
        (256, 16, 8, False),
        (1024, 16, 4, True),
        (2048, 16, 16, False),
    ]:
        gen = torch.Generator(device="cuda").manual_seed(length)
        q = torch.randn((2, heads, 2 * length, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((2, kv_heads, 2 * length, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
        v, dout = torch.randn_like(k), torch.randn_like(q)
        valid = torch.tensor([length, max(length - 3, 0)], device="cuda") if padded else None
        ref_args = [t.detach().float().requires_grad_() for t in (q, k, v)]
        ref_out = set_causal_attention(*ref_args, impl="dense", valid_len=valid)
        reference = [ref_out, *torch.autograd.grad(ref_out, ref_args, dout.float())]
        for name, variant in variants.items():
            row = {"kernel": name, "L": length, "heads": heads, "kv_heads": kv_heads, "padded": padded}
            if isinstance(variant, str):
                rows.append({**row, "result": variant})
                continue
            impl, context = variant
            tol = FP8_TOL if name.endswith("fp8") else BF16_TOL
            args = [t.detach().requires_grad_() for t in (q, k, v)]
            try:
                with context():
                    out = set_causal_attention(*args, impl=impl, valid_len=valid)
                grads = torch.autograd.grad(out, args, dout)
            except UserError as exc:  # e.g. FP8 at a length cuDNN does not take
                rows.append({**row, "result": f"unsupported: {exc}"})
                print(f"{name:>10} L={length:>5}: unsupported: {exc}")
                continue
            errors = _rel_errors([out, *grads], reference)
            ok = errors["out"] < tol["out"] and all(errors[g] < tol["grad"] for g in ("dq", "dk", "dv"))
            rows.append({**row, "rel_max_err": errors, "tolerance": tol, "ok": ok})
            print(
                f"{name:>10} L={length:>5} heads {heads}/{kv_heads} pad={padded}: "
                + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()),
                "OK" if ok else "FAIL",
            )
        del ref_args, ref_out, reference
        torch.cuda.empty_cache()
    return rows


def step_parity(variants: dict) -> list[dict]:
    """One sampling step (300 cached, ragged rows, 4 commits with a dummy, 8 queries) against the
    masked SDPA step in fp32."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    b, heads, kv_heads, d, cached, commits, queries = 3, 16, 4, 128, 300, 4, 8
    q = torch.randn((b, heads, commits + queries, d), generator=gen, device="cuda", dtype=torch.bfloat16)
    k, v = (
        torch.randn((b, kv_heads, commits + queries, d), generator=gen, device="cuda", dtype=torch.bfloat16)
        for _ in range(2)
    )
    kc, vc = (
        torch.randn((b, kv_heads, cached, d), generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(2)
    )
    lengths = {
        "cache_len": torch.tensor([cached, 120, 0], device="cuda"),
        "commit_len": torch.tensor([commits, 3, 0], device="cuda"),
    }
    expected = set_causal_step_attention(*(t.float() for t in (q, k, v, kc, vc)), num_commit=commits, **lengths)
    rows = []
    for name in ("te", "flash_attn"):
        if isinstance(variants[name], str):
            rows.append({"kernel": name, "result": variants[name]})
            continue
        got = set_causal_step_attention(q, k, v, kc, vc, num_commit=commits, impl=name, **lengths)
        err = (got.float() - expected).abs().max().item() / expected.abs().max().item()
        rows.append({"kernel": name, "rel_max_err": err, "tolerance": BF16_TOL["out"], "ok": err < BF16_TOL["out"]})
        print(f"step {name}: rel max err {err:.1e}", "OK" if rows[-1]["ok"] else "FAIL")
    return rows


def kernel_timing(variants: dict, *, repeats: int = 5) -> list[dict]:
    """Forward + backward of each kernel against masked SDPA over 2L: bf16, batch 2, 16 query /
    8 key-value heads, head dim 128."""
    rows = []
    for length in (1024, 4096):
        gen = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn((2, 16, 2 * length, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
        k = torch.randn((2, 8, 2 * length, 128), generator=gen, device="cuda", dtype=torch.bfloat16)
        v, dout = torch.randn_like(k), torch.randn_like(q)
        args = [t.requires_grad_() for t in (q, k, v)]
        timings = {}
        for name, variant in {"sdpa": ("sdpa", nullcontext), **variants}.items():
            if isinstance(variant, str):
                continue
            impl, context = variant

            def run(context=context, impl=impl, args=args, dout=dout):
                with context():
                    out = set_causal_attention(*args, impl=impl)
                torch.autograd.grad(out, args, dout)
                torch.cuda.synchronize()

            try:
                timings[name] = best_time(run, repeats=repeats, warmup=2)
            except UserError as exc:
                print(f"timing {name} L={length}: unsupported: {exc}")
        row = {"L": length, "seconds": timings, "speedup_vs_sdpa": {n: timings["sdpa"] / t for n, t in timings.items()}}
        rows.append(row)
        print(
            f"fwd+bwd L={length}: "
            + ", ".join(f"{n} {t * 1e3:.2f} ms ({timings['sdpa'] / t:.2f}x)" for n, t in timings.items())
        )
        torch.cuda.empty_cache()
    return rows


def kernel_checks() -> dict:
    variants = kernel_variants()
    print("auto picks:", choose_attention_impl("cuda", torch.bfloat16, 128))
    return {
        "auto": choose_attention_impl("cuda", torch.bfloat16, 128)._asdict(),
        "parity": kernel_parity(variants),
        "step": step_parity(variants),
        "timing": kernel_timing(variants),
    }


# The sampler check's models: a copier for parity (trained on the spot) and a ~0.8B timing model.
COPY_MODEL = dict(
    hidden_size=256,
    num_layers=2,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=768,
    vocab_size=512,
    mask_token_id=511,
    max_seq_len=64,
)
TIMING_MODEL = dict(
    hidden_size=2048,
    num_layers=16,
    num_heads=16,
    num_kv_heads=8,
    intermediate_size=5632,
    vocab_size=32000,
    mask_token_id=31999,
    max_seq_len=2048,
)


class _CachePath:
    """A model seen by the sampler with its KV cache on one step attention ('sdpa': the mask)."""

    def __init__(self, model, impl: str, *, record: bool = False):
        self.model, self.impl, self.record, self.logits = model, impl, record, []

    def new_cache(self, batch_size, capacity):
        cache = self.model.new_cache(batch_size, capacity)
        cache.attention_impl = self.impl
        return cache

    def step(self, *args, **kwargs):
        out = self.model.step(*args, **kwargs)
        if self.record:
            self.logits.append(out.float())
        return out


def _copying_model(device: str, steps: int = 200):
    """COPY_MODEL trained (fp32, masked SDPA) on rows repeating one token: it learns to copy a
    visible token to every masked position, confidently."""
    from setdiff_megatron.core.orders import Staggered
    from setdiff_megatron.models.config import ModelConfig
    from setdiff_megatron.models.torch_model import SetDiffusionTransformer

    torch.manual_seed(0)
    model = SetDiffusionTransformer(ModelConfig(**COPY_MODEL, attention_impl="sdpa")).to(device)
    gen = torch.Generator(device=device).manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        batch = torch.randint(0, COPY_MODEL["mask_token_id"], (64, 1), device=device, generator=gen).expand(-1, 32)
        loss = model.loss(batch, Staggered(d=4), generator=gen).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval(), loss.item()


def sampler_parity(paths: list[str], device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Part 4a: greedy decodes and step logits of each kernel cache path against the SDPA one."""
    model, loss = _copying_model(device)
    model = model.to(dtype)
    mask = COPY_MODEL["mask_token_id"]
    gen = torch.Generator().manual_seed(1)
    prompts = []
    for i in range(16):
        n = 1 + i % 12
        tok = int(torch.randint(0, mask, (1,), generator=gen))
        prompts.append([tok] * n + ([mask, mask, tok] if i % 3 == 0 else []))
    # threshold: rows decode different set sizes; 40 new tokens past context 32: eviction
    cfg = DecodingConfig(window=8, threshold=0.5, max_new_tokens=40)
    runs = {}
    for impl in ["sdpa", *paths]:
        recorder = _CachePath(model, impl, record=True)
        out = SetSampler(recorder, mask_token_id=mask, context_len=32).generate(prompts, cfg)
        runs[impl] = (out, recorder.logits)
    (ref, ref_logits) = runs["sdpa"]
    copied = sum(t == p[0] for r, p in zip(ref.rows, prompts) for t in r.tokens) / sum(len(r.tokens) for r in ref.rows)
    result = {
        "train_loss": loss,
        "copied_share": copied,
        "tokens_per_step": ref.metrics.tokens_per_step,
        "max_row_len": max(len(r.tokens) for r in ref.rows),
        "context_len": 32,
    }
    print(
        f"sampler parity: copier loss {loss:.3f}, {copied:.1%} of tokens copied, "
        f"{ref.metrics.tokens_per_step:.2f} tokens/step (sdpa cache path)"
    )
    for impl in paths:
        out, logits = runs[impl]
        equal = [a.tokens == b.tokens for a, b in zip(out.rows, ref.rows)]
        err = None
        if all(equal) and len(logits) == len(ref_logits):
            err = max(
                ((a - b).abs().max() / b.abs().max().clamp(min=1e-6)).item()
                for a, b in zip(logits, ref_logits)
                if b.numel()
            )
        ok = all(equal) and err is not None and err < BF16_TOL["out"]
        result[impl] = {
            "tokens_equal": sum(equal),
            "rows": len(equal),
            "step_logits_rel_err": err,
            "tolerance": BF16_TOL["out"],
            "ok": ok,
        }
        print(
            f"sampler parity {impl}: {sum(equal)}/{len(equal)} rows equal, step logits rel err "
            f"{'n/a' if err is None else f'{err:.1e}'}",
            "OK" if ok else "FAIL",
        )
    return result


def timing_workload(device: str, dtype: torch.dtype) -> tuple:
    """The random TIMING_MODEL, 16 prompts of mixed lengths and the policy parts 4b and 5 time."""
    from setdiff_megatron.models.config import ModelConfig
    from setdiff_megatron.models.torch_model import SetDiffusionTransformer

    torch.manual_seed(0)
    model = SetDiffusionTransformer(ModelConfig(**TIMING_MODEL)).to(device, dtype).eval()
    mask, gen = TIMING_MODEL["mask_token_id"], torch.Generator().manual_seed(0)
    lengths = torch.randint(TIMING_MODEL["max_seq_len"] // 8, TIMING_MODEL["max_seq_len"] // 2, (16,), generator=gen)
    prompts = [torch.randint(0, mask, (int(n),), generator=gen).tolist() for n in lengths]
    return model, mask, prompts, DecodingConfig(window=16, tokens_per_step=2, max_new_tokens=64)


def sampler_timing(
    paths: list[str], device: str = "cuda", dtype: torch.dtype = torch.bfloat16, batches: tuple[int, ...] = (1, 16)
) -> list[dict]:
    """Part 4b: tokens/s of each cache path at each batch size, same model, prompts and policy."""
    model, mask, prompts, cfg = timing_workload(device, dtype)
    sampler = {
        impl: SetSampler(_CachePath(model, impl), mask_token_id=mask, context_len=TIMING_MODEL["max_seq_len"])
        for impl in ["sdpa", *paths]
    }
    rows = []
    for batch in batches:
        outs, te_cost = {}, None
        for impl, s in sampler.items():
            s.generate(prompts[:batch], cfg, batch_size=batch)  # warm-up (kernels, allocator)
            te_fused.KERNEL_STATS.reset()
            outs[impl] = s.generate(prompts, cfg, batch_size=batch)
            if impl == "te":  # what the TE calls cost beyond their math (te_fused.KERNEL_STATS)
                te_cost = {
                    "graph_shapes": len(te_fused.KERNEL_STATS.shapes),
                    "copied_bytes_per_forward": te_fused.KERNEL_STATS.copied_bytes / outs[impl].metrics.forwards,
                }
        base = outs["sdpa"].metrics.tokens_per_s
        row = {
            "batch": batch,
            "tokens_per_s": {k: o.metrics.tokens_per_s for k, o in outs.items()},
            "speedup_vs_sdpa": {k: o.metrics.tokens_per_s / base for k, o in outs.items()},
            "rows_equal_to_sdpa": {
                k: sum(a.tokens == b.tokens for a, b in zip(o.rows, outs["sdpa"].rows)) for k, o in outs.items()
            },
            "te_cost": te_cost,
        }
        rows.append(row)
        if te_cost is not None:
            print(
                f"sampler batch {batch:>2}, te: {te_cost['graph_shapes']} distinct fused-attention shapes over "
                f"{outs['te'].metrics.forwards} forwards (cuDNN builds a graph per shape), "
                f"{te_cost['copied_bytes_per_forward'] / 2**20:.2f} MiB copied per forward for TE's layout"
            )
        print(
            f"sampler batch {batch:>2}: "
            + ", ".join(
                f"{k} {row['tokens_per_s'][k]:.0f} tok/s ({row['speedup_vs_sdpa'][k]:.2f}x, "
                f"{row['rows_equal_to_sdpa'][k]}/16 rows equal)"
                for k in outs
            )
        )
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def sampler_checks(variants: dict) -> dict:
    """Part 4 over the kernel cache paths this machine has (the others reported as skipped)."""
    paths = [name for name in ("te", "flash_attn") if not isinstance(variants[name], str)]
    skipped = {name: variants[name] for name in ("te", "flash_attn") if name not in paths}
    for name, why in skipped.items():
        print(f"sampler {name} cache path: {why}")
    if not paths:
        return {"skipped": skipped}
    return {"skipped": skipped, "parity": sampler_parity(paths), "timing": sampler_timing(paths)}


def compiled_checks(device: str = "cuda", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Part 5: compiled decode steps against eager ones (parity on the copier, then timing)."""
    copier, _ = _copying_model(device)
    copier, mask = copier.to(dtype), COPY_MODEL["mask_token_id"]
    prompts = [[3 + i % 40] * (1 + i % 12) for i in range(16)]
    cfg = DecodingConfig(window=8, threshold=0.5, max_new_tokens=16)
    outs = {
        mode: SetSampler(copier, mask_token_id=mask, context_len=32, compile=mode).generate(prompts, cfg)
        for mode in ("off", "on")
    }
    equal = sum(a.tokens == b.tokens for a, b in zip(outs["on"].rows, outs["off"].rows))
    result = {"parity": {"rows_equal": equal, "rows": len(prompts), "ok": equal == len(prompts)}, "timing": []}
    print(
        f"compiled steps parity: {equal}/{len(prompts)} rows equal to eager", "OK" if equal == len(prompts) else "FAIL"
    )
    model, mask, prompts, cfg = timing_workload(device, dtype)
    samplers = {
        mode: SetSampler(model, mask_token_id=mask, context_len=TIMING_MODEL["max_seq_len"], compile=mode)
        for mode in ("off", "on")
    }
    for batch in (1, 16):
        start = time.perf_counter()
        samplers["on"].generate(prompts[: max(batch, 2)], cfg, batch_size=batch)  # compile and capture
        warm = time.perf_counter() - start
        row = {"batch": batch, "warm_up_s": warm}
        for mode, s in samplers.items():
            out = s.generate(prompts[: max(batch, 2)], cfg, batch_size=batch)
            row[f"ms_per_forward_{mode}"] = 1e3 * out.metrics.forward_s / out.metrics.forwards
        row["speedup"] = row["ms_per_forward_off"] / row["ms_per_forward_on"]
        result["timing"].append(row)
        print(
            f"compiled steps batch {batch:>2}: {row['ms_per_forward_on']:.2f} ms/forward against "
            f"{row['ms_per_forward_off']:.2f} eager ({row['speedup']:.2f}x), warm-up {warm:.1f} s"
        )
    return result


def main(argv: list[str] | None = None) -> None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--sections",
        nargs="+",
        choices=["parity", "kernels", "sampler", "compiled", "train"],
        default=["parity", "kernels", "sampler", "compiled", "train"],
    )
    sections = parser.parse_args(argv).sections
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU")
    print("machine:", machine_info())
    results = {}
    if "parity" in sections:
        results["attention"] = attention_parity()
    if "kernels" in sections:
        results["kernels"] = kernel_checks()
    if "sampler" in sections:
        results["sampler"] = sampler_checks(kernel_variants())
    if "compiled" in sections:
        results["compiled"] = compiled_checks()
    if "train" in sections:
        ours = train_step("fused")
        baseline = train_step("sdpa")
        print(f"fused vs dense-mask sdpa training step: {baseline['step_s'] / ours['step_s']:.2f}x; MFU {ours['mfu']}")
        results["train"] = [ours, baseline]
    te_ok, te_why = te_fused.te_status()
    results["fp8"] = (
        "see kernels.parity te_fp8 rows" if te_ok and "kernels" in sections else (f"not verified ({te_why})")
    )
    print("FP8 attention:", results["fp8"])
    save_results("gpu_check", results)


if __name__ == "__main__":
    main()
