"""GPU check for a lent H200 (or any CUDA GPU), one call of a few minutes.

1. Fused set-causal attention on the GPU's flash kernel against the dense reference: outputs and
   gradients of q, k, v in bf16, several L, GQA and padding.
2. A ~1B-parameter model on the megatron body, `local` layers, BF16: step time, tokens/s and MFU
   (model FLOPs of training_flops_per_token against the GPU's dense BF16 peak), and the same
   training step with the reference's dense-mask attention (sdpa) as the baseline ratio.
3. FP8: not verified here. The lent machine has torch but no Transformer Engine (its CUDA wheels
   do not fit what can be carried), so the `te` backend and FP8 GEMMs need a machine with TE.

    bash benchmarks/gpu_check.sh       # installs the carried megatron-core wheel, then runs this
"""

from __future__ import annotations

import json
import time

import torch

from benchmarks.machine import machine_info, save_results
from setdiff_megatron.core.attention import set_causal_attention
from setdiff_megatron.training.metrics import peak_flops, training_flops_per_token


def attention_parity() -> list[dict]:
    rows = []
    for length, heads, kv_heads, padded in [(1, 8, 8, False), (7, 8, 2, True), (256, 16, 8, False),
                                            (1024, 16, 4, True), (2048, 16, 16, False)]:
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
        errors = {name: (a - b).abs().max().item() / max(b.abs().max().item(), 1e-6)
                  for name, a, b in zip(["out", "dq", "dk", "dv"], results["fused"], results["dense"])}
        rows.append({"L": length, "heads": heads, "kv_heads": kv_heads, "padded": padded, "rel_max_err": errors,
                     "ok": all(e < 2e-2 for e in errors.values())})
        print(f"attention L={length:>5} heads {heads}/{kv_heads} pad={padded}: "
              + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), "OK" if rows[-1]["ok"] else "FAIL")
    return rows


def train_step(attention_impl: str, *, steps: int = 6) -> dict:
    from benchmarks.megatron_step import megatron_step
    from setdiff_megatron.core.orders import Staggered
    from setdiff_megatron.core.streams import sample_two_stream_batch

    seq_len, micro = 2048, 4
    recipe = {
        "model": dict(hidden_size=2048, num_layers=16, num_heads=16, num_kv_heads=8, intermediate_size=5632,
                      max_seq_len=seq_len, attention_impl=attention_impl, qk_norm=True),
        "data": {"seq_len": seq_len}, "train": {"precision": "bf16", "steps": 100, "warmup_steps": 0},
        "parallel": {"micro_batch_size": micro, "global_batch_size": micro}, "launch": {"device": "cuda"},
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
    row = {"attention": attention_impl, "params": cfg.num_params(), "step_s": seconds, "tokens_per_s": tps,
           "tflops": flops / 1e12, "mfu": flops / peak if peak else None,
           "max_memory_gb": torch.cuda.max_memory_allocated() / 2**30}
    print(json.dumps(row))
    torch.cuda.empty_cache()
    return row


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("gpu_check needs a CUDA GPU")
    print("machine:", machine_info())
    parity = attention_parity()
    ours = train_step("fused")
    baseline = train_step("sdpa")
    print(f"fused vs dense-mask sdpa training step: {baseline['step_s'] / ours['step_s']:.2f}x; "
          f"MFU {ours['mfu']}")
    print("FP8: not verified (no Transformer Engine on this machine)")
    save_results("gpu_check", {"attention": parity, "train": [ours, baseline], "fp8": "not verified"})


if __name__ == "__main__":
    main()
