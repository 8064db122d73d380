"""Peak memory per training token and per cached token, against the dense-mask baseline.

Training: the torch model of benchmarks/train_throughput.py (same MODEL and batches), one
forward + backward with each attention: 'dense' (explicit [2L, 2L] mask and softmax, the
reference's eager Qwen3 path), 'sdpa' (masked SDPA, its LM1B path) and 'fused' (ours). The peak
counts what the step adds above the weights and their gradients (allocated beforehand; optimizer
state is identical for all three and left out), per sequence token (L per example). One layer's
dense scores alone are B*H*(2L)^2*4 bytes, printed for comparison.

Sampling: the reference decodes with a KV cache (docs/method.md, "KV cache": a Hugging Face
DynamicCache, use_cache required), so the baseline is its cached step, not a recompute: every
layer grows the cache by concatenating the step's K/V, then the cache is cropped to the commits,
and attention is eager under an additive float mask. Ours: the preallocated cache written in place
(sampling/kv_cache.py). Both decode one step (2 commits, 8 queries) at batch 16 after a prefill of
context - 16 tokens, with the same weights; their logits must agree. Per cached token: the cache
bytes held, and the peak of the step on top of them.

Each configuration runs in a fresh process, so nothing a previous one left behind (allocator
caches, lazily built state) shows up in its numbers. CPU: the peak of live tensor bytes comes
from torch.profiler's allocator events (every allocation and free with its size), summed in
time order; profiling starts before anything is built, so every free it sees has a known size.
It is cross-checked against the growth of the process's RSS high-water mark over each training
step (with glibc returning freed blocks to the OS, see `return_freed_memory`).
CUDA: torch.cuda.max_memory_allocated.

    python -m benchmarks.memory [--lengths 256 512 1024] [--contexts 256 512 1024] [--device cpu]
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import math
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Self

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile, record_function

from benchmarks.machine import machine_info, save_results
from benchmarks.train_throughput import MODEL, batches, build_model
from setdiff_megatron.core.step_attention import step_mask
from setdiff_megatron.errors import ArgumentParser
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.kv_cache import KVCache

IMPLS = ("dense", "sdpa", "fused")
TRAIN_TOKENS = 1024  # sequence tokens per training batch: batch = TRAIN_TOKENS // L
SAMPLE_BATCH, WINDOW, COMMITS = 16, 8, 2  # a decode step: COMMITS commits then WINDOW queries
MIB = 2**20


# --------------------------------------------------------------------------------------------
# measuring


class CpuMeter:
    """Peaks of live CPU tensor bytes over named windows, from the profiler's allocator events.

    Enter it before building anything: a block allocated before profiling frees without a
    reported size, which would overstate the peak of a window that frees it.
    """

    def __enter__(self) -> Self:
        self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._prof.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._prof.__exit__(*exc)

    def window(self, name: str):
        return record_function(name)

    def peaks(self) -> dict[str, int]:
        """Each window's highest running sum of allocations minus frees, from its start."""
        events = sorted(self._prof.profiler.kineto_results.events(), key=lambda e: e.start_ns())
        memory = [e for e in events if e.name() == "[memory]"]
        out = {}
        for window in (e for e in events if e.is_user_annotation()):
            live = peak = 0
            for e in memory:
                if window.start_ns() <= e.start_ns() <= window.end_ns():
                    live += e.nbytes()
                    peak = max(peak, live)
            out[window.name()] = peak
        return out


@dataclass
class CudaMeter:
    """Peaks over named windows from the CUDA caching allocator's own counters."""

    _peaks: dict[str, int] = field(default_factory=dict)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        pass

    @contextlib.contextmanager
    def window(self, name: str):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        yield
        torch.cuda.synchronize()
        self._peaks[name] = torch.cuda.max_memory_allocated() - start

    def peaks(self) -> dict[str, int]:
        return self._peaks


def meter(device: str) -> CpuMeter | CudaMeter:
    return CudaMeter() if device == "cuda" else CpuMeter()


def peak_rss_bytes() -> int:
    """The process's resident-set high-water mark (VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")


def reset_peak_rss() -> int:
    """Lower the high-water mark to the current RSS (Linux: clear_refs 5) and return it. Without
    the reset the mark may still hold a peak from before the step (an import in the spawned
    interpreter), and the step's own growth would read as zero."""
    Path("/proc/self/clear_refs").write_text("5")
    return peak_rss_bytes()


def in_fresh_process(jobs: list[tuple]) -> list[dict]:
    """Run each (fn, *args) in its own spawned interpreter, two at a time (the numbers are per
    process, so running side by side changes only the wall time)."""
    with ProcessPoolExecutor(2, mp_context=get_context("spawn"), max_tasks_per_child=1) as pool:
        futures = [pool.submit(*job) for job in jobs]
        return [f.result() for f in futures]


# --------------------------------------------------------------------------------------------
# training


def forward_backward(
    model: SetDiffusionTransformer,
    clean: torch.Tensor,
    query: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
) -> None:
    logits = model(clean, query, positions)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten()).backward()


def return_freed_memory() -> None:
    """Fix glibc's mmap threshold at 64 KiB, so every larger block goes back to the OS when freed.

    With the default, adaptive threshold glibc keeps freed tensors in its heap for reuse, and the
    RSS high-water mark overstates live bytes (about 2x for the dense path); fixed, it follows
    them closely enough to check the profiler's count.
    """
    ctypes.CDLL("libc.so.6").mallopt(-3, 64 * 1024)  # -3: M_MMAP_THRESHOLD


def training_peak(impl: str, length: int, batch: int, device: str) -> dict:
    """Peak bytes a forward + backward adds to the weights and their (preallocated) gradients,
    and the growth of the RSS high-water mark over it (meaningful on the CPU only)."""
    if device == "cpu":
        return_freed_memory()
    with meter(device) as m:
        torch.manual_seed(0)
        model = build_model(impl, length).to(device)
        for p in model.parameters():
            p.grad = torch.zeros_like(p)
        data = batches(length, batch, 1)[0]
        inputs = [t.to(device) for t in (data.clean_tokens, data.query_tokens, data.position_ids, data.targets)]
        rss = reset_peak_rss()
        with m.window("step"):
            forward_backward(model, *inputs)
        rss = peak_rss_bytes() - rss
    return {"step_bytes": m.peaks()["step"], "rss_bytes": rss}


def training_rows(lengths: list[int], device: str) -> list[dict]:
    shapes = [(length, max(1, TRAIN_TOKENS // length)) for length in lengths]
    results = iter(in_fresh_process([(training_peak, impl, *shape, device) for shape in shapes for impl in IMPLS]))
    rows = []
    for length, batch in shapes:
        peaks = {impl: next(results) for impl in IMPLS}
        for impl, p in peaks.items():
            rows.append(
                {
                    "workload": "training",
                    "L": length,
                    "batch": batch,
                    "attention": impl,
                    **p,
                    "bytes_per_token": p["step_bytes"] / (batch * length),
                    "ratio_vs_dense": peaks["dense"]["step_bytes"] / p["step_bytes"],
                    "ratio_vs_sdpa": peaks["sdpa"]["step_bytes"] / p["step_bytes"],
                    "dense_scores_bytes_per_layer": batch * MODEL["num_heads"] * (2 * length) ** 2 * 4,
                }
            )
    return rows


# --------------------------------------------------------------------------------------------
# sampling


@dataclass
class GrowingCache:
    """The reference sampler's cache as the model's step sees it (docs/method.md, "KV cache").

    A Hugging Face DynamicCache: each layer concatenates the step's K/V onto its cache (a new
    tensor; the old one is freed once replaced), attention is eager (Qwen3's path) with an
    additive float mask built once per step, and `advance` crops to the commits by slicing, so
    the storage keeps the queries' slots until the next concatenation. Rows commit alike (the
    reference decodes one row at a time), so commit_valid is always None here.
    """

    keys: list[torch.Tensor]  # per layer [B, G, S, D]
    values: list[torch.Tensor]
    length: int = 0
    _bias: torch.Tensor | None = None

    @classmethod
    def empty(cls, model: SetDiffusionTransformer, batch_size: int) -> Self:
        cfg, p = model.config, model.embed_tokens.weight
        shape = (batch_size, cfg.num_kv_heads, 0, cfg.head_dim)
        return cls(*([p.new_empty(shape) for _ in range(cfg.num_layers)] for _ in ("keys", "values")))

    def attend(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        num_commit: int,
        commit_valid: None = None,
    ) -> torch.Tensor:
        self.keys[layer] = keys = torch.cat([self.keys[layer], k], dim=2)
        self.values[layer] = values = torch.cat([self.values[layer], v], dim=2)
        if layer == 0:
            self._num_commit = num_commit
            allowed = step_mask(num_commit, q.shape[2] - num_commit, self.length, device=q.device)
            self._bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill(
                ~allowed, torch.finfo(q.dtype).min
            )
        groups = q.shape[1] // k.shape[1]
        keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1]) + self._bias
        return scores.softmax(-1, dtype=torch.float32).to(q.dtype) @ values

    def advance(self) -> None:
        """Crop to the commits (rows commit alike)."""
        self.length += self._num_commit
        self.keys = [k[:, :, : self.length] for k in self.keys]
        self.values = [v[:, :, : self.length] for v in self.values]

    def held(self) -> tuple[int, int]:
        """(bytes, token slots) of the storage the cache keeps alive, all rows."""
        storage = sum(t.untyped_storage().nbytes() for t in self.keys + self.values)
        k = self.keys[0]
        bytes_per_slot = 2 * len(self.keys) * k[0, :, 0].numel() * k.element_size()  # K and V, all layers
        return storage, storage // bytes_per_slot


def our_cache_held(cache: KVCache) -> tuple[int, int]:
    """(bytes, token slots) of our preallocated cache, all rows."""
    return cache.keys.nbytes + cache.values.nbytes, cache.keys.shape[1] * cache.capacity


def sampling_peak(kind: str, context: int, device: str) -> dict:
    """Cache bytes held after a prefill of context - 2W tokens, and the peak of one decode step."""
    with meter(device) as m:
        torch.manual_seed(0)
        model = SetDiffusionTransformer(ModelConfig(**MODEL, max_seq_len=context)).to(device).eval()
        cached = context - 2 * WINDOW
        gen = torch.Generator().manual_seed(0)
        prompt = torch.randint(0, MODEL["mask_token_id"], (SAMPLE_BATCH, cached), generator=gen).to(device)
        commits = torch.randint(0, MODEL["mask_token_id"], (SAMPLE_BATCH, COMMITS), generator=gen).to(device)
        tokens = torch.cat([commits, torch.full((SAMPLE_BATCH, WINDOW), MODEL["mask_token_id"], device=device)], 1)
        positions = torch.arange(context, device=device).expand(SAMPLE_BATCH, -1)
        with torch.inference_mode():
            ours = kind == "ours"
            cache = model.new_cache(SAMPLE_BATCH, context) if ours else GrowingCache.empty(model, SAMPLE_BATCH)
            model.step(prompt, positions[:, :cached], cache, cached)
            held, slots = our_cache_held(cache) if ours else cache.held()
            with m.window("step"):
                logits = model.step(tokens, positions[:, cached : cached + tokens.shape[1]], cache, COMMITS)
    return {
        "cached_tokens": SAMPLE_BATCH * cached,
        "cache_bytes": held,
        "cache_slots": slots,
        "step_bytes": m.peaks()["step"],
        "logits": logits.cpu().numpy(),
    }


def sampling_rows(contexts: list[int], device: str) -> list[dict]:
    kinds = ("reference", "ours")
    results = iter(in_fresh_process([(sampling_peak, kind, context, device) for context in contexts for kind in kinds]))
    rows = []
    for context in contexts:
        ref, ours = next(results), next(results)
        torch.testing.assert_close(
            torch.from_numpy(ours.pop("logits")), torch.from_numpy(ref.pop("logits")), atol=1e-4, rtol=1e-4
        )
        for kind, p in zip(kinds, (ref, ours)):
            rows.append(
                {
                    "workload": "sampling",
                    "context": context,
                    "batch": SAMPLE_BATCH,
                    "cache": kind,
                    **p,
                    "cache_bytes_per_slot": p["cache_bytes"] / p["cache_slots"],
                    "step_bytes_per_cached_token": p["step_bytes"] / p["cached_tokens"],
                    "decode_bytes_per_cached_token": (p["cache_bytes"] + p["step_bytes"]) / p["cached_tokens"],
                }
            )
        per_token = [r["decode_bytes_per_cached_token"] for r in rows[-2:]]
        rows[-1]["ratio_vs_reference"] = per_token[0] / per_token[1]
    return rows


# --------------------------------------------------------------------------------------------
# report


def print_training(rows: list[dict]) -> None:
    print(f"\ntraining, forward + backward, {TRAIN_TOKENS} sequence tokens per batch; peak above weights and grads")
    print(
        f"{'L':>5} {'batch':>5} {'attention':>9} {'peak MiB':>9} {'KiB/token':>9} {'dense/this':>10} "
        f"{'sdpa/this':>9} {'scores/layer MiB':>16} {'RSS MiB':>8}"
    )
    for r in rows:
        print(
            f"{r['L']:>5} {r['batch']:>5} {r['attention']:>9} {r['step_bytes'] / MIB:>9.1f} "
            f"{r['bytes_per_token'] / 1024:>9.1f} {r['ratio_vs_dense']:>9.2f}x {r['ratio_vs_sdpa']:>8.2f}x "
            f"{r['dense_scores_bytes_per_layer'] / MIB:>16.1f} {r['rss_bytes'] / MIB:>8.1f}"
        )


def print_sampling(rows: list[dict]) -> None:
    print(
        f"\nsampling, one decode step ({COMMITS} commits, {WINDOW} queries) at batch {SAMPLE_BATCH} "
        f"over context - {2 * WINDOW} cached tokens; reference = growing DynamicCache + eager float mask"
    )
    print(
        f"{'context':>7} {'cache':>9} {'cache B/slot':>12} {'step B/cached':>13} {'decode B/cached':>15} "
        f"{'ref/ours':>8}"
    )
    for r in rows:
        ratio = f"{r['ratio_vs_reference']:>7.2f}x" if "ratio_vs_reference" in r else ""
        print(
            f"{r['context']:>7} {r['cache']:>9} {r['cache_bytes_per_slot']:>12.0f} "
            f"{r['step_bytes_per_cached_token']:>13.0f} {r['decode_bytes_per_cached_token']:>15.0f} {ratio:>8}"
        )


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    """Ratios >= 1: ours needs no more memory than the dense-mask baseline."""
    out = []
    for r in result["rows"]:
        if r.get("attention") == "fused":
            out += [
                (f"peak training memory per token, dense-mask / fused, L={r['L']}", r["ratio_vs_dense"], ">=", 1.0),
                (f"peak training memory per token, masked SDPA / fused, L={r['L']}", r["ratio_vs_sdpa"], ">=", 1.0),
            ]
        if "ratio_vs_reference" in r:
            out.append(
                (
                    f"peak decode memory per cached token, reference cache / ours, context {r['context']}",
                    r["ratio_vs_reference"],
                    ">=",
                    1.0,
                )
            )
    return out


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--contexts", type=int, nargs="+", default=[256, 512, 1024])
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    args = parser.parse_args(argv)
    print("machine:", machine_info())
    print(
        f"model: {MODEL}; each configuration in a fresh process; "
        f"{'torch.cuda.max_memory_allocated' if args.device == 'cuda' else 'profiler allocator events'}"
    )
    training, sampling = training_rows(args.lengths, args.device), sampling_rows(args.contexts, args.device)
    print_training(training)
    print_sampling(sampling)
    rows = training + sampling
    path = save_results("memory", {"args": vars(args), "model": MODEL, "rows": rows})
    print(f"results: {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
