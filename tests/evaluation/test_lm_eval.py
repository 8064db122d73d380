"""The lm-evaluation-harness adapter on the tiny trained checkpoint: loglikelihood against an
independent autoregressive computation through the KV cache, generate_until against the
sampler, and lm-eval itself (simple_evaluate and its command line) running a local
multiple-choice task and a GSM8K-style generation task from YAML + JSONL files."""

import json
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (an optional extra: pip install 'setdiff-megatron[lm-eval]')"
)

from setdiff_megatron.cli import main  # noqa: E402
from setdiff_megatron.evaluation.lm_eval_adapter import SetDiffLM  # noqa: E402
from tests.cli_runs import torchrun  # noqa: E402

pytestmark = pytest.mark.multiproc
from setdiff_megatron.sampling.decoding import DecodingConfig  # noqa: E402
from setdiff_megatron.sampling.sampler import SetSampler  # noqa: E402

DOCS = [
    {"question": "x = 2 + 3\nprint(x)", "answer": "x is 5\n#### 5", "choices": ["5", "6", "7"], "label": 0},
    {"question": "y = 10 - 4\nprint(y)", "answer": "y is 6\n#### 6", "choices": ["4", "6", "14"], "label": 1},
    {"question": "z = 3 * 3\nprint(z)", "answer": "z is 9\n#### 9", "choices": ["6", "33", "9"], "label": 2},
]
GEN_TASK = """task: tiny_gsm
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: generate_until
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_target: "{{{{answer}}}}"
generation_kwargs:
  until: ["Question:", "\\n\\n"]
  max_gen_toks: 12
  do_sample: false
filter_list:
  - name: last-number
    filter:
      - function: regex
        regex_pattern: "(-?[0-9]+)"
        group_select: -1
      - function: take_first
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
    regexes_to_ignore: ["(?s).*#### "]
metadata:
  version: 1.0
"""
MC_TASK = """task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
output_type: multiple_choice
test_split: test
doc_to_text: "Question: {{{{question}}}}\\nAnswer:"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


@pytest.fixture(scope="module")
def lm(trained_run) -> SetDiffLM:
    return SetDiffLM(pretrained=str(trained_run), window=4, threshold=0.9, batch_size=4)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("lm_eval_tasks")
    (path / "tiny.jsonl").write_text("".join(json.dumps(d) + "\n" for d in DOCS))
    (path / "tiny_gsm.yaml").write_text(GEN_TASK.format(data=path / "tiny.jsonl"))
    (path / "tiny_mc.yaml").write_text(MC_TASK.format(data=path / "tiny.jsonl"))
    return path


def requests(*args):
    return [SimpleNamespace(args=a) for a in args]


@torch.no_grad()
def ar_logprob(model, ctx: list[int], cont: list[int], mask: int) -> tuple[float, bool]:
    """sum log p(cont_j | ctx, cont_<j) through the KV cache: prefill the context, then per token
    commit the previous one and query the next position (an independent path from the adapter's
    two-stream forward)."""
    cache = model.new_cache(1, len(ctx) + len(cont) + 2)
    model.step(torch.tensor([ctx]), torch.tensor([list(range(len(ctx)))]), cache, num_commit=len(ctx))
    total, greedy = 0.0, True
    for j, token in enumerate(cont):
        pos = len(ctx) + j
        tokens, positions = ([cont[j - 1]], [pos - 1]) if j else ([], [])
        logits = model.step(
            torch.tensor([tokens + [mask]]), torch.tensor([positions + [pos]]), cache, num_commit=len(tokens)
        )[0, -1].double()
        logits[mask] = float("-inf")
        total += torch.log_softmax(logits, 0)[token].item()
        greedy &= int(logits.argmax()) == token
    return total, greedy


def test_loglikelihood_is_the_autoregressive_one(lm):
    tok, mask = lm.tokenizer, lm.tokenizer.mask_id
    pairs = [
        ("def main(", "):\n    pass"),
        ("import os\n", "import sys"),
        ("", " hello world"),
        ("x = 1\n" * 40, "y = 2"),
    ]  # the last context is longer than the model's 128 positions
    # What the model writes greedily, one token at a time (the sampler at window 1), as a continuation.
    ar = DecodingConfig(window=1, max_new_tokens=3, eos_token_ids=())
    greedy = (
        SetSampler(lm.model, mask_token_id=mask, context_len=lm.max_length)
        .generate([tok.encode("for i in range(")], ar)
        .rows[0]
        .completion
    )
    pairs.append(("for i in range(", tok.decode(greedy)))
    results = lm.loglikelihood(requests(*pairs))
    assert len(results) == len(pairs)
    for (context, continuation), (value, is_greedy) in zip(pairs, results):
        # The pair is split where the context's tokens end, if they do; an empty context is an EOS.
        ctx, whole = tok.encode(context), tok.encode(context + continuation)
        cont = whole[len(ctx) :] if whole[: len(ctx)] == ctx else tok.encode(continuation)
        ctx = ((ctx or [tok.eos_id]) + cont)[-lm.max_length :][: -len(cont)]  # the oldest context goes
        expected, expected_greedy = ar_logprob(lm.model, ctx, cont, mask)
        assert value == pytest.approx(expected, abs=1e-5) and is_greedy == expected_greedy
    assert results[-1][1] and not results[0][1]


def test_loglikelihood_rolling_scores_every_token_once(lm, monkeypatch):
    tok, mask = lm.tokenizer, lm.tokenizer.mask_id
    monkeypatch.setattr(lm, "max_length", 16)  # short windows keep the token-by-token reference cheap
    short, long = "import os\n", "total = 0\nfor i in range(10):\n    total += i\n" * 2
    ids = [tok.eos_id] + tok.encode(long)
    assert len(ids) > 2 * lm.max_length
    # Windows of max_length - 1 scored tokens, each with the most context that fits.
    expected, step = 0.0, lm.max_length - 1
    for start in range(1, len(ids), step):
        end = min(start + step, len(ids))
        expected += ar_logprob(lm.model, ids[max(0, end - lm.max_length) : start], ids[start:end], mask)[0]
    short_ids = [tok.eos_id] + tok.encode(short)
    values = lm.loglikelihood_rolling(requests((short,), (long,)))
    assert values[0] == pytest.approx(ar_logprob(lm.model, short_ids[:1], short_ids[1:], mask)[0], abs=1e-5)
    assert values[1] == pytest.approx(expected, abs=1e-5)


def test_generate_until_is_the_sampler_cut_at_the_stop_strings(lm):
    tok = lm.tokenizer
    contexts = ["def main(", "import os\n", "class A:\n"]
    gen_kwargs = {"until": ["\n\n", "Question:"], "max_gen_toks": 10}
    outputs = lm.generate_until(requests(*[(c, gen_kwargs) for c in contexts]))
    cfg = DecodingConfig(
        window=4,
        threshold=0.9,
        max_new_tokens=10,
        eos_token_ids=(tok.eos_id,),
        stop_sequences=(tuple(tok.encode("\n\n")), tuple(tok.encode("Question:"))),
    )
    rows = (
        SetSampler(lm.model, mask_token_id=tok.mask_id, context_len=lm.max_length)
        .generate([tok.encode(c) for c in contexts], cfg)
        .rows
    )
    for output, row in zip(outputs, rows):
        text = tok.decode(row.completion, skip_special_tokens=True)
        cuts = [i for i in (text.find("\n\n"), text.find("Question:")) if i >= 0]
        assert output == (text[: min(cuts)] if cuts else text)
    speed = lm.get_model_info()["setdiff"]["generate_until_speed"]
    assert speed["rows"] >= 3 and speed["tokens_per_step"] >= 1 and speed["tokens_per_s"] > 0


def mc_accuracy(lm) -> float:
    """Multiple choice by hand: the choice of highest log-likelihood (after lm-eval's " " delimiter)."""
    picks = []
    for doc in DOCS:
        context = f"Question: {doc['question']}\nAnswer:"
        scores = lm.loglikelihood(requests(*[(context, f" {c}") for c in doc["choices"]]))
        picks.append(max(range(3), key=lambda i: scores[i][0]) == doc["label"])
    return sum(picks) / len(picks)


def test_simple_evaluate_runs_local_tasks(lm, task_dir):
    import lm_eval
    from lm_eval.tasks import TaskManager

    tasks = TaskManager(include_path=str(task_dir), include_defaults=False)  # no need to index lm-eval's own
    out = lm_eval.simple_evaluate(model=lm, tasks=["tiny_mc", "tiny_gsm"], task_manager=tasks, log_samples=True)
    assert out["results"]["tiny_mc"]["acc,none"] == pytest.approx(mc_accuracy(lm))
    assert "exact_match,last-number" in out["results"]["tiny_gsm"]
    responses = [s["resps"][0][0] for s in out["samples"]["tiny_gsm"]]
    assert len(responses) == 3 and all(isinstance(r, str) and "\n\n" not in r for r in responses)


@pytest.mark.slow
def test_the_lm_eval_command_line_with_our_model(trained_run, task_dir, tmp_path, monkeypatch):
    """`setdiff eval lm-eval` (= python -m setdiff_megatron.evaluation.lm_eval_adapter) is lm-eval's own
    command line with --model setdiff registered. Slow: that command line indexes every one of
    lm-eval's built-in task files (about 25 s on 2 cores) before it reads --include_path."""
    monkeypatch.setattr(sys, "argv", sys.argv[:1])
    code = main(
        [
            "eval",
            "lm-eval",
            "--model",
            "setdiff",
            "--model_args",
            f"pretrained={trained_run},window=4,threshold=0.9",
            "--tasks",
            "tiny_mc,tiny_gsm",
            "--include_path",
            str(task_dir),
            "--batch_size",
            "4",
            "--device",
            "cpu",
            "--output_path",
            str(tmp_path / "results"),
        ]
    )
    assert code == 0
    (result,) = tmp_path.glob("results/**/results_*.json")
    saved = json.loads(result.read_text())
    assert set(saved["results"]) == {"tiny_mc", "tiny_gsm"}
    assert saved["config"]["setdiff"]["decoding"]["window"] == 4
    assert saved["config"]["setdiff"]["generate_until_speed"]["rows"] == 3


@pytest.mark.slow
def test_data_parallel_under_torchrun(lm, trained_run, task_dir, tmp_path):
    proc = subprocess.run(
        [
            *torchrun(2),
            "-m",
            "setdiff_megatron.evaluation.lm_eval_adapter",
            "--model",
            "setdiff",
            "--model_args",
            f"pretrained={trained_run},window=4",
            "--tasks",
            "tiny_mc",
            "--include_path",
            str(task_dir),
            "--batch_size",
            "4",
            "--output_path",
            str(tmp_path / "results"),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    (result,) = tmp_path.glob("results/**/results_*.json")
    saved = json.loads(result.read_text())["results"]["tiny_mc"]
    assert saved["sample_len"] == 3 and saved["acc,none"] == pytest.approx(mc_accuracy(lm))
