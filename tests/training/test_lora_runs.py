"""LoRA runs end to end (model.lora, models/lora.py), as a user trains them: the main job's recipe on
its shipped AR base, 2 processes data parallel, under both engines; only adapters in the
checkpoints, an exact resume from the base read again, and a Hugging Face export whose merged
weights give the adapted model's logits."""

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from setdiff_megatron.models.lora import adapt_torch_model, is_adapter_key
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sources.megatron_checkpoints import adapter_weights
from setdiff_megatron.sources.read import fit_source, read_source
from tests.cli_runs import setdiff
from tests.training.test_supervised_runs import ROOT, losses
from tests.training.test_supervised_runs import train as train_reasoning

BASE = ROOT / "assets" / "reasoning-ar-base"
LORA = (
    "checkpoint.interval=2",
    "eval.showcase_problems=0",
    "train.precision=fp32",
    f"model.init_from={BASE}",
    "model.lora.rank=4",
    "model.lora.alpha=8",
)

pytestmark = pytest.mark.multiproc


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.getbasetemp() / "checkpoint-tests-data"  # the built-in corpora, shared


def train(run_dir: Path, data_cache: Path, *overrides: str) -> list[dict]:
    """The main job's recipe on 3 steps of 8 rows (test_supervised_runs.py), with LoRA on its base."""
    return train_reasoning(run_dir, data_cache, *LORA, *overrides)


@pytest.fixture(scope="module")
def megatron_run(tmp_path_factory, data_cache) -> tuple[Path, list[dict]]:
    run = tmp_path_factory.mktemp("lora") / "megatron"
    return run, train(run, data_cache)


def _step(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def test_megatron_trains_and_saves_the_adapters_alone(megatron_run):
    run, metrics = megatron_run
    valid = losses(metrics, "valid/loss")
    assert len(losses(metrics)) == 3 and valid[-1] < valid[0] - 0.05, valid
    keys = dcp.FileSystemReader(str(_step(run, 3))).read_metadata().state_dict_metadata
    tensors = [k for k in keys if not k.startswith("optimizer.") or "state" in k.split(".")[1]]
    assert tensors and all(is_adapter_key(k) for k in tensors if not k.startswith("optimizer.param_groups")), keys
    # Adapters and their Adam moments, against a full fine-tune's fp32 weights and moments.
    saved = sum(f.stat().st_size for f in _step(run, 3).glob("*.distcp"))
    full = 3 * 4 * sum(t.numel() for t in read_source(BASE).state_dict.values())
    assert saved < 0.2 * full, (saved, full)


@pytest.mark.slow  # 15 s; resuming a run exactly is in the default suite (engines/test_megatron.py)
def test_a_resumed_lora_run_reads_its_base_again_and_continues_exactly(megatron_run, tmp_path, data_cache):
    """Were a base weight trained, the uninterrupted run would differ from one resumed on the
    base read again from model.init_from."""
    run, metrics = megatron_run
    resumed = losses(train(tmp_path / "resumed", data_cache, f"checkpoint.resume={_step(run, 2)}"))
    assert resumed == losses(metrics)[2:], (resumed, losses(metrics))


@pytest.mark.slow  # a third run; the megatron run and its export carry the default suite's LoRA claims
def test_deepspeed_trains_the_same_adapters_and_saves_them_alone(megatron_run, tmp_path, data_cache):
    """One seed draws the same adapters under both engines: the same losses, step by step."""
    _, reference = megatron_run
    run = tmp_path / "deepspeed"
    got = losses(train(run, data_cache, "engine=deepspeed", "parallel.zero_stage=1"))
    assert max(abs(a - b) for a, b in zip(got, losses(reference))) <= 2e-5, (got, losses(reference))
    module = torch.load(_step(run, 3) / "deepspeed" / "mp_rank_00_model_states.pt", weights_only=True)["module"]
    assert module and all(is_adapter_key(k) for k in module), sorted(module)


def test_the_hf_export_of_a_lora_run_gives_the_adapted_models_logits(megatron_run, tmp_path):
    """The export's merged weights (a bf16 base trained in fp32: exported in fp32) against the base
    with the checkpoint's adapters running on it."""
    run, _ = megatron_run
    hf = tmp_path / "hf"
    setdiff("convert", "to-hf", run, hf, timeout=600)
    trained = read_source(run, weights=False)
    adapted = SetDiffusionTransformer(trained.config)
    adapted.load_state_dict(fit_source(read_source(BASE), trained.config, trained.tokenizer))
    adapt_torch_model(adapted, trained.recipe.model.lora.spec(), seed=0)
    adapters = adapter_weights(_step(run, 3))
    assert any(v.abs().max() > 0 for k, v in adapters.items() if k.endswith(".B"))  # trained
    adapted.load_state_dict(adapters, strict=False)
    export = read_source(hf)
    merged = SetDiffusionTransformer(export.config)
    merged.load_state_dict(export.state_dict)
    gen = torch.Generator().manual_seed(0)
    clean = torch.randint(0, export.config.vocab_size - 1, (2, 32), generator=gen)
    positions = torch.stack([torch.randperm(32, generator=gen) for _ in range(2)])
    query = torch.full_like(clean, export.config.mask_token_id)
    # In float64, so that only the export's float32 rounding of W0 + scale B A is measured.
    with torch.no_grad():
        diff = merged.double()(clean, query, positions) - adapted.double()(clean, query, positions)
    assert diff.abs().max() <= 1e-5, diff.abs().max()
