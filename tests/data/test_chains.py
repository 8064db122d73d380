"""The chains corpus and its infill task: the right side decides the masked line, the left side
leaves it open, and the corpus files are deterministic and hold no test chain in training."""

import json
import random
import re
from collections import defaultdict

import pytest

from setdiff_megatron.data.chains import (
    CHAIN_LEVELS,
    LeftOnlyRule,
    _left_facts,
    chain_problems,
    infill_record,
    prepare_chains_corpus,
    right_context_fill,
    rule_baselines,
)
from setdiff_megatron.data.reasoning import problems
from setdiff_megatron.evaluation.infilling import jsonl_examples

STEP = re.compile(r"^(\d+)([+-])(\d+)=(\d+)$")


def _records(seed: int, per_level: int) -> list[dict]:
    rng, out = random.Random(seed), []
    for i, level in enumerate(CHAIN_LEVELS):
        found = (infill_record(p, rng) for p in chain_problems(seed * 10 + i, level))
        out += [r for r, _ in zip(filter(None, found), range(per_level))]
    return out


def _train(seed: int, count: int) -> list[str]:
    return [p.solution for p in problems(seed, CHAIN_LEVELS, count, distinct=False, operators="+-")]


RECORDS = _records(5, 100)
TRAIN = _train(6, 20_000)


def test_a_chain_runs_from_line_to_line_and_the_span_is_one_true_line():
    for r in RECORDS:
        lines = (r["left"] + r["middle"] + r["right"]).split("\n")
        *steps, answer = lines
        for above, line in zip(steps, steps[1:]):  # each line starts from the result above it
            assert STEP.match(line).group(1) == STEP.match(above).group(4)
        a, op, b, c = STEP.match(r["middle"]).groups()
        assert eval(f"{a}{op}{b}") == int(c) >= 0 and int(b) != 0  # +0 and -0 would both fit: never masked
        assert answer == f"#### {STEP.match(steps[-1]).group(4)}" and 1 <= r["line"] < len(steps)
        assert "*" not in r["left"] + r["middle"] + r["right"]


def test_the_right_context_decides_every_masked_line():
    assert all(right_context_fill(r["left"], r["right"]) == r["middle"] for r in RECORDS)


def test_the_left_side_leaves_the_masked_line_open():
    """Among the training chains, a test line's left-side facts (and span length) fit several
    different lines almost always, so no left-only reader can know which; the best such guess
    and the trivial baseline stay low while the right-context rule is exact."""
    seen = defaultdict(set)
    for chain in TRAIN:
        lines = chain.split("\n")
        for k in range(1, len(lines) - 1):
            seen[_left_facts("\n".join(lines[:k]), len(lines[k]))].add(lines[k])
    open_ = [len(seen[_left_facts(r["left"], len(r["middle"]))]) >= 3 for r in RECORDS]
    assert sum(open_) / len(open_) > 0.9
    rates = rule_baselines(TRAIN, RECORDS)
    assert rates["right_context"] == 1.0 and rates["examples"] == len(RECORDS)
    assert rates["left_only"] < 0.15 and rates["trivial"] < 0.05
    assert rates["by_level"]["ops2-d2"]["left_only"] < 0.05  # two-digit operands: about 1 in 90


def test_the_left_only_rule_is_the_most_common_line_for_its_facts():
    rule = LeftOnlyRule.fit(["1+2=3\n3+4=7\n#### 7", "1+2=3\n3+4=7\n#### 7", "1+2=3\n3+5=8\n#### 8"])
    assert rule.fill("1+2=3\n", 5) == "3+4=7" and rule.fill("9+2=11\n", 6) is None


def test_the_corpus_is_deterministic_and_keeps_its_test_chains_out_of_training(tmp_path):
    kwargs = {"num_train": 3_000, "num_valid": 100, "num_infill": 25, "progress": False}
    corpus = prepare_chains_corpus(tmp_path / "a", **kwargs)
    again = prepare_chains_corpus(tmp_path / "b", **kwargs)
    assert corpus.infill_tasks.read_bytes() == again.infill_tasks.read_bytes()
    records = [json.loads(line) for line in corpus.infill_tasks.read_text().splitlines()]
    assert len(records) == 25 and [r["level"] for r in records[:5]] == [lv.name for lv in CHAIN_LEVELS]
    assert len(jsonl_examples(corpus.infill_tasks)) == 25
    train = {json.loads(line)["text"] for line in (tmp_path / "a" / "raw" / "train.jsonl").read_text().splitlines()}
    held = {r["left"] + r["middle"] + r["right"] for r in records}
    assert train and not held & train
    for name in ("train.bin", "valid.idx", "tokenizer"):
        assert (tmp_path / "a" / name).exists()


@pytest.mark.parametrize("operators", ["+-", "+-*"])
def test_problems_draw_only_their_operators(operators):
    drawn = "".join(p.expression for p in problems(2, CHAIN_LEVELS, 200, operators=operators))
    assert set(re.sub(r"\d", "", drawn)) == set(operators)
