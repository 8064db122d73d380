"""End to end with real runs (slow: each trains with the engine first).

  tiny-cpu at TP=2 -> `convert to-hf` -> loaded where setdiff_megatron is absent: query logits
      equal the checkpoint's torch model to 1e-4, generate() equals `setdiff sample` (on the
      checkpoint and on the export) token for token
  TP=2 checkpoint -> HF -> `convert from-hf --tp 1`: every tensor preserved exactly
  Qwen3 import -> `setdiff train` with model.init_from (the import, and the HF directory
      directly): the same starting loss, which a short adaptation run lowers
  a DeepSpeed-engine checkpoint -> HF (where that engine is installed)
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from setdiff_megatron.cli import main
from setdiff_megatron.hf import verify
from setdiff_megatron.checkpoint.source import read_source
from tests.hf.clean_env import run_clean
from tests.hf.conftest import ROOT, TINY_RECIPE
from tests.hf.test_export import CLEAN_SCRIPT
from tests.hf.tiny_models import TEXT

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

PROMPTS = ["def main():\n    ", "import os\n", "class Tree:\n"]
SAMPLE_ARGS = ["--max-new-tokens", "10", "--window", "4", "--threshold", "0.3", "--no-progress"]


def _sample(source: Path, prompts_file: Path, out: Path) -> list[str]:
    cmd = [sys.executable, "-m", "setdiff_megatron.cli", "sample", str(source), "--prompts", str(prompts_file),
           "--out", str(out), *SAMPLE_ARGS]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line)["completion"] for line in out.read_text().splitlines()]


def test_tp2_checkpoint_to_hf_and_back(trained_tp2, clean_site, tmp_path):
    export = tmp_path / "hf"
    assert main(["convert", "to-hf", str(trained_tp2), str(export), "--dtype", "fp32", "--check"]) == 0
    source = read_source(trained_tp2)
    assert source.layout["tp"] == 2

    # loaded without setdiff_megatron: logits and greedy decoding
    batch = verify.fixed_batch(source.config)
    save_file({"clean": batch.clean_tokens, "query": batch.query_tokens, "positions": batch.position_ids},
              str(tmp_path / "batch.safetensors"))
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    decoding = dict(max_new_tokens=10, window=4, threshold=0.3)
    result = run_clean(CLEAN_SCRIPT.format(export=str(export), work=str(tmp_path), decoding=decoding),
                       clean_site, tmp_path)
    assert result["has_setdiff"] is False
    logits = load_file(str(tmp_path / "clean_logits.safetensors"))["logits"]
    expected = verify.query_logits(verify.torch_model(source.config, source.state_dict), batch)
    assert (logits - expected).abs().max() < 1e-4
    hf_completions = [source.tokenizer.decode(row[len(p):], skip_special_tokens=True)
                      for row, p in zip(result["rows"], prompts)]
    prompts_file = tmp_path / "prompts.jsonl"
    prompts_file.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    assert _sample(trained_tp2, prompts_file, tmp_path / "from_checkpoint.jsonl") == hf_completions
    assert _sample(export, prompts_file, tmp_path / "from_export.jsonl") == hf_completions

    # back to megatron at another layout: every tensor exactly
    back = tmp_path / "megatron_tp1"
    assert main(["convert", "from-hf", str(export), str(back), "--tp", "1", "--check"]) == 0
    again = read_source(back)
    assert again.layout["tp"] == 1 and again.config == source.config
    assert again.state_dict.keys() == source.state_dict.keys()
    assert all(torch.equal(again.state_dict[k], source.state_dict[k]) for k in source.state_dict)


def _final_metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "logs" / "metrics.jsonl").read_text().splitlines()]


def _adapt(run: Path, init_from: Path, tokenizer: Path, data: Path, steps: int) -> list[tuple[int, float]]:
    cmd = [sys.executable, "-m", "setdiff_megatron.cli", "train", str(TINY_RECIPE), f"checkpoint.dir={run}",
           "log.tensorboard=false", "launch.nproc_per_node=1", "model.hidden_size=64", "model.num_layers=2",
           "model.num_heads=4", "model.num_kv_heads=2", "model.head_dim=24", "model.intermediate_size=96",
           "model.qk_norm=true", "model.tie_embeddings=true", "model.rope_theta=50000", "model.max_seq_len=128",
           f"model.init_from={init_from}", f"data.datasets=[{{path: {data}}}]", f"data.tokenizer={tokenizer}",
           "data.seq_len=64", "data.split=90,10,0", "parallel.micro_batch_size=4", "parallel.global_batch_size=8",
           f"train.steps={steps}", "train.lr=3e-3", "train.warmup_steps=2", f"eval.interval={steps}",
           "eval.batches=2", "checkpoint.interval=1000", "log.interval=5"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "initialised from" in proc.stdout
    return [(m["step"], m["valid/loss"]) for m in _final_metrics(run) if "valid/loss" in m]


def test_adaptation_from_an_imported_qwen3(ar_dirs, tmp_path):
    imported = tmp_path / "qwen3-setdiff"
    assert main(["convert", "from-hf", str(ar_dirs["qwen3"]), str(imported), "--check"]) == 0
    tokenizer = imported / "checkpoints" / "step_00000000" / "tokenizer"
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"text": t * 3}) + "\n" for t in TEXT * 4))
    proc = subprocess.run([sys.executable, "-m", "setdiff_megatron.cli", "preprocess", "--input", str(corpus),
                           "--output-dir", str(tmp_path / "data"), "--tokenizer", str(tokenizer), "--no-new-tokens",
                           "--quiet"], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    curve = _adapt(tmp_path / "run", imported, tokenizer, tmp_path / "data" / "corpus", steps=15)
    (first_step, first), (last_step, last) = curve[0], curve[-1]
    assert first_step == 0 and last_step == 15 and last < first - 0.5, curve
    # model.init_from straight from the Hugging Face directory starts from the same weights
    direct = _adapt(tmp_path / "run_direct", ar_dirs["qwen3"], ar_dirs["qwen3"], tmp_path / "data" / "corpus", steps=1)
    assert abs(direct[0][1] - first) < 1e-5, (direct, curve)


def test_qwen2_biases_through_megatron_at_tp2(ar_dirs, tmp_path, capsys):
    """q/k/v biases split over two TP ranks: the megatron body reproduces the torch model."""
    assert main(["convert", "from-hf", str(ar_dirs["qwen2"]), str(tmp_path / "q2"), "--tp", "2", "--check"]) == 0
    printed = capsys.readouterr().out
    assert "megatron model vs converted torch model (query logits)" in printed and "MISMATCH" not in printed
    assert read_source(tmp_path / "q2").config.qkv_bias


def test_deepspeed_checkpoint_to_hf(tmp_path):
    pytest.importorskip("deepspeed")
    run = tmp_path / "ds"
    cmd = [sys.executable, "-m", "setdiff_megatron.cli", "train", str(TINY_RECIPE), "engine=deepspeed",
           "parallel.distributed_optimizer=false", "parallel.zero_stage=1", f"checkpoint.dir={run}",
           "log.tensorboard=false", "launch.nproc_per_node=1", "parallel.global_batch_size=8",
           "parallel.micro_batch_size=4", "train.steps=2", "eval.interval=1000", "eval.batches=1",
           "checkpoint.interval=1000"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert main(["convert", "to-hf", str(run), str(tmp_path / "hf"), "--check"]) == 0
    assert read_source(run).kind == "deepspeed"
