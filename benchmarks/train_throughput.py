"""Training throughput: our set-causal step against the dense-mask two-stream formulation.

The reference trains the two streams with an explicit [2L, 2L] mask: eager attention on its
Qwen3 path, masked SDPA on its LM1B path, every layer over both streams. Both are measured here
(`ReferenceForm`) on the same model, weights and batches as ours (the fused one-kernel set-causal
attention, and a last layer that computes the query rows only), in one process, as tokens/s of a
full optimizer step (forward, backward, AdamW). The row 'free' is our model with attention at no
cost (it returns its queries): the ceiling of any attention kernel for this model and length. The megatron body (TP = 1, local layers, megatron
DDP and optimizer, one micro-batch through the pipeline schedule) is measured with the fused
attention too. Target: ours >= 2x the dense-mask baseline.

    python -m benchmarks.train_throughput [--steps 4]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.machine import best_times, machine_info, save_results
from setdiff_megatron.core.orders import Staggered
from setdiff_megatron.core.streams import sample_two_stream_batch
from setdiff_megatron.errors import ArgumentParser
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer

SHAPES = [(256, 8), (512, 4)]  # (L, batch)
MODEL = dict(hidden_size=256, num_layers=4, num_heads=4, vocab_size=4097, mask_token_id=4096)


def _free_attention(q, k, v, scale, valid_len):
    """Attention at no cost, for the ceiling row: the output is the queries themselves."""
    return q


def batches(length: int, batch: int, count: int) -> list:
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 4096, (count, batch, length), generator=gen)
    return [sample_two_stream_batch(t, Staggered(d=4), mask_token_id=4096, generator=gen) for t in tokens]


class ReferenceForm(SetDiffusionTransformer):
    """The baseline's formulation: every layer, the last included, runs over both streams."""

    def forward(
        self,
        clean_tokens: torch.Tensor,
        query_tokens: torch.Tensor,
        position_ids: torch.Tensor,
        valid_len: torch.Tensor | None = None,
    ) -> torch.Tensor:
        hidden = self.hidden_states(clean_tokens, query_tokens, position_ids, valid_len, clean_rows=True)
        return self.output_logits(hidden[:, clean_tokens.shape[1] :])


def build_model(impl: str, length: int) -> SetDiffusionTransformer:
    """Ours for 'fused' ('free': with attention at no cost); the reference's formulation for the
    dense-mask baselines."""
    torch.manual_seed(0)
    if impl in ("dense", "sdpa"):
        return ReferenceForm(ModelConfig(**MODEL, max_seq_len=length, attention_impl=impl))
    model = SetDiffusionTransformer(ModelConfig(**MODEL, max_seq_len=length, attention_impl="fused"))
    if impl == "free":
        model._attention = _free_attention
    return model


def torch_step(impl: str, length: int, batch: int, compile_model: bool = False):
    """A closure running one optimizer step of the torch model on a fixed batch."""
    model = build_model(impl, length)
    if compile_model:
        model.compile()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = batches(length, batch, 1)[0]

    def step():
        logits = model(data.clean_tokens, data.query_tokens, data.position_ids)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), data.targets.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def megatron_train_step(length: int, batch: int):
    """A closure running one optimizer step of the megatron body (one process, TP = PP = 1)."""
    from benchmarks.megatron_step import megatron_step

    recipe = {
        "model": {k: v for k, v in MODEL.items() if k not in ("vocab_size", "mask_token_id")} | {"max_seq_len": length},
        "data": {"seq_len": length},
        "train": {"precision": "fp32", "steps": 10, "warmup_steps": 0},
        "parallel": {"micro_batch_size": batch, "global_batch_size": batch},
    }
    step, _ = megatron_step(
        recipe, vocab_size=MODEL["vocab_size"], mask_token_id=MODEL["mask_token_id"], batches=batches(length, batch, 1)
    )
    return step


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    return [
        (f"training tokens/s vs dense-mask two-stream, {r['body']} L={r['L']}", r["ratio_vs_dense"], ">=", 2.0)
        for r in result["rows"]
        if r["attention"] == "fused"
    ]


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-megatron", action="store_true", help="skip the megatron body")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile every torch model, baselines included (minutes of compilation)",
    )
    args = parser.parse_args(argv)
    print("machine:", machine_info())
    compiled = ", torch models compiled" if args.compile else ""
    print(
        f"model: {MODEL}; full AdamW step, best of {args.repeats}{compiled}; "
        "tokens/s counts sequence tokens (L per example)"
    )
    header = f"{'L':>5} {'batch':>5} {'body':>9} {'attention':>10} {'tokens/s':>10} {'vs dense':>9} {'vs sdpa':>8}"
    print(header)
    rows = []
    for length, batch in SHAPES:
        tokens = length * batch
        steps = {
            ("torch", impl): torch_step(impl, length, batch, args.compile)
            for impl in ("dense", "sdpa", "fused", "free")
        }
        if not args.no_megatron:
            steps[("megatron", "fused")] = megatron_train_step(length, batch)
        measured = best_times(steps, repeats=args.repeats)
        dense, sdpa = measured[("torch", "dense")], measured[("torch", "sdpa")]
        for (body, impl), seconds in measured.items():
            row = {
                "L": length,
                "batch": batch,
                "body": body,
                "attention": impl,
                "tokens_per_s": tokens / seconds,
                "ratio_vs_dense": dense / seconds,
                "ratio_vs_sdpa": sdpa / seconds,
            }
            rows.append(row)
            print(
                f"{length:>5} {batch:>5} {body:>9} {impl:>10} {row['tokens_per_s']:>10.0f} "
                f"{row['ratio_vs_dense']:>8.2f}x {row['ratio_vs_sdpa']:>7.2f}x"
            )
    name = "train_throughput_compiled" if args.compile else "train_throughput"
    path = save_results(name, {"args": vars(args), "model": MODEL, "rows": rows})
    print(f"results: {path}")
    return {"rows": rows}


if __name__ == "__main__":
    main()
