"""End to end with real runs (slow: each trains with the engine first).

tiny-cpu at TP=2 -> `convert to-hf` -> loaded where setdiff_megatron is absent: query logits
    equal the checkpoint's torch model to 1e-4, generate() equals `setdiff sample` (on the
    checkpoint and on the export) token for token
TP=2 checkpoint -> HF -> `convert from-hf`: every tensor preserved exactly
Qwen3 import -> `setdiff train` with model.init_from (the import, and the HF directory
    directly), and resuming the import at TP=2: the same starting loss, which a short
    adaptation run lowers
Qwen2 import (q/k/v biases) -> `setdiff sample --tp 2`: the one-process checkpoint, resharded
    on load, decodes what the torch model decodes
a DeepSpeed-engine checkpoint -> HF (where that engine is installed)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from setdiff_megatron.cli import main
from setdiff_megatron.hf import verify
from setdiff_megatron.sources.read import read_source
from tests.cli_runs import setdiff
from tests.hf.clean_env import run_clean
from tests.hf.conftest import TINY_RECIPE, convert_from_hf
from tests.hf.test_export import CLEAN_SCRIPT
from tests.hf.tiny_models import TEXT

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

PROMPTS = ["def main():\n    ", "import os\n", "class Tree:\n"]
SAMPLE_ARGS = ["--max-new-tokens", "10", "--window", "4", "--threshold", "0.3", "--no-progress"]


def _sample(source: Path, prompts_file: Path, out: Path, *layout: str) -> list[str]:
    setdiff("sample", source, "--prompts", prompts_file, "--out", out, *SAMPLE_ARGS, *layout, timeout=600)
    return [json.loads(line)["completion"] for line in out.read_text().splitlines()]


def test_tp2_checkpoint_to_hf_and_back(trained_tp2, clean_site, tmp_path):
    export = tmp_path / "hf"
    assert main(["convert", "to-hf", str(trained_tp2), str(export), "--dtype", "fp32", "--check"]) == 0
    source = read_source(trained_tp2)
    assert source.layout["tp"] == 2

    # loaded without setdiff_megatron: logits and greedy decoding
    batch = verify.fixed_batch(source.config)
    save_file(
        {"clean": batch.clean_tokens, "query": batch.query_tokens, "positions": batch.position_ids},
        str(tmp_path / "batch.safetensors"),
    )
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    decoding = dict(max_new_tokens=10, window=4, threshold=0.3)
    result = run_clean(
        CLEAN_SCRIPT.format(export=str(export), work=str(tmp_path), decoding=decoding), clean_site, tmp_path
    )
    assert result["has_setdiff"] is False
    logits = load_file(str(tmp_path / "clean_logits.safetensors"))["logits"]
    expected = verify.query_logits(verify.torch_model(source.config, source.state_dict), batch)
    assert (logits - expected).abs().max() < 1e-4
    hf_completions = [
        source.tokenizer.decode(row[len(p) :], skip_special_tokens=True) for row, p in zip(result["rows"], prompts)
    ]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert _sample(trained_tp2, prompts_file, tmp_path / "from_checkpoint.jsonl") == hf_completions
    assert _sample(export, prompts_file, tmp_path / "from_export.jsonl") == hf_completions

    # back to megatron, written by one process: every tensor exactly
    back = tmp_path / "megatron_tp1"
    proc = convert_from_hf(export, back, "--check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = read_source(back)
    assert again.layout["tp"] == 1 and again.config == source.config
    assert again.state_dict.keys() == source.state_dict.keys()
    assert all(torch.equal(again.state_dict[k], source.state_dict[k]) for k in source.state_dict)


def _final_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]


def _adapt(run: Path, tokenizer: Path, data: Path, steps: int, *start: str) -> tuple[list[tuple[int, float]], str]:
    """A tiny-cpu run of the Qwen3 test model's shape (its 307 embedding rows included, which a
    resume's model must have), started as `start` says (model.init_from or checkpoint.resume, and
    a layout): its validation losses and its console output."""
    proc = setdiff(
        "train",
        TINY_RECIPE,
        f"checkpoint.dir={run}",
        "log.tensorboard=false",
        "launch.nproc_per_node=1",
        "model.vocab_size=307",
        "model.hidden_size=64",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.head_dim=24",
        "model.intermediate_size=96",
        "model.qk_norm=true",
        "model.tie_embeddings=true",
        "model.rope_theta=50000",
        "model.max_seq_len=128",
        f"data.datasets=[{{path: {data}}}]",
        f"data.tokenizer={tokenizer}",
        "data.seq_len=64",
        "data.split=90,10,0",
        "parallel.micro_batch_size=4",
        "parallel.global_batch_size=8",
        f"train.steps={steps}",
        "train.lr=3e-3",
        "train.warmup_steps=2",
        f"eval.interval={steps}",
        "eval.batches=2",
        "checkpoint.interval=1000",
        "log.interval=5",
        *start,
    )
    return [(m["step"], m["valid/loss"]) for m in _final_metrics(run) if "valid/loss" in m], proc.stdout


def test_adaptation_from_an_imported_qwen3(ar_dirs, tmp_path):
    imported = tmp_path / "qwen3-setdiff"
    proc = convert_from_hf(ar_dirs["qwen3"], imported, "--check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    step = imported / "checkpoints" / "step_00000000"
    tokenizer = step / "tokenizer"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in TEXT * 4))
    setdiff(
        "preprocess",
        "--input",
        corpus,
        "--output-dir",
        tmp_path / "data",
        "--tokenizer",
        tokenizer,
        "--no-new-tokens",
        "--quiet",
        timeout=600,
    )
    data = tmp_path / "data" / "corpus"
    curve, printed = _adapt(tmp_path / "run", tokenizer, data, 15, f"model.init_from={imported}")
    (first_step, first), (last_step, last) = curve[0], curve[-1]
    assert "initialised from" in printed and first_step == 0 and last_step == 15 and last < first - 0.5, curve
    # model.init_from straight from the Hugging Face directory starts from the same weights
    direct, _ = _adapt(tmp_path / "run_direct", ar_dirs["qwen3"], data, 1, f"model.init_from={ar_dirs['qwen3']}")
    assert abs(direct[0][1] - first) < 1e-5, (direct, curve)
    # the engine resumes the one-process import at TP=2: dist_checkpointing reshards it on load
    resumed, printed = _adapt(
        tmp_path / "run_tp2",
        tokenizer,
        data,
        1,
        f"checkpoint.resume={step}",
        "launch.nproc_per_node=2",
        "parallel.tp=2",
    )
    assert "saved at tp 1 pp 1 vpp 1 dp 1, weights only, into tp 2" in printed, printed[-2000:]
    assert abs(resumed[0][1] - first) < 1e-5, (resumed, curve)


def test_qwen2_biases_through_megatron_at_tp2(ar_dirs, tmp_path):
    """q/k/v biases split over two TP ranks: the import, written by one process and resharded on
    load by `setdiff sample --tp 2`, decodes what the torch model decodes, token for token."""
    imported = tmp_path / "q2"
    proc = convert_from_hf(ar_dirs["qwen2"], imported, "--check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "megatron model vs converted torch model (query logits)" in proc.stdout
    assert read_source(imported).config.qkv_bias
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    tp2 = _sample(imported, prompts_file, tmp_path / "tp2.jsonl", "--nproc", "2", "--tp", "2")
    assert tp2 == _sample(imported, prompts_file, tmp_path / "tp1.jsonl")


def test_deepspeed_checkpoint_to_hf(tmp_path):
    pytest.importorskip("deepspeed")
    run = tmp_path / "ds"
    setdiff(
        "train",
        TINY_RECIPE,
        "engine=deepspeed",
        "parallel.distributed_optimizer=false",
        "parallel.zero_stage=1",
        f"checkpoint.dir={run}",
        "log.tensorboard=false",
        "launch.nproc_per_node=1",
        "parallel.global_batch_size=8",
        "parallel.micro_batch_size=4",
        "train.steps=2",
        "eval.interval=1000",
        "eval.batches=1",
        "checkpoint.interval=1000",
    )
    assert main(["convert", "to-hf", str(run), str(tmp_path / "hf"), "--check"]) == 0
    assert read_source(run).kind == "deepspeed"
