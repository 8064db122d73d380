"""Two-rank worker (torchrun, gloo, CPU) for test_ring_attention.py: set-causal ring attention at
context parallelism 2 against the single-rank attention of the whole sequence. Every rank builds
the same full q/k/v and output gradient from a seed, runs the reference on all of it, then ring
attention on its zigzag slice; the differences of outputs and dq/dk/dv on its rows are gathered
and rank 0 writes the largest as JSON."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist

from setdiff_megatron.core.attention import set_causal_attention
from setdiff_megatron.core.merged_attention import ATEN_FLASH
from setdiff_megatron.kernels.flash_attn import FlashAttnKernel
from setdiff_megatron.kernels.ring_attention import ring_set_causal_attention, zigzag_ranks
from setdiff_megatron.kernels.te_fused import TEFusedKernel
from tests.kernels import emulation
from tests.models.megatron_cases import write_worker_results

KERNELS = {
    "te": lambda: TEFusedKernel(emulation.te_api()),
    "flash_attn": lambda: FlashAttnKernel(emulation.flash_api()),
}
"""The GPU kernels' adapters on their strict emulation (bf16, as the real kernels take)."""
CASES = {
    # name: (dtype, B, H, G, L, valid lengths or None, query rows only, documents)
    "fp32_gqa_padding": (torch.float32, 2, 4, 2, 24, [24, 17], False, False),
    "fp32_odd_chunks_mha": (torch.float32, 1, 2, 2, 12, None, False, False),  # chunks of 3 ranks
    "fp32_query_rows_only": (torch.float32, 2, 4, 1, 20, [20, 9], True, False),
    "fp64_gqa_padding": (torch.float64, 2, 4, 2, 24, [24, 5], False, False),
    "fp32_documents": (torch.float32, 2, 4, 2, 24, [24, 19], False, True),
    "fp64_documents_query_rows_only": (torch.float64, 2, 4, 2, 24, None, True, True),
    "te_gqa_padding": (torch.bfloat16, 2, 4, 2, 24, [24, 17], False, False),
    "te_query_rows_only": (torch.bfloat16, 2, 4, 1, 20, [20, 9], True, False),
    "flash_attn_gqa_padding": (torch.bfloat16, 2, 4, 2, 24, [24, 17], False, False),
    "flash_attn_query_rows_only": (torch.bfloat16, 2, 4, 1, 20, [20, 9], True, False),
}


def local_rows(x: torch.Tensor, length: int, rows: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a [B, heads, S, D] tensor over one or both streams."""
    streams = x.shape[2] // length
    index = torch.cat([rows + s * length for s in range(streams)])
    return x[:, :, index]


def documents(b: int, length: int, gen: torch.Generator) -> torch.Tensor:
    """[B, L] document ids in rank order: 3 documents per window, scattered over the ranks as a
    sampled order scatters them."""
    return torch.stack([torch.randint(0, 3, (length,), generator=gen) for _ in range(b)])


def run_case(name, dtype, b, h, g, length, valid, query_only, with_documents) -> dict:
    gen = torch.Generator().manual_seed(0)
    d, scale = 8, 8**-0.5
    kernel = next((make() for prefix, make in KERNELS.items() if name.startswith(prefix)), ATEN_FLASH)
    q = torch.randn(b, h, length if query_only else 2 * length, d, generator=gen, dtype=dtype)
    k, v = (torch.randn(b, g, 2 * length, d, generator=gen, dtype=dtype) for _ in range(2))
    valid_len = None if valid is None else torch.tensor(valid)
    docs = documents(b, length, gen) if with_documents else None
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    exact = torch.promote_types(dtype, torch.float32)  # the reference of bf16 inputs in fp32
    ref = set_causal_attention(
        *(t.to(exact) for t in (q, k, v)), impl="dense", valid_len=valid_len, scale=scale, document_ids=docs
    )
    dout = torch.randn(ref.shape, generator=gen, dtype=dtype)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout.to(exact))

    cp, rank = dist.get_world_size(), dist.get_rank()
    rows = zigzag_ranks(length, cp, rank)
    mine = [local_rows(t.detach(), length, rows).requires_grad_() for t in (q, k, v)]
    out = ring_set_causal_attention(
        *mine, scale=scale, group=dist.group.WORLD, valid_len=valid_len, document_ids=docs, kernel=kernel
    )
    grads = torch.autograd.grad(out, mine, local_rows(dout, length, rows))
    # bf16 results are compared relative to the reference's largest entry (one bf16 step is 2^-8 of it)
    unit = (lambda r: r.abs().max()) if dtype == torch.bfloat16 else (lambda r: 1.0)
    diffs = [(out.double() - local_rows(ref.detach(), length, rows)).abs().max() / unit(ref.detach())]
    diffs += [(a.double() - local_rows(r, length, rows)).abs().max() / unit(r) for a, r in zip(grads, ref_grads)]
    diffs = torch.stack(diffs).double()
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    return dict(zip(["out", "dq", "dk", "dv"], diffs.tolist()))


def main(out: Path) -> None:
    dist.init_process_group("gloo")
    write_worker_results(out, {name: run_case(name, *case) for name, case in CASES.items()})


if __name__ == "__main__":
    main(Path(sys.argv[1]))
