"""Quality metrics of generated text: exact match and ROUGE-1/2/L (GSM8K answers: data/answers.py).

ROUGE is Google's `rouge-score` (F-measure, Porter stemming, as the summarisation and infilling
papers report it); its tokenizer keeps ASCII letters and digits only, so text in other scripts
scores through exact match instead.
"""

from __future__ import annotations

from functools import lru_cache

from setdiff_megatron.errors import require

__all__ = ["ROUGE_KEYS", "rouge", "exact_match"]

ROUGE_KEYS = ("rouge1", "rouge2", "rougeL")


@lru_cache(maxsize=1)
def _scorer():
    rouge_scorer = require("rouge_score.rouge_scorer", "eval", "ROUGE scoring")
    return rouge_scorer.RougeScorer(list(ROUGE_KEYS), use_stemmer=True)


def rouge(prediction: str, reference: str) -> dict[str, float]:
    """ROUGE-1/2/L F-measures of one prediction against one reference."""
    scores = _scorer().score(reference, prediction)
    return {key: scores[key].fmeasure for key in ROUGE_KEYS}


def normalize(text: str) -> str:
    return " ".join(text.split())


def exact_match(prediction: str, reference: str) -> float:
    """1.0 when both texts are equal up to whitespace runs, else 0.0."""
    return float(normalize(prediction) == normalize(reference))
