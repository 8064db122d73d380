"""The DeepSpeed engine's inputs, without starting it: the generated DeepSpeed config, the
optimizer groups, and the one-line errors for recipes it cannot run."""

import sys
from pathlib import Path

import pytest
import torch

from setdiff_megatron.cli import main
from setdiff_megatron.errors import MissingExtraError
from setdiff_megatron.recipes import load_recipe, validate_recipe
from setdiff_megatron.recipes.validation import estimated_model_config, offload_host_bytes
from setdiff_megatron.training.engines.deepspeed_config import deepspeed_config, param_groups
from tests.conftest import debug_config

RECIPE = Path(__file__).parents[3] / "recipes" / "tiny-cpu-deepspeed.yaml"


def recipe(*overrides: str):
    return load_recipe(RECIPE, overrides)


def test_config_follows_the_recipe():
    config = deepspeed_config(
        recipe(
            "parallel.micro_batch_size=2",
            "parallel.global_batch_size=32",
            "parallel.zero_stage=3",
            "parallel.offload_optimizer=true",
            "train.clip_grad=0.5",
            "train.precision=bf16",
        ),
        dp_size=4,
    )
    assert (
        config["train_batch_size"],
        config["train_micro_batch_size_per_gpu"],
        config["gradient_accumulation_steps"],
    ) == (32, 2, 4)
    assert config["zero_optimization"] == {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": False}}
    assert config["gradient_clipping"] == 0.5
    assert config["bf16"] == {"enabled": True} and not config["fp16"]["enabled"]
    assert config["data_types"] == {"grad_accum_dtype": "fp32"}  # megatron's fp32 main grads
    fp32 = deepspeed_config(recipe("train.precision=fp32", "parallel.zero_stage=0"), dp_size=2)
    assert fp32["zero_optimization"] == {"stage": 0} and "data_types" not in fp32
    assert not fp32["bf16"]["enabled"] and fp32["gradient_accumulation_steps"] == 1
    fp16 = deepspeed_config(recipe("train.precision=fp16"), dp_size=2)["fp16"]
    assert fp16["enabled"] and fp16["loss_scale"] == 0 and fp16["initial_scale_power"] == 32  # dynamic, 2**32


def test_norms_take_no_weight_decay_as_in_megatron():
    from setdiff_megatron.models.torch_model import SetDiffusionTransformer

    model = SetDiffusionTransformer(debug_config(qk_norm=True))
    decay, no_decay = param_groups(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in no_decay["params"]} == {n for n, p in model.named_parameters() if p.dim() == 1}
    assert (decay["wd_mult"], no_decay["wd_mult"]) == (1.0, 0.0)
    assert len(decay["params"]) + len(no_decay["params"]) == len(list(model.parameters()))


def test_offload_estimate_and_rule():
    r = recipe("parallel.zero_stage=2", "parallel.offload_optimizer=true")
    need = offload_host_bytes(r, estimated_model_config(r).num_params())
    # 16 bytes per parameter, 2 processes on the node each holding half.
    assert need == 16 * r.model.to_model_config(vocab_size=r.data.vocab_size, mask_token_id=0).num_params()
    assert validate_recipe(r, has_gpu=False, host_memory=need) == []
    [error] = validate_recipe(r, has_gpu=False, host_memory=need - 1)
    assert error.startswith("parallel.offload_optimizer: the offloaded optimizer state needs about")


@pytest.mark.parametrize(
    "overrides,fragment",
    [
        (["parallel.tp=2"], "parallel: tensor and pipeline parallelism (tp, pp > 1) are megatron-engine features"),
        (["parallel.pp=2"], "are megatron-engine features"),
        (["parallel.zero_stage=4"], "parallel.zero_stage: Input should be 0, 1, 2 or 3 (got 4)"),
        (
            ["parallel.offload_optimizer=true", "model.hidden_size=8192", "model.num_layers=80", "model.num_heads=64"],
            "parallel.offload_optimizer: the offloaded optimizer state needs about",
        ),
        (
            ["parallel.offload_optimizer=true", "parallel.zero_stage=0"],
            "offloads only ZeRO-partitioned optimizer state",
        ),
        (
            ["engine=megatron", "parallel.zero_stage=0", "parallel.offload_optimizer=true"],
            "optimizer offload is a deepspeed-engine feature",
        ),
        (
            ["parallel.zero_stage=0", "train.precision=bf16"],
            "bf16 under engine deepspeed needs parallel.zero_stage >= 1",
        ),
        (
            ["engine=megatron", "parallel.zero_stage=0", "train.compile=true"],
            "train.compile: the deepspeed engine compiles its torch model",
        ),
        pytest.param(
            ["train.precision=fp16"],
            "DeepSpeed has no fp16 on the CPU",
            marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU-only rule"),
        ),
        (
            ["parallel.zero_stage=0", "parallel.distributed_optimizer=true"],
            "the optimizer is sharded by parallel.zero_stage",
        ),
    ],
)
def test_train_refuses_with_one_line(tmp_path, capsys, overrides, fragment):
    code = main(["train", str(RECIPE), f"checkpoint.dir={tmp_path / 'run'}", *overrides])
    err = capsys.readouterr().err
    assert code == 2 and fragment in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()


def test_missing_deepspeed_names_the_extra(monkeypatch):
    from setdiff_megatron.training.engines.deepspeed_engine import import_deepspeed

    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now raises ImportError
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")  # restored afterwards
    with pytest.raises(MissingExtraError, match=r"pip install 'setdiff-megatron\[deepspeed\]'"):
        import_deepspeed(recipe())
