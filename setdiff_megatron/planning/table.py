"""The paper's recipes planned, as the markdown table in docs/scaling.md:
`python -m setdiff_megatron.planning.table [ROW ...]` prints the rows (all, or those named), each
`setdiff plan` of the recipe on H100-80GB GPUs with the tokenizer's vocabulary given, as the
tokenizers are not in the repository. tests/planning/test_plan_table.py checks rows against the
page."""

from __future__ import annotations

import sys
from pathlib import Path

from setdiff_megatron.planning.devices import DEVICES

__all__ = ["ROWS", "row"]

ROOT = Path(__file__).parents[2]
QWEN3_VOCAB, GPT2_VOCAB, BERT_VOCAB = 151936, 50258, 30522
"""Qwen3's embedding rows; GPT-2's 50,257 tokens with MASK; bert-base-uncased's, [MASK] included."""
ROWS = {
    "gsm8k-1": ("gsm8k-qwen3-1.7b.yaml", 1, QWEN3_VOCAB, ("parallel.tp=1", "parallel.sequence_parallel=false")),
    "gsm8k-8": ("gsm8k-qwen3-1.7b.yaml", 8, QWEN3_VOCAB, ()),
    "gsm8k-8-zero2": (
        "gsm8k-qwen3-1.7b.yaml",
        8,
        QWEN3_VOCAB,
        (
            "engine=deepspeed",
            "parallel.zero_stage=2",
            "parallel.tp=1",
            "parallel.sequence_parallel=false",
            "parallel.distributed_optimizer=false",
            "parallel.micro_batch_size=2",
        ),
    ),
    "owt-8": ("owt-110m.yaml", 8, GPT2_VOCAB, ()),
    "lm1b-1": ("lm1b.yaml", 1, BERT_VOCAB, ()),
    "sdar-64": ("sdar-30b-a3b-shaped.yaml", 64, QWEN3_VOCAB, ()),
    "sdar-64-tp2": ("sdar-30b-a3b-shaped.yaml", 64, QWEN3_VOCAB, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    "sdar-64-tp2-full": (
        "sdar-30b-a3b-shaped.yaml",
        64,
        QWEN3_VOCAB,
        ("parallel.tp=2", "parallel.sequence_parallel=true", "train.recompute=full"),
    ),
}
HEADER = (
    "| row | recipe (overrides) | GPUs | layout | parameters per GPU | peak GiB | fits 80 GiB (10 % margin) "
    "| tokens/s at most | MFU at most |\n|---|---|---|---|---|---|---|---|---|"
)


def row(name: str) -> str:
    from setdiff_megatron.planning.plan import GIB, plan_recipe
    from setdiff_megatron.planning.plan_cli import plan_model_config
    from setdiff_megatron.recipes.recipe_files import load_recipe

    file, gpus, vocab, overrides = ROWS[name]
    recipe = load_recipe(ROOT / "recipes" / file, overrides)
    plan = plan_recipe(recipe, plan_model_config(recipe, vocab), gpus, DEVICES["h100-80gb"])
    per_gpu = max(s.num_params for s in plan.stages)
    label = file.removesuffix(".yaml") + (f" ({' '.join(overrides)})" if overrides else "")
    return (
        f"| {name} | {label} | {gpus} | {plan.layout} | {per_gpu / 1e9:.2f} B | {plan.peak / GIB:.1f} | "
        f"{'yes' if plan.fits else 'no'} | {plan.tokens_per_second:,.0f} | {plan.mfu_bound:.0%} |"
    )


def main(names: list[str]) -> int:
    from setdiff_megatron.distributed.megatron_cpu import prepare_megatron_import

    prepare_megatron_import()
    print(HEADER)
    for name in names or list(ROWS):
        print(row(name), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
