"""The DiT layout end to end on a CPU (slow: each test trains first). recipes/tiny-dit-cpu.yaml
with the LM1B models' adaLN trains through the megatron engine and through the DeepSpeed engine
with its loss falling and its modulations moving off their zero start; the megatron run exports
to Hugging Face format (--check: transformers loads the generated modeling file), imports back
(--check: the megatron body on the check batch) and samples, the export's generate() decoding
what the imported checkpoint's torch model decodes."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from setdiff_megatron.cli import main
from setdiff_megatron.hf import verify
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.sources.read import read_source
from tests.cli_runs import setdiff
from tests.hf.conftest import ROOT, convert_from_hf

pytestmark = [pytest.mark.slow, pytest.mark.multiproc]

RECIPE = ROOT / "recipes" / "tiny-dit-cpu.yaml"
STEPS = 30
SHORT = (
    "launch.nproc_per_node=1",
    f"train.steps={STEPS}",
    "train.warmup_steps=5",
    "log.interval=1",
    "eval.interval=1000",
    f"checkpoint.interval={STEPS}",
    "log.tensorboard=false",
    "model.adaln=true",
)
DECODING = dict(max_new_tokens=8, window=4, threshold=0.3)
PROMPTS = ("def main():\n    ", "import os\n")


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """The built-in corpus of recipes/tiny-cpu.yaml, shared with the training tests' runs."""
    return tmp_path_factory.getbasetemp() / "checkpoint-tests-data"


def train(run: Path, data_cache: Path, *overrides: str) -> Path:
    """`setdiff train` of the recipe for STEPS steps; its loss must fall by half a nat and every
    adaLN modulation must have left zero."""
    setdiff("train", RECIPE, f"checkpoint.dir={run}", f"data.cache_dir={data_cache}", *SHORT, *overrides, timeout=1500)
    lines = (run / "logs" / "metrics.jsonl").read_text().splitlines()
    losses = [m["train/loss"] for m in map(json.loads, lines) if "train/loss" in m]
    assert len(losses) == STEPS and sum(losses[-5:]) / 5 < sum(losses[:5]) / 5 - 0.5, losses
    state = read_source(run).state_dict
    modulations = [k for k in state if "modulation" in k]
    assert len(modulations) == 2 * 4 + 2 and all(state[k].abs().max() > 1e-4 for k in modulations)
    return run


def decode(source) -> list[list[int]]:
    tok = source.tokenizer
    sampler = SetSampler(
        verify.torch_model(source.config, source.state_dict),
        mask_token_id=tok.mask_id,
        context_len=source.config.max_seq_len,
    )
    cfg = DecodingConfig(eos_token_ids=(tok.eos_id,), **DECODING)
    return [row.tokens for row in sampler.generate([tok.encode(p) for p in PROMPTS], cfg).rows]


def test_megatron_run_trains_exports_imports_back_and_samples(tmp_path, data_cache):
    import transformers

    run = train(tmp_path / "megatron", data_cache)
    source = read_source(run)
    assert (source.config.norm, source.config.mlp, source.config.output_bias, source.config.adaln) == (
        "layernorm",
        "gelu",
        True,
        True,
    )
    export = tmp_path / "hf"
    assert main(["convert", "to-hf", str(run), str(export), "--dtype", "fp32", "--check"]) == 0
    back = tmp_path / "back"
    proc = convert_from_hf(export, back, "--check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    again = read_source(back)
    assert again.config == source.config
    assert all(torch.equal(again.state_dict[k], source.state_dict[k]) for k in source.state_dict)
    model = transformers.AutoModel.from_pretrained(str(export), trust_remote_code=True, dtype=torch.float32)
    prompts = [source.tokenizer.encode(p) for p in PROMPTS]
    exported = [row.tokens for row in model.generate(prompts, return_dict_in_generate=True, **DECODING).rows]
    assert exported == decode(again) and all(len(r) > len(p) for r, p in zip(exported, prompts))


def test_deepspeed_run_trains_and_samples(tmp_path, data_cache):
    run = train(tmp_path / "deepspeed", data_cache, "engine=deepspeed", "parallel.distributed_optimizer=false")
    source = read_source(run)
    assert source.kind == "deepspeed" and source.config.mlp_bias
    assert all(len(r) > len(source.tokenizer.encode(p)) for r, p in zip(decode(source), PROMPTS))
