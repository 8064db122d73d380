"""The built-in reasoning corpus: correct solutions, deterministic splits, no test leakage, and
task files the eval jobs read."""

import json
import random
import re

import pytest

from setdiff_megatron.data.answers import gsm8k_answer
from setdiff_megatron.data.indexed import read_manifest
from setdiff_megatron.data.reasoning import (
    TEST_LEVELS,
    TRAIN_LEVELS,
    Level,
    char_tokenizer,
    make_problem,
    prepare_reasoning_corpus,
    problems,
)
from setdiff_megatron.errors import UserError
from setdiff_megatron.evaluation.infilling import jsonl_examples
from setdiff_megatron.evaluation.tasks import read_tasks

STEP = re.compile(r"^(\d+)([+*-])(\d+)=(\d+)$")


@pytest.mark.parametrize("level", TRAIN_LEVELS, ids=lambda lv: lv.name)
def test_every_solution_line_is_a_true_equation_and_ends_in_the_answer(level):
    rng = random.Random(level.num_ops * 10 + level.digits)
    for _ in range(300):
        p = make_problem(rng, level)
        assert eval(p.expression) == p.answer >= 0  # Python's precedence is the solution's
        numbers = re.findall(r"\d+", p.expression)
        assert len(numbers) == level.num_ops + 1 and max(len(n) for n in numbers) <= level.digits
        assert "**" not in p.expression and len(p.steps) == level.num_ops
        for line in p.steps:
            a, op, b, c = STEP.match(line).groups()
            assert eval(f"{a}{op}{b}") == int(c)
        assert p.steps[-1].endswith(f"={p.answer}")
        assert p.text == f"{p.expression}=\n" + "".join(f"{s}\n" for s in p.steps) + f"#### {p.answer}"
        assert gsm8k_answer(p.solution) == str(p.answer) and len(p.text) <= 64


def test_problems_are_deterministic_distinct_and_respect_exclusions():
    first = [p.text for p in problems(3, TRAIN_LEVELS, 500)]
    assert first == [p.text for p in problems(3, TRAIN_LEVELS, 500)]
    assert len(set(first)) == 500 and first != [p.text for p in problems(4, TRAIN_LEVELS, 500)]
    banned = frozenset(p.split("=")[0] for p in first[:100])
    assert not banned & {p.expression for p in problems(3, TRAIN_LEVELS, 2000, banned, distinct=False)}
    with pytest.raises(UserError, match="1..8 operations"):
        Level(0, 1)


def test_char_tokenizer_spells_every_character():
    tokenizer = char_tokenizer()
    text = "47+8*3-19=\n8*3=24\n#### 52"
    assert len(tokenizer.encode(text)) == len(text) and tokenizer.decode(tokenizer.encode(text)) == text
    assert len({tokenizer.mask_id, tokenizer.eos_id, tokenizer.bos_id, tokenizer.pad_id}) == 4


def test_corpus_splits_tasks_and_rerun(tmp_path):
    corpus = prepare_reasoning_corpus(
        tmp_path, num_train=3000, num_valid=100, num_test=20, num_infill=30, progress=False
    )
    train = [json.loads(line)["text"] for line in (tmp_path / "raw" / "train.jsonl").read_text().splitlines()]
    expressions = {t.split("=")[0] for t in train}
    assert len(train) == 3000 and read_manifest(corpus.train_prefix)["documents"] == 3000
    assert read_manifest(corpus.valid_prefix)["documents"] == 100
    for level in TEST_LEVELS:
        examples = read_tasks(corpus.test_tasks(level))
        assert len(examples) == 20 and not {e.prompt[:-2] for e in examples} & expressions
        assert all(gsm8k_answer(e.references[0]) is not None for e in examples)
    infill = jsonl_examples(corpus.infill_tasks)
    assert len(infill) == 30 and not {e.id for e in infill} & expressions
    for ex in infill:
        whole = ex.left + ex.middle + ex.right
        assert STEP.match(ex.middle.split("\n")[0]) and ex.middle.count("\n") <= 1 and ex.right.startswith("\n")
        assert ex.left.count("\n") >= 1 and ex.right.count("\n") >= 2 and "#### " in ex.right
        assert whole.startswith(ex.id + "=\n") and eval(ex.id) == int(whole.rsplit(" ", 1)[1])
    stamp = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    prepare_reasoning_corpus(tmp_path, num_train=3000, num_valid=100, num_test=20, num_infill=30, progress=False)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == stamp
