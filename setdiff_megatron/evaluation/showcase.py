"""What a finished run on a built-in corpus shows a person: a completion of a held-out prompt.

`setdiff train` ends with it, so the main job ends with something one can judge rather than a
loss: the reasoning corpus shows a held-out problem, the model's worked solution and the test
accuracy over a few dozen problems, against the same model decoding one token per step left to
right (W = 1) and against the trivial baseline (every problem given the most common answer),
over `eval.showcase_problems` held-out problems (250 by default: +-3 points where 50 gave +-7);
the stdlib corpus shows the continuation of a held-out function signature. Both decode with the
model's own policy, as every other entry point does (Source.decoding: the paper's default for the run's
order, a window of d queries and a threshold of 0.9, one token per step for AR, with the recipe's
`decoding` over it), and report tokens per step.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict, replace
from pathlib import Path

from setdiff_megatron.data.answers import gsm8k_answer
from setdiff_megatron.data.builtin import builtin_corpus_dir
from setdiff_megatron.distributed.runtime import Ranks
from setdiff_megatron.evaluation.tasks import score_completion
from setdiff_megatron.inference.prompts import PromptRecord, encode_prompt
from setdiff_megatron.inference.sampling_model import load_sampling_model
from setdiff_megatron.recipes import Recipe
from setdiff_megatron.recipes.decoding_settings import with_stops
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sources.read import read_source

__all__ = ["showcase", "RESULT"]

SHOWN = 1
"""The one shown: the first problem of three operations on one-digit numbers."""
RESULT = "logs/showcase.json"
"""Where, under the run directory, the showcase records its sample, accuracy and decoding policy."""


def _prompts(recipe: Recipe) -> tuple[str, list[dict]] | None:
    """(corpus name, held-out {"prompt", "reference"?} records) of a run on a built-in corpus."""
    from setdiff_megatron.recipe_data import data_dir

    names = [d.path for d in recipe.data.datasets]
    if names == ["reasoning"]:
        from setdiff_megatron.data.reasoning import TRAIN_LEVELS

        tasks = builtin_corpus_dir("reasoning", data_dir(recipe), recipe.data.vocab_size) / "tasks"
        by_level = [(tasks / f"test-{lv.name}.jsonl").read_text(encoding="utf-8").splitlines() for lv in TRAIN_LEVELS]
        interleaved = [line for group in zip(*by_level) for line in group]  # every level in equal shares
        return "reasoning", [json.loads(line) for line in interleaved[: max(recipe.eval.showcase_problems, SHOWN + 1)]]
    if names == ["stdlib"]:
        from setdiff_megatron.evaluation.infilling import code_examples

        return "stdlib", [{"prompt": code_examples(1)[0].left}]
    return None


def _policy_words(cfg: DecodingConfig) -> str:
    return (
        f"window {cfg.window}"
        + (f", threshold {cfg.threshold}" if cfg.threshold else "")
        + (f", blocks of {cfg.block_size}" if cfg.block_size else "")
    )


def showcase(recipe: Recipe) -> list[str]:
    """Lines to print after training (none for a run on preprocessed datasets of its own); what
    they say is also written to <run>/logs/showcase.json (RESULT), for scripts and tests."""
    found = _prompts(recipe)
    if found is None:
        return []
    corpus, records = found
    sm = load_sampling_model(recipe.checkpoint.dir, Ranks(), device="cpu")
    ids = [
        encode_prompt(PromptRecord(i, i + 1, (r["prompt"],), {}), sm.tokenizer, sm.prompt_format())
        for i, r in enumerate(records)
    ]
    # Within the context after the longest prompt: MDLM's and BD3-LM's decoders never run past it.
    room = sm.config.max_seq_len - max(map(len, ids))
    cfg = with_stops(
        sm.decoding.with_settings({"max_new_tokens": min(52 if corpus == "reasoning" else 48, room)}), sm.tokenizer
    )
    sampler = sm.sampler()
    out = sampler.generate(ids, cfg, batch_size=16)
    texts = [sm.tokenizer.decode(row.completion, skip_special_tokens=True) for row in out.rows]
    policy = _policy_words(cfg)
    shown = min(SHOWN, len(records) - 1)
    row = out.rows[shown]
    result: dict = {
        "decoding": asdict(cfg),
        "sample": {
            "prompt": records[shown]["prompt"],
            "completion": texts[shown],
            "tokens": row.num_decoded,
            "steps": row.steps,
            "tokens_per_step": row.tokens_per_step,
        },
    }
    lines = [f"{recipe.name}: {recipe.description}"] if recipe.description else []
    if recipe.model.init_from:
        start = read_source(recipe.model.init_from, weights=False)
        lines.append(
            f"  its initial weights: {start.describe()} ({start.config.num_layers} x {start.config.hidden_size})"
        )
    lines += [
        f"sample of a held-out prompt ({policy}):",
        *(f"  {line}" for line in (records[shown]["prompt"] + texts[shown]).splitlines()),
        f"decoding: {row.num_decoded} tokens in {row.steps} steps, {row.tokens_per_step:.2f} tokens "
        f"per step ({policy}, greedy)",
    ]
    if corpus == "reasoning" and recipe.eval.showcase_problems:

        def accuracy(completions: list[str]) -> float:
            return sum(
                score_completion("gsm8k", t, [r["reference"]])["accuracy"] for t, r in zip(completions, records)
            ) / len(records)

        answers = Counter(gsm8k_answer(r["reference"]) for r in records)
        result |= {
            "problems": len(records),
            "accuracy": accuracy(texts),
            "tokens_per_step": out.metrics.tokens_per_step,
            "trivial_accuracy": answers.most_common(1)[0][1] / len(records),
        }
        lines.append(
            f"held-out accuracy on {len(records)} test problems (#### answer): {result['accuracy']:.0%} at "
            f"{result['tokens_per_step']:.2f} tokens per step ({policy})"
        )
        # Set diffusion one token per step is left to right (window 1); a baseline keeps its blocks.
        slow, how = (
            (replace(cfg, window=1, threshold=None, block_size=None), "window 1")
            if sm.family == "set_diffusion"
            else (replace(cfg, threshold=None, tokens_per_step=1), "no threshold")
        )
        if slow != cfg:
            one = sampler.generate(ids, slow, batch_size=16)
            one_texts = [sm.tokenizer.decode(row.completion, skip_special_tokens=True) for row in one.rows]
            result["one_token_per_step_accuracy"] = accuracy(one_texts)
            lines.append(f"  the same model one token per step ({how}): {result['one_token_per_step_accuracy']:.0%}")
        lines.append(
            f"  trivial baseline (every problem given the most common answer): {result['trivial_accuracy']:.0%}; "
            "setdiff eval generate measures more"
        )
    path = Path(recipe.checkpoint.dir) / RESULT
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return lines
