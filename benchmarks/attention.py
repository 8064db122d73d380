"""Set-causal attention, forward + backward: the fused decomposition against dense-masked SDPA.

The baseline is what the reference implementation does: scaled_dot_product_attention over the
2L tokens with a [2L, 2L] boolean mask. Ours is one causal kernel call over L with the query
heads stacked (KERNELS.md 3). Both run in the same process on the same inputs; the figure of
merit is the ratio. Target: >= 3x at L = 1024 on the CPU.

    python -m benchmarks.attention [--lengths 256 1024 2048] [--batch 4 --heads 8 --head-dim 64]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.machine import best_time, machine_info, save_results
from setdiff_megatron.core.attention import set_causal_attention


def fwd_bwd_seconds(impl: str, length: int, args: argparse.Namespace) -> float:
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, 2 * length, args.head_dim)
    kv_shape = (args.batch, args.kv_heads or args.heads, 2 * length, args.head_dim)
    q = torch.randn(shape, generator=gen, requires_grad=True)
    k = torch.randn(kv_shape, generator=gen, requires_grad=True)
    v = torch.randn(kv_shape, generator=gen, requires_grad=True)
    dout = torch.randn(shape, generator=gen)

    def run():
        out = set_causal_attention(q, k, v, impl=impl)
        torch.autograd.grad(out, (q, k, v), dout)

    return best_time(run, repeats=args.repeats)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--kv-heads", type=int, default=None)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)

    print("machine:", machine_info())
    print(f"shape: batch {args.batch}, heads {args.heads}, kv heads {args.kv_heads or args.heads}, "
          f"head dim {args.head_dim}; forward + backward, best of {args.repeats}")
    print(f"{'L':>6} {'sdpa masked (s)':>16} {'fused (s)':>10} {'ratio':>7}")
    rows = []
    for length in args.lengths:
        baseline = fwd_bwd_seconds("sdpa", length, args)
        ours = fwd_bwd_seconds("fused", length, args)
        rows.append({"L": length, "sdpa_masked_s": baseline, "fused_s": ours, "ratio": baseline / ours})
        print(f"{length:>6} {baseline:>16.4f} {ours:>10.4f} {baseline / ours:>6.2f}x")
    path = save_results("attention", {"args": vars(args), "rows": rows})
    print(f"results: {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
