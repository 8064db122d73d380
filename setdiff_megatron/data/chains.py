"""A built-in infilling corpus: running sums whose masked line only the right side gives away.

A chain is the worked solution of a reasoning-corpus problem over + and - alone (reasoning.py),
without its expression line, so that every line starts from the result of the line above. The
infill task masks one line after the first: the right side decides it (`right_context_fill`),
the left side leaves it open (`LeftOnlyRule` is the best a left-only guess can do), and
`rule_baselines` measures both. No test or valid problem occurs in the training split. The task
and its baselines: docs/study.md ("The infill task").
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from setdiff_megatron.data.preprocess import TOKENIZER_SUBDIR, PreprocessOptions, preprocess
from setdiff_megatron.data.reasoning import (
    TRAIN_LEVELS,
    Level,
    Problem,
    ReasoningCorpus,
    char_tokenizer,
    problems,
    write_jsonl,
)

__all__ = [
    "CHAIN_LEVELS",
    "chain_problems",
    "infill_record",
    "right_context_fill",
    "LeftOnlyRule",
    "rule_baselines",
    "prepare_chains_corpus",
]

FORMAT_VERSION = 1
_RECORD_FILE = "corpus.json"
CHAIN_LEVELS = TRAIN_LEVELS
"""The reasoning corpus's difficulties (2-4 operations on one digit, 2-3 on two), + and - only."""
_STEP = re.compile(r"^(\d+)([+-])(\d+)=(\d+)$")


def chain_problems(seed: int, level: Level, exclude: frozenset[str] = frozenset()) -> Iterator[Problem]:
    """Distinct problems of `level` over + and -, none in `exclude`, without end; their
    solutions are the chains."""
    return problems(seed, [level], 2**62, exclude, operators="+-")


def _maskable(lines: list[str]) -> list[int]:
    """The lines of a chain the task may mask: after the first, before the answer, second operand
    not 0 (where +0 and -0 both fit, so the right side would not decide the line)."""
    return [k for k in range(1, len(lines) - 1) if int(_STEP.match(lines[k]).group(3)) != 0]


def infill_record(problem: Problem, rng: random.Random) -> dict | None:
    """The chain of `problem` with one maskable line as the span; None if it has none."""
    lines = problem.solution.split("\n")
    candidates = _maskable(lines)
    if not candidates:
        return None
    k = rng.choice(candidates)
    return {
        "id": problem.expression,
        "left": "\n".join(lines[:k]) + "\n",
        "middle": lines[k],
        "right": "\n" + "\n".join(lines[k + 1 :]),
        "level": problem.level.name,
        "line": k,
    }


def right_context_fill(left: str, right: str) -> str:
    """The masked line from the result above it and the number below it: its first operand is the
    result above (the left side), its result the first operand of the line below or the final
    answer (the right side), and its operator and second operand follow from those two."""
    start = int(left.rstrip("\n").rsplit("\n", 1)[-1].rsplit("=", 1)[1])
    below = right.lstrip("\n").split("\n", 1)[0]
    result = int(below.removeprefix("#### ")) if below.startswith("#### ") else int(_STEP.match(below).group(1))
    return f"{start}{'+' if result >= start else '-'}{abs(result - start)}={result}"


def _left_facts(left: str, span: int) -> tuple[int, int, int, int]:
    """What the left side and the span's length tell about the masked line: how many lines come
    before it, the result above it, the operands' digits (the first operand's length), the span's
    length. Given these, the line does not depend on the rest of the left side (the generator
    draws each step from the running result, the level and the steps still to come)."""
    lines = left.rstrip("\n").split("\n")
    return len(lines), int(lines[-1].rsplit("=", 1)[1]), len(_STEP.match(lines[0]).group(1)), span


@dataclass(frozen=True)
class LeftOnlyRule:
    """The best guess from the left side: for each left-side fact (`_left_facts`), the most
    common masked line among training chains with that fact."""

    guesses: dict[tuple[int, int, int, int], str]

    @classmethod
    def fit(cls, chains: Iterable[str]) -> LeftOnlyRule:
        counts: dict[tuple[int, int, int, int], Counter] = defaultdict(Counter)
        for chain in chains:
            lines = chain.split("\n")
            for k in _maskable(lines):
                counts[_left_facts("\n".join(lines[:k]), len(lines[k]))][lines[k]] += 1
        return cls({facts: c.most_common(1)[0][0] for facts, c in counts.items()})

    def fill(self, left: str, span: int) -> str | None:
        return self.guesses.get(_left_facts(left, span))


def rule_baselines(train_chains: Iterable[str], records: list[dict]) -> dict:
    """Exact match of three rules on infill records: the trivial baseline (the records' most
    common line, given to every one), the best left-only guess (LeftOnlyRule fitted on
    `train_chains`) and the right-context rule; overall and per level."""
    rule = LeftOnlyRule.fit(train_chains)
    common = Counter(r["middle"] for r in records).most_common(1)[0][0]
    hits: dict[str, dict[str, list[bool]]] = defaultdict(lambda: defaultdict(list))
    for r in records:
        for level in ("all", r["level"]):
            hits[level]["trivial"].append(r["middle"] == common)
            hits[level]["left_only"].append(rule.fill(r["left"], len(r["middle"])) == r["middle"])
            hits[level]["right_context"].append(right_context_fill(r["left"], r["right"]) == r["middle"])
    rates = {level: {k: sum(v) / len(v) for k, v in by.items()} for level, by in hits.items()}
    return rates.pop("all") | {"examples": len(records), "by_level": rates}


def prepare_chains_corpus(
    out_dir: str | Path,
    *,
    num_train: int = 200_000,
    num_valid: int = 2_000,
    num_infill: int = 1_000,
    seed: int = 0,
    workers: int = 1,
    progress: bool = True,
) -> ReasoningCorpus:
    """Generate the chains, their tokenizer, indexed datasets and infill task, deterministically by
    seed: `raw/{train,valid}.jsonl` documents and their indexed datasets, and
    `tasks/infill-test.jsonl` ({"left", "middle", "right", "level", "line"}, the levels in turn).
    A rerun with the same arguments finds everything in place."""
    out_dir = Path(out_dir)
    record = {
        "format": FORMAT_VERSION,
        "num_train": num_train,
        "num_valid": num_valid,
        "num_infill": num_infill,
        "seed": seed,
        "levels": [asdict(lv) for lv in CHAIN_LEVELS],
    }
    corpus = ReasoningCorpus(
        out_dir, out_dir / TOKENIZER_SUBDIR, out_dir / "train", out_dir / "valid", out_dir / "tasks"
    )
    record_path = out_dir / _RECORD_FILE
    if not (record_path.is_file() and json.loads(record_path.read_text(encoding="utf-8")) == record):
        held: set[str] = set()
        rng, per_level = random.Random(seed * 1000 + 600), []
        for i, level in enumerate(CHAIN_LEVELS):
            found = []
            for p in chain_problems(seed * 1000 + 601 + i, level, frozenset(held)):
                if (r := infill_record(p, rng)) is not None:
                    found.append(r)
                    held.add(p.expression)
                if len(found) == -(-num_infill // len(CHAIN_LEVELS)):
                    break
            per_level.append(found)
        write_jsonl(corpus.infill_tasks, iter([r for group in zip(*per_level) for r in group][:num_infill]))
        valid = list(problems(seed * 1000 + 602, CHAIN_LEVELS, num_valid, frozenset(held), operators="+-"))
        held |= {p.expression for p in valid}
        write_jsonl(out_dir / "raw" / "valid.jsonl", ({"text": p.solution} for p in valid))
        train = problems(seed * 1000 + 603, CHAIN_LEVELS, num_train, frozenset(held), distinct=False, operators="+-")
        write_jsonl(out_dir / "raw" / "train.jsonl", ({"text": p.solution} for p in train))
        record_path.parent.mkdir(parents=True, exist_ok=True)
        record_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    preprocess(
        [out_dir / "raw" / "train.jsonl", out_dir / "raw" / "valid.jsonl"],
        out_dir,
        char_tokenizer(),
        PreprocessOptions(workers=workers, progress=progress),
    )
    return corpus
