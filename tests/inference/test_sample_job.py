"""`setdiff sample` on a checkpoint trained by the tiny-cpu recipe at TP=2: the command's
outputs against the sampler itself, across process counts and TP sizes, resumed, and its
one-line errors on bad input."""

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.sources.read import read_source
from tests.cli_runs import setdiff

pytestmark = pytest.mark.multiproc

PROMPTS = [
    {"prompt": "def main(", "id": "a"},
    {"prompt": "import os\n"},
    {"segments": ["class Foo:\n    def ", 5, "(self):\n        return 1\n"], "id": "infill"},
    {"prompt": ""},
    {"prompt": "    for i in range("},
]
DECODING = [
    "--max-new-tokens",
    "12",
    "--window",
    "4",
    "--threshold",
    "0.3",
    "--tokens-per-step",
    "2",
    "--batch-size",
    "2",
]


@pytest.fixture(scope="module")
def run_dir(trained_run) -> Path:
    return trained_run


@pytest.fixture
def prompts(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


def sample(source, prompts, out, *args, nproc=1, progress=False) -> subprocess.CompletedProcess:
    quiet = [] if progress else ["--no-progress"]
    options = ["--prompts", prompts, "--out", out, *quiet, *DECODING, "--nproc", str(nproc)]
    return setdiff("sample", source, *options, *args, timeout=600, check=False)


def outputs(path: Path) -> list[dict]:
    """The records without their timings."""
    return [
        {k: v for k, v in json.loads(line).items() if k not in ("seconds", "busy_seconds")}
        for line in path.read_text().splitlines()
    ]


@pytest.fixture(scope="module")
def one_process(run_dir, tmp_path_factory) -> list[dict]:
    tmp = tmp_path_factory.mktemp("one")
    (tmp / "p.jsonl").write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    proc = sample(run_dir, tmp / "p.jsonl", tmp / "o.jsonl", progress=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote 5 results" in proc.stderr
    # stderr is a pipe: the progress is whole lines (prompts done, rate, elapsed), no carriage return
    assert "\r" not in proc.stderr and any(line.startswith("5/5 prompt, ") for line in proc.stderr.splitlines())
    return outputs(tmp / "o.jsonl")


def test_outputs_are_the_samplers_in_prompt_order(run_dir, one_process):
    ckpt = read_source(run_dir)
    assert ckpt.layout["tp"] == 2
    model = SetDiffusionTransformer(ckpt.config)
    model.load_state_dict(ckpt.state_dict)
    tok = ckpt.tokenizer
    encoded = [
        tok.encode(p["prompt"])
        if "prompt" in p
        else tok.encode(p["segments"][0]) + [tok.mask_id] * 5 + tok.encode(p["segments"][2])
        for p in PROMPTS
    ]
    cfg = DecodingConfig(window=4, threshold=0.3, tokens_per_step=2, max_new_tokens=12, eos_token_ids=(tok.eos_id,))
    rows = (
        SetSampler(model.eval(), mask_token_id=tok.mask_id, context_len=ckpt.config.max_seq_len)
        .generate(encoded, cfg)
        .rows
    )
    assert [r["index"] for r in one_process] == list(range(5))
    assert [r.get("id") for r in one_process] == ["a", None, "infill", None, None]
    for record, row in zip(one_process, rows):
        assert record["completion"] == tok.decode(row.completion, skip_special_tokens=True)
        assert record["nfe"] == row.nfe and record["num_decoded"] == row.num_decoded
    infill = one_process[2]
    masked = [i for i, t in enumerate(encoded[2]) if t == tok.mask_id]
    assert infill["infills"] == [tok.decode([rows[2].tokens[i] for i in masked])]
    assert all(r["tokens_per_step"] > 1 for r in one_process)


def test_two_processes_write_what_one_process_writes(run_dir, prompts, tmp_path, one_process):
    proc = sample(run_dir, prompts, tmp_path / "o.jsonl", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert outputs(tmp_path / "o.jsonl") == one_process


def test_tensor_parallel_sampling_equals_tp1(run_dir, prompts, tmp_path, one_process):
    proc = sample(run_dir, prompts, tmp_path / "o.jsonl", "--tp", "2", nproc=2)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert outputs(tmp_path / "o.jsonl") == one_process


@pytest.mark.slow  # 15 s; eval generate's rerun after an interruption is in the default suite (test_generate.py)
def test_a_rerun_skips_what_was_written(run_dir, prompts, tmp_path, one_process):
    out = tmp_path / "o.jsonl"
    first = sample(run_dir, prompts, out, "--shard", "0", "--num-shards", "2")
    assert first.returncode == 0 and "shard 0 of 2 done" in first.stderr and not out.exists()
    # Batches 0 and 2 (prompts 0, 1, 4) were shard 0's; the rerun does only prompts 2 and 3.
    rerun = sample(run_dir, prompts, out)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "3 already written" in rerun.stderr
    assert outputs(out) == one_process
    again = sample(run_dir, prompts, out)
    assert "5 already written" in again.stderr and outputs(out) == one_process


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--window", "0"], "decoding option: window must be >= 1"),
        (["--tokens-per-step", "0"], "tokens_per_step must be >= 1"),
        (["--threshold", "1.5"], "threshold must be in (0, 1]"),
        (["--tp", "2"], "--tp 2 needs a multiple of 2 processes; this job has 1"),
        (["--nproc", "0"], "--nproc must be >= 1"),
    ],
)
def test_bad_options_fail_with_one_line_and_keep_outputs(run_dir, prompts, tmp_path, args, fragment):
    out = tmp_path / "o.jsonl"
    proc = sample(run_dir, prompts, out, *args)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and fragment in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    "content, fragment",
    [
        ("", "holds no prompts"),
        ('{"prompt": "a"}\n{"prompt": \n', "prompts.jsonl:2: not valid JSON"),
    ],
)
def test_bad_prompt_files(run_dir, tmp_path, content, fragment):
    (tmp_path / "prompts.jsonl").write_text(content)
    proc = sample(run_dir, tmp_path / "prompts.jsonl", tmp_path / "o.jsonl")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and fragment in proc.stderr


def test_a_prompt_longer_than_the_context(run_dir, tmp_path):
    (tmp_path / "prompts.jsonl").write_text(
        json.dumps({"prompt": "ok"}) + "\n" + json.dumps({"prompt": "x = 1\n" * 200}) + "\n"
    )
    proc = sample(run_dir, tmp_path / "prompts.jsonl", tmp_path / "o.jsonl")
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1
    assert "prompts.jsonl:2: the prompt is longer than the context" in proc.stderr


def test_bad_sources(run_dir, prompts, tmp_path):
    step = next((run_dir / "checkpoints").glob("step_*"))
    broken = tmp_path / "broken"
    shutil.copytree(step, broken)
    shutil.rmtree(broken / "tokenizer")
    proc = sample(broken, prompts, tmp_path / "o.jsonl")
    assert proc.returncode == 2 and "tokenizer" in proc.stderr and proc.stderr.count("\n") == 1
    proc = sample(tmp_path / "nowhere", prompts, tmp_path / "o.jsonl")
    assert proc.returncode == 2 and "does not exist" in proc.stderr


def test_other_settings_do_not_mix_into_an_output(run_dir, prompts, tmp_path, one_process):
    out = tmp_path / "o.jsonl"
    assert sample(run_dir, prompts, out).returncode == 0
    proc = sample(run_dir, prompts, out, "--window", "8")
    assert proc.returncode == 2 and "holds results of other settings" in proc.stderr
    assert outputs(out) == one_process
