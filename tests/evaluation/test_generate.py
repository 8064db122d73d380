"""`setdiff eval generate` on the tiny trained checkpoint: metrics against a direct computation
from the sampler's own outputs, 2 processes against 1, an interrupted run resumed, re-scoring
without generating again, and one-line errors on bad input."""

import importlib.util
import json
import shutil
from dataclasses import replace

import pytest

from setdiff_megatron.cli import main
from setdiff_megatron.data.answers import gsm8k_answer
from setdiff_megatron.errors import UserError
from setdiff_megatron.evaluation import scoring
from setdiff_megatron.evaluation.tasks import GenerateJob, run_generate_job
from setdiff_megatron.inference.sharding import Placement
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.sources.read import read_source
from tests.cli_runs import setdiff

PROMPTS = ["x = 1\ny = 2\nz = ", "for i in range(", "def main(", "import os\n", "a = [1, 2, 3]\nb = "]
STOP = "\n\n"
# Sampled decoding: the tiny model's greedy output is a run of commas, which no metric can tell apart.
DECODING = dict(window=4, threshold=0.3, tokens_per_step=2, temperature=1.0, max_new_tokens=10, seed=3)
ARGS = [
    "--window",
    "4",
    "--threshold",
    "0.3",
    "--tokens-per-step",
    "2",
    "--temperature",
    "1.0",
    "--max-new-tokens",
    "10",
    "--seed",
    "3",
    "--batch-size",
    "2",
    "--stop",
    STOP,
    "--no-progress",
]
TIMING = ("tokens_per_s", "decode_seconds")


@pytest.fixture(scope="module")
def direct(trained_run):
    """The sampler's outputs, decoded and cut at the stop string, computed without the job."""
    ckpt = read_source(trained_run)
    model = SetDiffusionTransformer(ckpt.config)
    model.load_state_dict(ckpt.state_dict)
    tok = ckpt.tokenizer
    cfg = DecodingConfig(**DECODING, eos_token_ids=(tok.eos_id,), stop_sequences=(tuple(tok.encode(STOP)),))
    rows = (
        SetSampler(model.eval(), mask_token_id=tok.mask_id, context_len=ckpt.config.max_seq_len)
        .generate([tok.encode(p) for p in PROMPTS], cfg, batch_size=2)
        .rows
    )
    texts = [tok.decode(r.completion, skip_special_tokens=True) for r in rows]
    return {"predictions": [t[: t.find(STOP)] if STOP in t else t for t in texts], "rows": rows}


@pytest.fixture(scope="module")
def tasks(direct, tmp_path_factory):
    """References made from the outputs so that every metric scores some examples and misses others."""
    p = direct["predictions"]
    answer = gsm8k_answer
    references = [
        [p[0]],
        ["zzz qqq", " ".join(p[1].split()[: max(1, len(p[1].split()) // 2)])],
        ["#### 123456789"],
        [p[3] + " and some more words", "unrelated"],
        [f"so #### {answer(p[4])}" if answer(p[4]) else "#### 3"],
    ]
    path = tmp_path_factory.mktemp("tasks") / "tasks.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": q, "reference": r if len(r) > 1 else r[0], "id": n}) + "\n"
            for n, (q, r) in enumerate(zip(PROMPTS, references))
        )
    )
    return path, references


def job(trained_run, tasks, out, metric="rouge", **changes) -> GenerateJob:
    return GenerateJob(
        source=str(trained_run),
        tasks=str(tasks),
        out=str(out),
        metric=metric,
        decoding=dict(DECODING),  # over the model's policy, as the command line gives them
        stop=(STOP,),
        placement=Placement(batch_size=2, progress=False, **changes),
    )


@pytest.fixture(scope="module")
def one_process(trained_run, tasks, tmp_path_factory):
    out = tmp_path_factory.mktemp("one")
    return out, run_generate_job(job(trained_run, tasks[0], out))


def scored(out) -> list[dict]:
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("seconds", "busy_seconds")}
        for line in (out / "scored.jsonl").read_text().splitlines()
    ]


def without_timing(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k not in TIMING}


@pytest.mark.multiproc
def test_metrics_equal_a_direct_computation(trained_run, tasks, direct, one_process, tmp_path, capsys):
    out, rouge_metrics = one_process
    preds, refs, rows = direct["predictions"], tasks[1], direct["rows"]
    expected = {
        k: sum(max(scoring.rouge(p, r)[k] for r in rs) for p, rs in zip(preds, refs)) / len(preds)
        for k in scoring.ROUGE_KEYS
    }
    assert rouge_metrics["quality"] == pytest.approx(expected, abs=1e-12)
    assert 0 < expected["rouge1"] < 1  # the references hit some examples, not all
    assert rouge_metrics["tokens_per_step"] == sum(r.num_decoded for r in rows) / sum(r.steps for r in rows) > 1
    assert rouge_metrics["mean_nfe"] == sum(r.nfe for r in rows) / len(rows)
    assert rouge_metrics["tokens_per_s"] > 0 and rouge_metrics["batch_size"] == 2
    assert rouge_metrics["hardware"]["device"] == "cpu" and rouge_metrics["decoding"]["window"] == 4
    records = scored(out)
    assert [r["prediction"] for r in records] == preds and [r["id"] for r in records] == list(range(5))
    assert json.loads((out / "metrics.json").read_text()) == rouge_metrics

    # Another metric re-scores the stored generations (the sample job finds every prompt written).
    out = tmp_path / "out"
    shutil.copytree(one_process[0], out)
    exact = run_generate_job(job(trained_run, tasks[0], out, metric="exact"))
    assert "5 already written" in capsys.readouterr().err
    assert (
        exact["quality"]["exact_match"]
        == sum(max(scoring.exact_match(p, r) for r in rs) for p, rs in zip(preds, refs)) / 5
        >= 0.2
    )
    gsm8k = run_generate_job(job(trained_run, tasks[0], out, metric="gsm8k"))
    correct = [
        any(gsm8k_answer(p) is not None and gsm8k_answer(p) == gsm8k_answer(r) for r in rs)
        for p, rs in zip(preds, refs)
    ]
    assert gsm8k["quality"] == {"accuracy": sum(correct) / 5} and gsm8k["score_name"] == "accuracy"
    assert [r["accuracy"] for r in scored(out)] == [float(c) for c in correct]
    assert gsm8k["tokens_per_step"] == rouge_metrics["tokens_per_step"]


@pytest.mark.multiproc
def test_a_rerun_after_an_interruption_gives_the_same_metrics(trained_run, tasks, one_process, tmp_path, capsys):
    first = run_generate_job(job(trained_run, tasks[0], tmp_path, shard=0, num_shards=2))
    assert first is None and not (tmp_path / "metrics.json").exists()
    assert "shard 0 of 2 done" in capsys.readouterr().err
    metrics = run_generate_job(job(trained_run, tasks[0], tmp_path))
    assert "3 already written" in capsys.readouterr().err  # batches 0 and 2 (prompts 0, 1, 4) were shard 0's
    assert without_timing(metrics) == without_timing(one_process[1])
    assert scored(tmp_path) == scored(one_process[0])
    saved = (tmp_path / "metrics.json").read_bytes()
    assert run_generate_job(job(trained_run, tasks[0], tmp_path)) == metrics  # finished: nothing is redone
    assert "is up to date" in capsys.readouterr().err and (tmp_path / "metrics.json").read_bytes() == saved


@pytest.mark.multiproc
def test_a_job_finished_before_a_setting_existed_is_up_to_date(trained_run, tasks, tmp_path, capsys):
    """A whole decoding config in the job's record: a record without a setting at its default
    (as one written before the setting existed) is the same job, not one to decode again."""
    whole = replace(job(trained_run, tasks[0], tmp_path), decoding=DecodingConfig(**DECODING))
    run_generate_job(whole)
    record = json.loads((tmp_path / "metrics.json").read_text())
    assert record["settings"]["decoding"].pop("cache_infill_input") is False
    (tmp_path / "metrics.json").write_text(json.dumps(record))
    capsys.readouterr()
    assert run_generate_job(whole) == record and "is up to date" in capsys.readouterr().err
    changed = replace(whole, decoding=DecodingConfig(**{**DECODING, "threshold": 0.5}))
    with pytest.raises(UserError, match="holds results of other settings"):  # another decoding: not finished
        run_generate_job(changed)


@pytest.mark.multiproc
def test_two_processes_give_what_one_process_gives(trained_run, tasks, one_process, tmp_path):
    args = ["--tasks", tasks[0], "--metric", "rouge", "--out", tmp_path, "--nproc", "2", *ARGS]
    setdiff("eval", "generate", trained_run, *args, timeout=600)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["hardware"]["processes"] == 2
    same = {k: v for k, v in without_timing(metrics).items() if k != "hardware"}
    assert same == {k: v for k, v in without_timing(one_process[1]).items() if k != "hardware"}
    assert scored(tmp_path) == scored(one_process[0])


def run_cli(capsys, *args) -> tuple[int, str]:
    code = main(["eval", "generate", *args])
    return code, capsys.readouterr().err


@pytest.mark.parametrize(
    "content, fragment",
    [
        ('{"prompt": "a", "reference": "b"}\n{"prompt": \n', "tasks.jsonl:2: not valid JSON"),
        (
            '{"prompt": "a", "reference": "b"}\n\n{"prompt": "c"}\n',
            "tasks.jsonl:3: 'reference' must be a string or a non-empty list of strings (missing)",
        ),
        ('{"prompt": "a", "reference": []}\n', "tasks.jsonl:1: 'reference' must be"),
        ('{"prompt": 3, "reference": "b"}\n', "tasks.jsonl:1: 'prompt' must be a string"),
        ("\n", "holds no examples"),
    ],
)
def test_bad_task_files(tmp_path, capsys, content, fragment):
    (tmp_path / "tasks.jsonl").write_text(content)
    code, err = run_cli(
        capsys,
        str(tmp_path),
        "--tasks",
        str(tmp_path / "tasks.jsonl"),
        "--metric",
        "exact",
        "--out",
        str(tmp_path / "out"),
    )
    assert code == 2 and err.count("\n") == 1 and fragment in err, err


@pytest.mark.multiproc
def test_bad_options(tmp_path, capsys):
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "a", "reference": "b"}\n')
    common = [str(tmp_path), "--tasks", str(tasks), "--out", str(tmp_path / "out")]
    code, err = run_cli(
        capsys,
        *common[:1],
        "--tasks",
        str(tmp_path / "none.jsonl"),
        "--metric",
        "exact",
        "--out",
        str(tmp_path / "out"),
    )
    assert code == 2 and err.count("\n") == 1 and "none.jsonl does not exist" in err
    code, err = run_cli(capsys, *common, "--metric", "bleu")
    assert code == 2 and err.count("\n") == 1 and "--metric must be one of exact, rouge, gsm8k; got 'bleu'" in err
    assert not (tmp_path / "out").exists()


@pytest.mark.multiproc
def test_wandb_without_the_package_is_one_line(tmp_path, capsys):
    if importlib.util.find_spec("wandb") is not None:
        pytest.skip("wandb is installed here, so its missing-extra error cannot show")
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text('{"prompt": "a", "reference": "b"}\n')
    code, err = run_cli(
        capsys,
        str(tmp_path),
        "--tasks",
        str(tasks),
        "--out",
        str(tmp_path / "out"),
        "--metric",
        "exact",
        "--wandb-project",
        "p",
    )
    assert code == 2 and err.count("\n") == 1 and "pip install 'setdiff-megatron[wandb]'" in err, err
