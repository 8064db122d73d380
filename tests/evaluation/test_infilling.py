"""`setdiff eval infill`: ROCStories middle sentences and held-out function bodies, filled with
both contexts prefilled and scored against the originals."""

import csv
import json

import pytest

from setdiff_megatron.data.corpus import is_heldout, stdlib_documents
from setdiff_megatron.data.reasoning import char_tokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.evaluation.infilling import (
    InfillExample,
    _visible_right,
    code_examples,
    jsonl_examples,
    rocstories_examples,
    score_samples,
)
from setdiff_megatron.evaluation.scoring import rouge
from setdiff_megatron.sources.read import read_source
from tests.cli_runs import setdiff

STORIES = [
    [
        "s1",
        "Tom had a dog.",
        "The dog was old.",
        "One day it ran away.",
        "Tom looked everywhere.",
        "He found it at the park.",
        "He lost his keys.",
        "1",
    ],
    [
        "s2",
        "Ann baked a cake.",
        "She added sugar.",
        "The oven broke.",
        "She called a repairman.",
        "He sang a song.",
        "The cake was finished the next day.",
        "2",
    ],
]


@pytest.fixture
def stories(tmp_path):
    path = tmp_path / "cloze.csv"
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(
            [
                "InputStoryid",
                "InputSentence1",
                "InputSentence2",
                "InputSentence3",
                "InputSentence4",
                "RandomFifthSentenceQuiz1",
                "RandomFifthSentenceQuiz2",
                "AnswerRightEnding",
            ]
        )
        writer.writerows(STORIES)
    return path


def test_rocstories_masks_the_middle_of_the_right_story(stories):
    one, two = rocstories_examples(stories, targets=1)
    assert (one.left, one.middle, one.right) == (
        "Tom had a dog. The dog was old.",
        " One day it ran away.",
        " Tom looked everywhere. He found it at the park.",
    )
    assert two.right.endswith("The cake was finished the next day.")  # the right ending, not the random one
    three = rocstories_examples(stories, targets=3, max_examples=1)[0]
    assert (three.left, three.middle) == (
        "Tom had a dog.",
        " The dog was old. One day it ran away. Tom looked everywhere.",
    )


def test_rocstories_bad_input(stories, tmp_path):
    with pytest.raises(UserError, match="--targets must be 1 or 3"):
        rocstories_examples(stories, targets=2)
    (tmp_path / "bad.csv").write_text("a,b\n1,2\n")
    with pytest.raises(UserError, match="not a ROCStories cloze CSV: no column InputStoryid"):
        rocstories_examples(tmp_path / "bad.csv")
    with pytest.raises(UserError, match="does not exist"):
        rocstories_examples(tmp_path / "none.csv")


def test_code_examples_are_function_bodies_of_held_out_files():
    examples = code_examples(max_examples=5)
    heldout = {path: text for i, (path, text) in enumerate(stdlib_documents()) if is_heldout(i)}
    assert len(examples) == 5
    for ex in examples:
        path = ex.id.rsplit(":", 1)[0]
        assert path in heldout and ex.left + ex.middle + ex.right in heldout[path]
        assert ex.left.rstrip().endswith(":") and ex.middle.startswith(" ") and 2 <= ex.middle.count("\n") <= 6


def test_scores_average_rouge_and_exact_match():
    samples = [
        {"infills": ["the dog ran"], "reference": "the dog ran"},
        {"infills": ["a cat sat"], "reference": "the dog ran away"},
    ]
    scores = score_samples(samples)
    assert scores["exact_match"] == 0.5
    assert scores["rouge1"] == pytest.approx((1 + rouge("a cat sat", "the dog ran away")["rouge1"]) / 2)


def infill(source, out, *args):
    return setdiff(
        "eval",
        "infill",
        source,
        "--out",
        out,
        "--no-progress",
        "--window",
        "4",
        "--threshold",
        "0.5",
        *args,
        timeout=600,
        check=False,
    )


@pytest.mark.multiproc
def test_infill_job_scores_its_samples_and_resumes(trained_run, stories, tmp_path):
    proc = infill(trained_run, tmp_path / "roc", "--task", "rocstories", "--data", str(stories))
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "roc" / "metrics.json").read_text())
    samples = [json.loads(line) for line in (tmp_path / "roc" / "samples.jsonl").read_text().splitlines()]
    assert metrics["examples"] == 2 and [s["id"] for s in samples] == ["s1", "s2"]
    assert all(s["completion"] == "" and len(s["infills"]) == 1 for s in samples)
    assert metrics["rougeL"] == pytest.approx(score_samples(samples)["rougeL"])
    decoded, busy = sum(s["num_decoded"] for s in samples), sum(s["busy_seconds"] for s in samples)
    assert metrics["tokens_per_s"] == pytest.approx(decoded / busy) and decoded > 0
    again = infill(trained_run, tmp_path / "roc", "--task", "rocstories", "--data", str(stories))
    assert again.returncode == 0 and "2 already written" in again.stderr
    assert json.loads((tmp_path / "roc" / "metrics.json").read_text()) == metrics
    saved = {f.name: f.read_bytes() for f in (tmp_path / "roc").iterdir() if f.is_file()}
    other = infill(trained_run, tmp_path / "roc", "--task", "rocstories", "--data", str(stories), "--context", "left")
    assert (
        other.returncode == 2 and other.stderr.count("\n") == 1 and "holds another infill job's prompts" in other.stderr
    )
    assert {f.name: f.read_bytes() for f in (tmp_path / "roc").iterdir() if f.is_file()} == saved
    (tmp_path / "roc" / "prompts.jsonl").unlink()
    orphan = infill(trained_run, tmp_path / "roc", "--task", "rocstories", "--data", str(stories))
    assert orphan.returncode == 2 and "holds samples without the prompts they were made from" in orphan.stderr
    assert not (tmp_path / "roc" / "prompts.jsonl").exists()


@pytest.mark.multiproc
def test_code_infill_job(trained_run, tmp_path):
    proc = infill(trained_run, tmp_path / "code", "--task", "code", "--max-examples", "3")
    assert proc.returncode == 0, proc.stderr[-3000:]
    metrics = json.loads((tmp_path / "code" / "metrics.json").read_text())
    assert metrics["examples"] + metrics["skipped_too_long"] == 3 and 0 <= metrics["exact_match"] <= 1


@pytest.mark.multiproc
def test_rocstories_needs_its_csv(trained_run, tmp_path):
    proc = infill(trained_run, tmp_path / "x", "--task", "rocstories")
    assert proc.returncode == 2 and "--task rocstories needs --data" in proc.stderr and proc.stderr.count("\n") == 1


def test_jsonl_examples_keep_their_keys_and_reject_bad_lines(tmp_path):
    path = tmp_path / "fill.jsonl"
    path.write_text(
        '{"id": "a", "left": "1+2=\\n", "middle": "1+2=3", "right": "\\n#### 3", "level": "x"}\n\n'
        '{"left": "L", "middle": "M", "right": ""}\n'
    )
    first, second = jsonl_examples(path)
    assert (first.id, first.left, first.middle, first.right, first.extra) == (
        "a",
        "1+2=\n",
        "1+2=3",
        "\n#### 3",
        {"level": "x"},
    )
    assert second.id == "1" and second.extra == {}
    for line, match in [
        ('{"left": "a", "middle": "b"}', 'string "left", "middle" and "right"'),
        ('{"left": "a", "middle": "", "right": "c"}', "nothing to infill"),
        ("[1]", "JSON object"),
    ]:
        path.write_text(line + "\n")
        with pytest.raises(UserError, match=match):
            jsonl_examples(path)


@pytest.mark.parametrize(
    "context, bos, right",
    [
        ("both", False, "\n#### 30"),
        ("left", False, ""),
        # left 6 + span 5 = 11 characters: one more position completes the span's block of 4
        ("blocks", False, "\n"),
        # with a BOS the span ends at 12, on a block boundary: nothing to its right is visible
        ("blocks", True, ""),
    ],
)
def test_visible_right_context_follows_the_order(context, bos, right):
    tokenizer = char_tokenizer()
    ex = InfillExample(id="x", left="5*6=\n3", middle="0+0=3", right="\n#### 30")
    assert _visible_right(ex, tokenizer, context, 4, bos) == right


@pytest.mark.multiproc
def test_jsonl_infill_job_with_block_context(trained_run, tmp_path):
    path = tmp_path / "fill.jsonl"
    path.write_text(
        json.dumps(
            {
                "id": "f",
                "left": "def f(x):\n",
                "middle": "    return x + 1\n",
                "right": "\n\ndef g(y):\n    return y * 2\n",
            }
        )
        + "\n"
    )
    proc = infill(
        trained_run,
        tmp_path / "blocks",
        "--task",
        "jsonl",
        "--data",
        str(path),
        "--context",
        "blocks",
        "--block-size",
        "4",
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (prompt,) = [json.loads(line) for line in (tmp_path / "blocks" / "prompts.jsonl").read_text().splitlines()]
    assert prompt["id"] == "f" and prompt["reference"] == "    return x + 1\n"
    metrics = json.loads((tmp_path / "blocks" / "metrics.json").read_text())
    assert metrics["context"] == "blocks" and metrics["examples"] == 1
    left, span, right = prompt["segments"]
    tokenizer = read_source(trained_run, weights=False).tokenizer
    span_end = len(tokenizer.encode(left)) + span  # the tiny recipe keeps no BOS
    whole_right = tokenizer.encode("\n\ndef g(y):\n    return y * 2\n")
    assert right == tokenizer.decode(whole_right[: -span_end % 4])  # up to the end of the span's block
    proc = infill(trained_run, tmp_path / "x", "--task", "jsonl", "--data", str(path), "--context", "blocks")
    assert (
        proc.returncode == 2
        and "--context blocks needs a block size: the model's policy has none" in proc.stderr
        and proc.stderr.count("\n") == 1
    )
