"""A built-in reasoning corpus: GSM8K-style multi-step arithmetic with worked solutions.

Every machine can generate it, so the study (`python -m benchmarks.study`) and the main job can
train models that learn something measurable with no download. A problem is an expression of
2-4 operations; its worked solution has one equation per line and ends with GSM8K's `#### answer`.
Text is ASCII, for character tokens (`char_tokenizer`). No test, infill or valid problem's
expression occurs in the training split. The format and what a small model learns from it:
docs/data.md ("The built-in reasoning corpus").
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from setdiff_megatron.data.preprocess import TOKENIZER_SUBDIR, PreprocessOptions, preprocess
from setdiff_megatron.data.supervised import RecordFields
from setdiff_megatron.data.tokenizers import SetDiffTokenizer, train_byte_level_bpe
from setdiff_megatron.errors import UserError

__all__ = [
    "Level",
    "Problem",
    "TRAIN_LEVELS",
    "TEST_LEVELS",
    "make_problem",
    "problems",
    "char_tokenizer",
    "ReasoningCorpus",
    "prepare_reasoning_corpus",
    "write_jsonl",
]

FORMAT_VERSION = 2
_RECORD_FILE = "corpus.json"


@dataclass(frozen=True, order=True)
class Level:
    """A difficulty: `num_ops` operations over operands of 1..`digits` digits."""

    num_ops: int
    digits: int

    def __post_init__(self) -> None:
        if not 1 <= self.num_ops <= 8 or not 1 <= self.digits <= 4:
            raise UserError(f"a reasoning level needs 1..8 operations and 1..4 digits; got {self}")

    @property
    def name(self) -> str:
        return f"ops{self.num_ops}-d{self.digits}"


TRAIN_LEVELS = (Level(2, 1), Level(3, 1), Level(4, 1), Level(2, 2), Level(3, 2))
"""What the models train on, in equal shares: 2-4 operations on one-digit operands, 2-3 on
operands of up to two digits (a problem and its solution fit 64 characters)."""
TEST_LEVELS = TRAIN_LEVELS
"""Test splits: one per training level (held-out problems)."""


@dataclass(frozen=True)
class Problem:
    expression: str
    steps: tuple[str, ...]
    answer: int
    level: Level

    @property
    def prompt(self) -> str:
        return f"{self.expression}=\n"

    @property
    def solution(self) -> str:
        return "".join(f"{step}\n" for step in self.steps) + f"#### {self.answer}"

    @property
    def text(self) -> str:
        return self.prompt + self.solution


def _operand(rng: random.Random, digits: int) -> int:
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _solve(numbers: list[int], ops: list[str]) -> list[str] | None:
    """Solution lines (products first, then left to right); None if a step goes below 0."""
    steps, terms, term_ops = [], [numbers[0]], []
    for op, number in zip(ops, numbers[1:]):
        if op == "*":
            product = terms[-1] * number
            steps.append(f"{terms[-1]}*{number}={product}")
            terms[-1] = product
        else:
            terms.append(number)
            term_ops.append(op)
    value = terms[0]
    for op, term in zip(term_ops, terms[1:]):
        new = value + term if op == "+" else value - term
        if new < 0:
            return None
        steps.append(f"{value}{op}{term}={new}")
        value = new
    return steps


def make_problem(rng: random.Random, level: Level, operators: str = "+-*") -> Problem:
    """One problem of `level` over `operators`, drawn from `rng` (rejection keeps every step >= 0).

    Multiplications take a one-digit right operand and never follow one another, and every
    intermediate result stays >= 0, so results stay short and the solutions need no signs.
    """
    while True:
        ops = [rng.choice(operators) for _ in range(level.num_ops)]
        if "**" in "".join(ops):
            continue
        numbers = [_operand(rng, level.digits)]
        numbers += [rng.randint(2, 9) if op == "*" else _operand(rng, level.digits) for op in ops]
        steps = _solve(numbers, ops)
        if steps is not None:
            expression = str(numbers[0]) + "".join(f"{op}{n}" for op, n in zip(ops, numbers[1:]))
            return Problem(expression, tuple(steps), int(steps[-1].rsplit("=", 1)[1]), level)


def problems(
    seed: int,
    levels: Sequence[Level],
    count: int,
    exclude: frozenset[str] = frozenset(),
    *,
    distinct: bool = True,
    operators: str = "+-*",
) -> Iterator[Problem]:
    """`count` problems over `operators`, levels in turn, none of whose expressions is in
    `exclude`; with `distinct`, no expression twice (the small levels hold a few thousand
    expressions only, so training draws with repeats, as real corpora do)."""
    rng, seen = random.Random(seed), set(exclude)
    made = 0
    while made < count:
        problem = make_problem(rng, levels[made % len(levels)], operators)
        if problem.expression in seen:
            continue
        if distinct:
            seen.add(problem.expression)
        made += 1
        yield problem


def char_tokenizer() -> SetDiffTokenizer:
    """Byte tokens with no merges: one token per ASCII character, plus EOS, BOS, PAD and MASK."""
    return train_byte_level_bpe([], vocab_size=260)


@dataclass(frozen=True)
class ReasoningCorpus:
    """Where `prepare_reasoning_corpus` put things."""

    directory: Path
    tokenizer_dir: Path
    train_prefix: Path
    valid_prefix: Path
    tasks_dir: Path

    def test_tasks(self, level: Level) -> Path:
        return self.tasks_dir / f"test-{level.name}.jsonl"

    @property
    def infill_tasks(self) -> Path:
        return self.tasks_dir / "infill-test.jsonl"


def _infill_record(problem: Problem, rng: random.Random) -> dict:
    """The problem with one or two of its solution lines as the span to fill: never the last
    (`=answer`, which the visible `#### answer` gives away)."""
    lines = problem.text.split("\n")  # expression line, steps..., answer line
    inner = len(problem.steps) - 1
    width = 1 if inner < 2 or rng.random() < 0.5 else 2
    first = 1 + rng.randint(0, inner - width)
    left = "\n".join(lines[:first]) + "\n"
    middle = "\n".join(lines[first : first + width])
    right = "\n" + "\n".join(lines[first + width :])
    return {"id": problem.expression, "left": left, "middle": middle, "right": right, "level": problem.level.name}


def write_jsonl(path: Path, records: Iterator[dict]) -> None:
    """One JSON object a line, written under a temporary name and moved into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as stream:
        for record in records:
            stream.write(json.dumps(record) + "\n")
    os.replace(partial, path)


def _write_problems(raw: Path, split: str, problems: Iterator[Problem]) -> None:
    """raw/<split>.jsonl documents and raw/<split>-supervised.jsonl records, in one pass."""
    path = raw / f"{split}-supervised.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "w", encoding="utf-8") as records:

        def documents() -> Iterator[dict]:
            for problem in problems:
                records.write(json.dumps({"prompt": problem.prompt, "response": problem.solution}) + "\n")
                yield {"text": problem.text}

        write_jsonl(raw / f"{split}.jsonl", documents())
    os.replace(partial, path)


def prepare_reasoning_corpus(
    out_dir: str | Path,
    *,
    num_train: int = 200_000,
    num_valid: int = 2_000,
    num_test: int = 200,
    num_infill: int = 200,
    seed: int = 0,
    workers: int = 1,
    progress: bool = True,
) -> ReasoningCorpus:
    """Generate the corpus, its tokenizer, indexed datasets and task files, deterministically by seed.

    Writes raw/{train,valid}.jsonl documents and raw/{train,valid}-supervised.jsonl records (prompt:
    the expression line; response: the solution), each with its indexed datasets; tasks/test-<level>.jsonl
    for `setdiff eval generate` (the same prompt; reference: the whole solution, scored by the GSM8K
    metric on its final answer); tasks/infill-test.jsonl, solution lines to infill (`_infill_record`).
    Test, infill and valid problems are drawn first and kept out of training. A rerun with the same
    arguments finds everything in place and returns at once."""
    out_dir = Path(out_dir)
    record = {
        "format": FORMAT_VERSION,
        "num_train": num_train,
        "num_valid": num_valid,
        "num_test": num_test,
        "num_infill": num_infill,
        "seed": seed,
        "train_levels": [asdict(lv) for lv in TRAIN_LEVELS],
        "test_levels": [asdict(lv) for lv in TEST_LEVELS],
    }
    corpus = ReasoningCorpus(
        out_dir, out_dir / TOKENIZER_SUBDIR, out_dir / "train", out_dir / "valid", out_dir / "tasks"
    )
    record_path = out_dir / _RECORD_FILE
    tokenizer = char_tokenizer()
    if not (record_path.is_file() and json.loads(record_path.read_text(encoding="utf-8")) == record):
        held: set[str] = set()
        for i, level in enumerate(TEST_LEVELS):
            test = list(problems(seed * 1000 + 1 + i, [level], num_test, frozenset(held)))
            held |= {p.expression for p in test}
            write_jsonl(
                corpus.test_tasks(level),
                ({"prompt": p.prompt, "reference": p.solution, "level": level.name} for p in test),
            )
        infill_rng = random.Random(seed * 1000 + 500)
        infill = list(problems(seed * 1000 + 501, TRAIN_LEVELS, num_infill, frozenset(held)))
        held |= {p.expression for p in infill}
        write_jsonl(corpus.infill_tasks, (_infill_record(p, infill_rng) for p in infill))
        valid = list(problems(seed * 1000 + 502, TRAIN_LEVELS, num_valid, frozenset(held)))
        held |= {p.expression for p in valid}
        _write_problems(out_dir / "raw", "valid", iter(valid))
        _write_problems(
            out_dir / "raw",
            "train",
            problems(seed * 1000 + 503, TRAIN_LEVELS, num_train, frozenset(held), distinct=False),
        )
        record_path.parent.mkdir(parents=True, exist_ok=True)
        record_path.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")
    raw = out_dir / "raw"
    preprocess(
        [raw / "train.jsonl", raw / "valid.jsonl"],
        out_dir,
        tokenizer,
        PreprocessOptions(workers=workers, progress=progress),
    )
    preprocess(
        [raw / "train-supervised.jsonl", raw / "valid-supervised.jsonl"],
        out_dir,
        tokenizer,
        PreprocessOptions(workers=workers, progress=progress, supervised=RecordFields()),
    )
    return corpus
