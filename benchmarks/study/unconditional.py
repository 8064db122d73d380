"""The unconditional setting (`--setting unconditional`): claim 1 on unconditional generation.

Each model, pretrained on packed windows of the reasoning corpus (recipes/study/packed/), samples
documents from an empty prompt at several decoding points (temperature 1, each sample its own
seed). As the paper's protocol does, two figures judge them: the generative perplexity of the
samples under a judge AR model trained four times as long on the same corpus (JUDGE:
packed/ar-judge.yaml; the paper's judge is GPT-2 Large), and the samples' unigram entropy, which
falls where a model repeats itself and would otherwise buy a low perplexity. The corpus's tokens
are characters, so the entropy is over characters (nats). A sample ends at its first EOS (one
document, as the judge reads documents); an empty one is counted and left out of both figures.
"""

from __future__ import annotations

import json
import math
from collections import Counter
from pathlib import Path

from benchmarks.study.plan import Model, threshold_name
from benchmarks.study.run import PLACEMENT, invocation_of, run_dir, train
from setdiff_megatron.evaluation.likelihood import LikelihoodJob, run_likelihood_job
from setdiff_megatron.evaluation.tasks import decode_speed
from setdiff_megatron.inference.job import SampleJob, run_sample_job

JUDGE = Model("ar-judge", "ar", "AR judge (7,000 steps)", setting="packed")
"""Trained once (the recipe's seed), before any model is judged."""
SAMPLES = 128
"""Samples per decoding point (--samples): the judge's perplexity over about 2,000 characters."""
NEW_TOKENS = 63
"""A sample's most tokens: the models' 64 positions less the prompt's BOS."""
TEMPERATURE = 1.0
"""Sampling from the model's distribution, as the paper samples unconditionally."""
SAMPLING = "temperature 1; sample i of a point seeded with the run's training seed + i"
WINDOWS, THRESHOLDS = (4, 8), (0.9, 0.7, 0.5)
"""Set diffusion's parallel points (beside W = 1, one token per step)."""
BASELINE_THRESHOLDS = (None, 0.9, 0.7, 0.5)
"""MDLM's (one block of 32) and BD3-LM's (its blocks) points; None: one token per step."""


def points(model: Model) -> list[dict]:
    """The decoding points of `model`: name and decoding settings over temperature 1."""
    if model.family == "ar":
        return [{"point": "ar", "window": 1}]
    if model.family in ("mdlm", "bd3lm"):
        block = model.decoding_defaults()["block_size"]
        return [
            {"point": f"b{block}-t{threshold_name(t)}", "block_size": block, "threshold": t}
            for t in BASELINE_THRESHOLDS
        ]
    parallel = [{"point": f"w{w}-t{t:g}", "window": w, "threshold": t} for w in WINDOWS for t in THRESHOLDS]
    return [{"point": "w1", "window": 1}, *parallel]


def unigram_entropy(text: str) -> float:
    """The entropy (nats) of a sample's characters, counted as a unigram distribution."""
    counts, total = Counter(text), len(text)
    return -sum(c / total * math.log(c / total) for c in counts.values())


def _generate(out: Path, model: Model, point: dict, samples: int) -> Path:
    """The point's samples (a `setdiff sample` job; rerun: skipped where written)."""
    prompts = out / "tasks" / f"empty-{samples}.jsonl"
    prompts.parent.mkdir(parents=True, exist_ok=True)
    prompts.write_text('{"prompt": ""}\n' * samples, encoding="utf-8")
    # Per sample count: a rerun with another --samples writes beside the first, never into it.
    path = out / "eval" / model.key / f"unconditional-{samples}" / point["point"] / "samples.jsonl"
    decoding = {k: v for k, v in point.items() if k != "point"}
    decoding |= {"temperature": TEMPERATURE, "max_new_tokens": NEW_TOKENS, "seed": model.seed or 0}
    decoding.setdefault("threshold", None)
    run_sample_job(
        SampleJob(
            source=str(run_dir(out, model)), prompts=str(prompts), out=str(path), decoding=decoding, placement=PLACEMENT
        )
    )
    return path


def _judged(out: Path, samples: Path, texts: list[str]) -> dict:
    """The judge's NLL per token of the samples (each a document), exact left to right."""
    docs = samples.with_name("judge-docs.jsonl")
    docs.parent.mkdir(parents=True, exist_ok=True)
    docs.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")
    job = LikelihoodJob(
        source=str(run_dir(out, JUDGE)),
        data=str(docs),
        out=str(samples.with_name("judge")),
        order="left_to_right",
        num_orders=1,
        placement=PLACEMENT,
    )
    return run_likelihood_job(job)


def reference(out: Path, docs: Path, samples: int, steps: int | None) -> dict:
    """The same figures for `samples` held-out documents of the corpus (the test problems, each a
    document as the models were pretrained on them): what real text scores under the judge."""
    train(out, JUDGE, steps)
    texts = [json.loads(line)["text"] for line in docs.read_text(encoding="utf-8").splitlines()[:samples]]
    judged = _judged(out, out / "eval" / JUDGE.key / f"reference-{samples}" / "samples.jsonl", texts)
    return {
        "documents": len(texts),
        "judge_nll": judged["nll_per_token"],
        "judge_perplexity": judged["perplexity"],
        "entropy": sum(map(unigram_entropy, texts)) / len(texts),
        "mean_length": sum(map(len, texts)) / len(texts),
    }


def generation(out: Path, model: Model, samples: int) -> list[dict]:
    """Every decoding point of `model`: the judge's perplexity, the unigram entropy and speeds
    (the judge trained by `reference`, which the setting computes first)."""
    results = []
    for point in points(model):
        path = _generate(out, model, point, samples)
        rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
        texts = [r["completion"] for r in rows if r["completion"]]
        judged = _judged(out, path, texts) if texts else None
        entropies = [unigram_entropy(t) for t in texts]
        speed = decode_speed(rows)
        results.append(
            point
            | {
                "samples": len(rows),
                "empty": len(rows) - len(texts),
                "judge_nll": judged["nll_per_token"] if judged else None,
                "judge_perplexity": judged["perplexity"] if judged else None,
                "entropy": sum(entropies) / len(entropies) if entropies else None,
                "mean_length": sum(map(len, texts)) / len(texts) if texts else 0.0,
                "tokens_per_step": speed["tokens_per_step"],
                "tokens_per_s": speed["tokens_per_s"],
                "mean_nfe": speed["mean_nfe"],
                "invocation": invocation_of(out, path),
            }
        )
    return results
