"""Supervised records, padded against packed: training throughput in response tokens per second.

A padded row holds one record and pads the rest of the row (the reference's format); a packed
row holds consecutive records, each attended to, positioned and ordered as if alone, and pads only
its tail. The same step budget goes to both: rows x L tokens per step (padded: 32 rows of 64, the
study's; packed: 16 rows of 128), on the study's model (4 x 128, the torch body, a full AdamW step).
What a step is worth is its target tokens, the responses (plus EOS); the ratio of target tokens/s
packed / padded is what packing gains. Data: the built-in reasoning corpus's supervised records.

    python -m benchmarks.supervised_packing [--repeats 3]
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import torch

from benchmarks.machine import best_times, machine_info, save_results
from setdiff_megatron.core.loss import set_diffusion_loss
from setdiff_megatron.core.orders import Staggered
from setdiff_megatron.core.streams import sample_two_stream_batch
from setdiff_megatron.data.reasoning import prepare_reasoning_corpus
from setdiff_megatron.data.samples import SupervisedRows, build_datasets
from setdiff_megatron.data.supervised import RowFormat
from setdiff_megatron.data.tokenizers import load_tokenizer
from setdiff_megatron.errors import ArgumentParser
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer

LAYOUTS = {"padded": (64, 32), "packed": (128, 16)}  # layout -> (L, rows): equal tokens per step
BATCHES = 8
"""Batches of each layout measured for their mean target tokens (one of them is timed)."""


def layout_batches(corpus: Path, tokenizer, layout: str, length: int, rows: int) -> list:
    data = build_datasets(
        [corpus / "train-supervised"],
        tokenizer,
        sequence_length=length,
        cache_dir=corpus / "index",
        num_samples=(rows * BATCHES, None, 0),
        split="100,0,0",
        supervised=SupervisedRows(RowFormat(), layout),
    )["train"]
    gen = torch.Generator().manual_seed(0)
    out = []
    for b in range(BATCHES):
        samples = [data[b * rows + i] for i in range(rows)]
        stacked = {k: torch.stack([s[k] for s in samples]) for k in samples[0]}
        records = (stacked["document_ids"], stacked["position_ids"]) if "document_ids" in stacked else None
        out.append(
            sample_two_stream_batch(
                stacked["tokens"],
                Staggered(d=4),
                mask_token_id=tokenizer.mask_id,
                prompt_mask=stacked["prompt_mask"],
                pad_mask=stacked["pad_mask"],
                records=records,
                generator=gen,
            )
        )
    return out


def _records(batch) -> int:
    """Records in a batch: one per padded row; a packed row's distinct document ids."""
    if batch.document_ids is None:
        return batch.valid_len.shape[0]
    return sum(len(batch.document_ids[r, : int(n)].unique()) for r, n in enumerate(batch.valid_len))


def train_step(batch, tokenizer, length: int):
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        mask_token_id=tokenizer.mask_id,
        hidden_size=128,
        num_layers=4,
        num_heads=4,
        intermediate_size=384,
        max_seq_len=length,
        tie_embeddings=True,
    )
    model = SetDiffusionTransformer(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        logits = model(batch.clean_tokens, batch.query_tokens, batch.position_ids, batch.valid_len, batch.document_ids)
        loss = set_diffusion_loss(logits, batch.targets, batch.loss_mask, mask_token_id=tokenizer.mask_id).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()

    return step


def targets(result: dict) -> list[tuple[str, float | None, str, float]]:
    return [("supervised response tokens/s, packed vs padded rows", result["ratio"], ">=", 1.0)]


def main(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args(argv)
    print("machine:", machine_info())
    with tempfile.TemporaryDirectory() as tmp:
        corpus = prepare_reasoning_corpus(
            Path(tmp) / "reasoning", num_train=20_000, num_valid=100, progress=False
        ).directory
        tokenizer = load_tokenizer(corpus / "tokenizer")
        batches = {name: layout_batches(corpus, tokenizer, name, *shape) for name, shape in LAYOUTS.items()}
    steps = {name: train_step(batches[name][0], tokenizer, LAYOUTS[name][0]) for name in LAYOUTS}
    seconds = best_times(steps, repeats=args.repeats)
    print(
        f"{'layout':>7} {'rows x L':>9} {'records/row':>11} {'targets/step':>12} {'step s':>7} {'target tokens/s':>15}"
    )
    rows = {}
    for name, (length, count) in LAYOUTS.items():
        targets_per_step = sum(int(b.loss_mask.sum()) for b in batches[name]) / BATCHES
        per_row = sum(_records(b) for b in batches[name]) / (BATCHES * count)
        rows[name] = {
            "L": length,
            "rows": count,
            "records_per_row": per_row,
            "targets_per_step": targets_per_step,
            "step_s": seconds[name],
            "target_tokens_per_s": targets_per_step / seconds[name],
        }
        print(
            f"{name:>7} {f'{count} x {length}':>9} {per_row:>11.2f} {targets_per_step:>12.0f} "
            f"{seconds[name]:>7.3f} {rows[name]['target_tokens_per_s']:>15.0f}"
        )
    ratio = rows["packed"]["target_tokens_per_s"] / rows["padded"]["target_tokens_per_s"]
    print(f"packed / padded target tokens/s: {ratio:.2f}x")
    path = save_results("supervised_packing", {"args": vars(args), "rows": rows, "ratio": ratio})
    print(f"results: {path}")
    return {"rows": rows, "ratio": ratio}


if __name__ == "__main__":
    main()
