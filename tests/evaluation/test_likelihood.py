"""`setdiff eval likelihood`: the left-to-right estimate is the exact autoregressive NLL, the
Monte Carlo interval shrinks with more orders, and the result does not depend on the sharding."""

import json
import math
import subprocess

import pytest
import torch

from setdiff_megatron.core.orders import make_order_policy
from setdiff_megatron.evaluation.likelihood import Window, summarize, window_nll
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sources.read import read_source
from tests.cli_runs import cli, setdiff
from tests.conftest import debug_config

DOCS = [
    "import os\nimport sys\n\ndef main():\n    print(os.getcwd())\n",
    "class A:\n    pass\n",
    "for i in range(10):\n    total += i * i\n",
]


def ar_nll(model: SetDiffusionTransformer, tokens: list[int]) -> float:
    """-sum log p(x_i | x_<i) through the KV cache: commit x_{i-1}, query position i; an
    independent path from the training forward that `window_nll` takes."""
    mask = model.config.mask_token_id
    cache = model.new_cache(1, len(tokens) + 2)
    total = 0.0
    with torch.no_grad():
        for i, token in enumerate(tokens):
            step_tokens = ([tokens[i - 1]] if i else []) + [mask]
            positions = list(range(i - 1, i + 1)) if i else [0]
            logits = model.step(
                torch.tensor([step_tokens]), torch.tensor([positions]), cache, num_commit=len(step_tokens) - 1
            )
            logits = logits[0, -1].double().index_fill(0, torch.tensor([mask]), float("-inf"))
            total -= torch.log_softmax(logits, 0)[token].item()
    return total


def test_left_to_right_is_the_exact_ar_nll_on_a_random_model():
    torch.manual_seed(0)
    model = SetDiffusionTransformer(debug_config()).double().eval()
    gen = torch.Generator().manual_seed(1)
    windows = [Window(i, torch.randint(0, 63, (n,), generator=gen).tolist(), 0) for i, n in enumerate((9, 5, 12))]
    nll = window_nll(
        model,
        windows,
        make_order_policy("left_to_right"),
        mask_token_id=63,
        keep_clean_bos=False,
        num_orders=2,
        seed=0,
        device="cpu",
    )
    for w, values in zip(windows, nll):
        assert values[0] == pytest.approx(values[1], abs=1e-9)
        assert values[0] == pytest.approx(ar_nll(model, w.tokens), abs=1e-9)


def test_the_interval_shrinks_with_more_orders_and_ignores_the_batch():
    torch.manual_seed(0)
    model = SetDiffusionTransformer(debug_config()).double().eval()
    gen = torch.Generator().manual_seed(2)
    windows = [Window(i, torch.randint(0, 63, (16,), generator=gen).tolist(), 40) for i in range(6)]

    def records(num_orders, batch):
        out = []
        for first in range(0, len(windows), batch):
            chunk = windows[first : first + batch]
            nll = window_nll(
                model,
                chunk,
                make_order_policy("uniform"),
                mask_token_id=63,
                keep_clean_bos=False,
                num_orders=num_orders,
                seed=0,
                device="cpu",
            )
            out += [{"nll": v, "num_tokens": 16, "num_bytes": w.num_bytes} for w, v in zip(chunk, nll)]
        return out

    few, many = summarize(records(4, 6)), summarize(records(64, 6))
    assert few["ci95_half_width"] > 0 and many["ci95_half_width"] < few["ci95_half_width"] / 2
    assert abs(many["nll_per_token"] - few["nll_per_token"]) < 3 * few["ci95_half_width"]
    assert records(4, 2) == records(4, 6), "a window's orders do not depend on its batch"
    assert few["bits_per_byte"] == pytest.approx(few["nll_per_token"] * 96 / math.log(2) / 240)


def likelihood(source, data, out, *args, nproc=1):
    return setdiff(
        "eval",
        "likelihood",
        source,
        "--data",
        data,
        "--out",
        out,
        "--no-progress",
        "--batch-size",
        "2",
        "--nproc",
        str(nproc),
        *args,
        timeout=600,
        check=False,
    )


@pytest.fixture
def data(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text("".join(json.dumps({"text": d}) + "\n" for d in DOCS))
    return path


@pytest.mark.multiproc
def test_trained_model_left_to_right_equals_direct_ar_nll(trained_run, data, tmp_path):
    proc = likelihood(trained_run, data, tmp_path / "l2r", "--order", "left_to_right", "--num-orders", "1")
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "l2r" / "likelihood.json").read_text())
    ckpt = read_source(trained_run)
    model = SetDiffusionTransformer(ckpt.config)
    model.load_state_dict(ckpt.state_dict)
    model.eval()
    docs = [ckpt.tokenizer.encode(d) for d in DOCS]
    direct = sum(ar_nll(model, ids) for ids in docs) / sum(map(len, docs))
    assert summary["num_tokens"] == sum(map(len, docs)) and summary["ci95_half_width"] is None
    assert summary["nll_per_token"] == pytest.approx(direct, abs=1e-4)
    assert summary["bits_per_byte"] == pytest.approx(
        direct * summary["num_tokens"] / math.log(2) / sum(len(d.encode()) for d in DOCS), rel=1e-6
    )


@pytest.mark.slow  # 15 s; the generate and sample jobs split over two processes in the default suite
@pytest.mark.multiproc
def test_two_processes_give_the_one_process_estimate(trained_run, data, tmp_path):
    one = likelihood(trained_run, data, tmp_path / "one", "--num-orders", "3")
    two = likelihood(trained_run, data, tmp_path / "two", "--num-orders", "3", nproc=2)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-3000:]
    a, b = (json.loads((tmp_path / d / "likelihood.json").read_text()) for d in ("one", "two"))
    assert a["nll_per_token"] == pytest.approx(b["nll_per_token"], abs=1e-6)
    assert a["ci95_half_width"] == pytest.approx(b["ci95_half_width"], abs=1e-6) and a["ci95_half_width"] > 0


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "args, content, fragment",
    [
        ([], '{"text": "a"}\n{"txt": "b"}\n', "docs.jsonl:2: expected a JSON object with a string 'text'"),
        ([], "", "holds no documents"),
        (["--order", "random"], '{"text": "a"}\n', "--order must be one of"),
        (["--num-orders", "0"], '{"text": "a"}\n', "--num-orders must be >= 1"),
        (["--seq-len", "4096"], '{"text": "a"}\n', "--seq-len must be in [1, 128]"),
    ],
)
def test_bad_input_fails_with_one_line(trained_run, tmp_path, args, content, fragment):
    (tmp_path / "docs.jsonl").write_text(content)
    proc = likelihood(trained_run, tmp_path / "docs.jsonl", tmp_path / "out", *args)
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr


@pytest.mark.multiproc
def test_a_job_killed_mid_run_resumes_to_the_same_numbers(trained_run, tmp_path):
    """SIGKILL once the first batch is written; the rerun does only the rest and matches an
    uninterrupted run."""
    import os
    import signal
    import time

    docs = tmp_path / "docs.jsonl"
    docs.write_text("".join(json.dumps({"text": d * 3}) + "\n" for d in DOCS * 4))
    args = ["--num-orders", "2", "--seq-len", "32", "--batch-size", "1"]
    whole = likelihood(trained_run, docs, tmp_path / "whole", *args)
    assert whole.returncode == 0, whole.stderr[-3000:]
    cut = tmp_path / "cut"
    command = cli("eval", "likelihood", trained_run, "--data", docs, "--out", cut, "--no-progress", *args)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 300
    while proc.poll() is None and time.monotonic() < deadline:
        parts = list((cut / "windows.jsonl.parts").glob("*.jsonl")) if cut.exists() else []
        if parts and parts[0].read_text().count("\n") >= 2:
            os.killpg(proc.pid, signal.SIGKILL)
            break
        time.sleep(0.05)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the job finished before it could be killed"
    rerun = likelihood(trained_run, docs, cut, *args)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    a, b = (json.loads((d / "likelihood.json").read_text()) for d in (tmp_path / "whole", cut))
    assert a["num_windows"] == b["num_windows"] and a["nll_per_token"] == pytest.approx(b["nll_per_token"], abs=1e-9)
