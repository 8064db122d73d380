"""Export to Hugging Face format: the files, loading in a Python without setdiff_megatron, logit
and greedy-decoding parity (of a dense model, a mixture of experts and the DiT layout), the export
loader, and one-line errors."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from setdiff_megatron.cli import main
from setdiff_megatron.hf import verify
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.sources.hf_config import MOE_CONFIG_KEYS
from setdiff_megatron.sources.hf_export import load_hf_export
from tests.hf.clean_env import run_clean

DECODING = dict(max_new_tokens=10, window=4, threshold=0.3)
EXPORTS = ("export_dir", "moe_export_dir", "dit_export_dir")

CLEAN_SCRIPT = """
import json, sys
try:
    import setdiff_megatron
    has_setdiff = True
except ImportError:
    has_setdiff = False
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

export, work = sys.argv[1] if len(sys.argv) > 1 else {export!r}, {work!r}
model = AutoModelForCausalLM.from_pretrained(export, trust_remote_code=True, dtype=torch.float32)
tokenizer = AutoTokenizer.from_pretrained(export, trust_remote_code=True)
batch = load_file(work + "/batch.safetensors")
with torch.no_grad():
    logits = model(batch["clean"], position_ids=batch["positions"], query_ids=batch["query"]).logits
save_file({{"logits": logits.contiguous()}}, work + "/clean_logits.safetensors")
prompts = json.load(open(work + "/prompts.json"))
out = model.generate(prompts, return_dict_in_generate=True, **{decoding!r})
padded = model.generate(torch.tensor([prompts[0]]), max_new_tokens=3, window=2)
print(json.dumps({{
    "has_setdiff": has_setdiff,
    "setdiff_modules": sorted(m for m in sys.modules if m.startswith(("setdiff", "megatron", "deepspeed"))),
    "rows": [r.tokens for r in out.rows], "mask_token": tokenizer.mask_token, "mask_id": tokenizer.mask_token_id,
    "padded_shape": list(padded.shape), "generation_window": model.generation_config.window,
}}))
"""


def _reference(source, prompts: list[list[int]]):
    model = verify.torch_model(source.config, source.state_dict)
    cfg = DecodingConfig(eos_token_ids=(source.tokenizer.eos_id,), **DECODING)
    return SetSampler(model, mask_token_id=source.config.mask_token_id, context_len=source.config.max_seq_len).generate(
        prompts, cfg
    )


def _prompts(source) -> list[list[int]]:
    tok = source.tokenizer
    return [
        tok.encode("def add(a, b):\n"),
        tok.encode("import os"),
        tok.encode("for i in") + [tok.mask_id] * 3 + tok.encode(":"),
    ]


def test_export_files(export_dir):
    out, source = export_dir
    names = {p.name for p in out.iterdir()}
    assert {
        "config.json",
        "configuration_setdiff.py",
        "modeling_setdiff.py",
        "model.safetensors.index.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "setdiff_tokenizer.json",
        "README.md",
    } <= names
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert "lm_head.weight" in index["weight_map"] and "model.embed_tokens.weight" in index["weight_map"]
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "setdiff" and config["mask_token_id"] == source.tokenizer.mask_id
    assert config["auto_map"]["AutoModel"] == "modeling_setdiff.SetDiffModel"
    assert set(config["auto_map"]) == {"AutoConfig", "AutoModel", "AutoModelForCausalLM"}
    generation = json.loads((out / "generation_config.json").read_text())
    assert generation["window"] == 16 and generation["do_sample"] is False
    assert "```yaml" in (out / "README.md").read_text()


def test_config_json_holds_every_moe_field(export_dir, moe_export_dir):
    """An MoE export's config.json has each MoE field of ModelConfig (moe_layer_freq as its list);
    a dense export's has none."""
    moe_fields = {f.name for f in dataclasses.fields(ModelConfig) if f.name.startswith("moe_") or "experts" in f.name}
    assert set(MOE_CONFIG_KEYS.values()) == moe_fields
    out, source = moe_export_dir
    config = json.loads((out / "config.json").read_text())
    assert {k: config[k] for k in MOE_CONFIG_KEYS} == {k: getattr(source.config, f) for k, f in MOE_CONFIG_KEYS.items()}
    assert config["moe_layer_freq"] == [0, 1] and "Mixture of experts in layers [1]" in (out / "README.md").read_text()
    assert not set(MOE_CONFIG_KEYS) & set(json.loads((export_dir[0] / "config.json").read_text()))
    assert "adaln" not in json.loads((export_dir[0] / "config.json").read_text())


def test_config_json_holds_the_dit_layout(dit_export_dir):
    out, source = dit_export_dir
    config = json.loads((out / "config.json").read_text())
    assert (config["norm"], config["mlp"], config["mlp_bias"], config["output_bias"]) == (
        "layernorm",
        "gelu",
        True,
        True,
    )
    assert config["hidden_act"] == "gelu_pytorch_tanh" and config["rms_norm_eps"] == source.config.norm_eps
    assert (config["adaln"], config["adaln_cond_dim"]) == (True, 16)
    weight_map = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    assert {"lm_head.bias", "model.layers.0.mlp.up_proj.bias", "model.layers.0.mlp.down_proj.bias"} <= set(weight_map)
    assert {"model.time_embedding.linear_1.weight", "model.layers.1.adaln_modulation.bias"} <= set(weight_map)
    assert "model.norm_modulation.weight" in weight_map and "model.layers.0.mlp.gate_proj.weight" not in weight_map


@pytest.mark.parametrize("export", EXPORTS)
def test_export_loader_round_trip_is_exact(export, request):
    out, source = request.getfixturevalue(export)
    cfg, state, tokenizer = load_hf_export(out)
    assert cfg == source.config and tokenizer.sha256 == source.tokenizer.sha256
    assert state.keys() == source.state_dict.keys()
    assert all(torch.equal(state[k], source.state_dict[k]) for k in state)


@pytest.mark.parametrize("export", EXPORTS)
def test_clean_environment_loads_export_with_logit_and_greedy_parity(export, request, clean_site, tmp_path):
    """A Python with torch and transformers but without setdiff_megatron loads the export (dense,
    and a mixture of experts) with AutoModelForCausalLM(trust_remote_code=True); query logits
    match the torch model to 1e-4 and generate() decodes the same greedy tokens as
    sampling.sampler.SetSampler."""
    out, source = request.getfixturevalue(export)
    batch = verify.fixed_batch(source.config)
    save_file(
        {"clean": batch.clean_tokens, "query": batch.query_tokens, "positions": batch.position_ids},
        str(tmp_path / "batch.safetensors"),
    )
    prompts = _prompts(source)
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    script = CLEAN_SCRIPT.format(export=str(out), work=str(tmp_path), decoding=DECODING)
    result = run_clean(script, clean_site, tmp_path)
    assert result["has_setdiff"] is False and result["setdiff_modules"] == []
    logits = load_file(str(tmp_path / "clean_logits.safetensors"))["logits"]
    expected = verify.query_logits(verify.torch_model(source.config, source.state_dict), batch)
    assert (logits - expected).abs().max() < 1e-4
    assert result["rows"] == [r.tokens for r in _reference(source, prompts).rows]
    assert result["mask_id"] == source.tokenizer.mask_id and result["generation_window"] == 16
    assert result["padded_shape"][0] == 1


@pytest.mark.parametrize("export", EXPORTS)
def test_reexport_of_an_export_with_check(export, request, tmp_path, capsys):
    """`convert to-hf --check` of an export: its own check loads the result with AutoModel."""
    out, _ = request.getfixturevalue(export)
    target = tmp_path / "again"
    assert main(["convert", "to-hf", str(out), str(target), "--dtype", "bf16", "--check"]) == 0
    printed = capsys.readouterr().out
    assert "ok" in printed and "rounding to bfloat16" in printed
    _, state, _ = load_hf_export(target)
    assert state["embed_tokens.weight"].dtype == torch.bfloat16
    assert not target.with_name("again.partial").exists()


def test_export_errors_are_one_line(export_dir, tmp_path, capsys, ar_dirs):
    out, _ = export_dir
    existing = tmp_path / "exists"
    existing.mkdir()
    cases = [
        (["convert", "to-hf", str(out), str(existing)], "already exists; pass --overwrite"),
        (["convert", "to-hf", str(tmp_path / "missing"), str(tmp_path / "o1")], "does not exist"),
        (["convert", "to-hf", str(ar_dirs["llama"]), str(tmp_path / "o2")], "convert from-hf"),
        (["convert", "to-hf", str(out), str(tmp_path / "o3"), "--shard-size", "lots"], "shard size"),
        (
            ["convert", "to-hf", str(out), str(tmp_path / "o4"), "--check", "--tolerance", "1e-12"],
            "--check: exported model (transformers AutoModel) vs source differs by",
        ),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and message in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exists"]  # nothing partial left behind


def test_forward_padding_and_arguments(export_dir):
    """In process (transformers' dynamic module): right padding through attention_mask is
    valid_len; left padding and arguments the model does not take are errors, not ignored."""
    import transformers

    out, source = export_dir
    model = transformers.AutoModel.from_pretrained(str(out), trust_remote_code=True, dtype=torch.float32)
    batch = verify.fixed_batch(source.config)
    mask = torch.ones_like(batch.clean_tokens)
    mask[1, -5:] = 0
    with torch.no_grad():
        by_mask = model(batch.clean_tokens, attention_mask=mask).logits
        by_len = model(batch.clean_tokens, valid_len=mask.sum(1)).logits
    assert torch.equal(by_mask, by_len)
    with pytest.raises(ValueError, match="right padding"):
        model(batch.clean_tokens, attention_mask=mask.flip(1))
    with pytest.raises(TypeError, match="labels"):
        model(batch.clean_tokens, labels=batch.clean_tokens)
