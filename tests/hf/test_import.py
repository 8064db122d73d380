"""Import of Llama, Qwen2, Qwen3 and Qwen3-MoE causal LMs: under the left-to-right order the clean
stream of our model is the AR model's own computation, so hidden states and logits must match (the
import's own check too, for Qwen3-MoE's routings and expert layouts); the MASK token; refusals;
the megatron checkpoint written by `convert from-hf`; a first adaptation."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
import transformers

from setdiff_megatron.cli import main
from setdiff_megatron.core.orders import Staggered
from setdiff_megatron.errors import UserError
from setdiff_megatron.hf import verify
from setdiff_megatron.hf.import_hf import ar_comparison
from setdiff_megatron.sources.hf_files import load_safetensors_dir
from setdiff_megatron.sources.read import read_hf_dir, read_source
from tests.hf.conftest import convert_from_hf
from tests.hf.tiny_models import make_ar_model

KINDS = ("llama", "qwen2", "qwen3", "qwen3_moe")
MOE_VARIANTS = {
    # make_ar_model arguments -> (moe_layers, moe_router_pre_softmax) of the import
    "norm_topk_prob, mlp_only_layers": (dict(num_hidden_layers=3, mlp_only_layers=[1]), ((True, False, True), False)),
    "softmax before top-k, decoder_sparse_step, fused experts": (
        dict(num_hidden_layers=4, decoder_sparse_step=2, norm_topk_prob=False, fused=True),
        ((False, True, False, True), True),
    ),
}


def _ar(path: Path):
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


@pytest.mark.parametrize("kind", KINDS)
def test_clean_stream_is_the_ar_model(ar_dirs, kind):
    source = read_hf_dir(ar_dirs[kind])
    reference = _ar(ar_dirs[kind])
    rows = reference.get_input_embeddings().weight.shape[0]
    tokens = verify.fixed_tokens(source.config, max_token=min(rows, source.tokenizer.vocab_size))
    with torch.no_grad():
        expected = reference(tokens, output_hidden_states=True)
    hidden, logits = verify.clean_stream(verify.torch_model(source.config, source.state_dict), tokens)
    assert (hidden - expected.hidden_states[-1]).abs().max() < 1e-5
    assert (logits[..., :rows] - expected.logits).abs().max() < 1e-5
    cfg = source.config
    assert (cfg.qkv_bias, cfg.qk_norm, cfg.tie_embeddings, cfg.num_experts) == {
        "llama": (False, False, False, 0),
        "qwen2": (True, False, False, 0),
        "qwen3": (False, True, True, 0),
        "qwen3_moe": (False, True, False, 4),
    }[kind]
    assert cfg.rope_theta == 50000.0 and cfg.head_dim == (24 if kind.startswith("qwen3") else 16)


@pytest.mark.parametrize("variant", MOE_VARIANTS)
def test_qwen3_moe_import_check_passes(variant, tmp_path):
    """The import's check (clean stream against transformers' Qwen3-MoE logits) on mixed dense and
    MoE layers, for both routings and both ways of storing the experts."""
    arguments, (layers, pre_softmax) = MOE_VARIANTS[variant]
    directory = make_ar_model("qwen3_moe", tmp_path / "moe", seed=4, **arguments)
    fused = any(name.endswith("mlp.experts.gate_up_proj") for name in load_safetensors_dir(directory))
    assert fused == arguments.get("fused", False)
    source = read_hf_dir(directory)
    cfg = source.config
    assert (cfg.moe_layers, cfg.moe_router_pre_softmax, cfg.moe_top_k, cfg.moe_intermediate_size) == (
        layers,
        pre_softmax,
        2,
        32,
    )
    check = ar_comparison(source, verify.torch_model(cfg, source.state_dict), torch.float32, verify.DEFAULT_TOLERANCE)
    assert check.ok, check.line()


def test_mask_token(ar_dirs):
    qwen = read_hf_dir(ar_dirs["qwen3"])
    assert qwen.tokenizer.special_tokens["mask"] == "<|fim_middle|>"  # reused, as the paper does with Qwen3
    assert qwen.config.vocab_size == 307  # the padded rows stay; the MASK row is pretrained
    llama = read_hf_dir(ar_dirs["llama"])
    assert llama.tokenizer.special_tokens["mask"] == "<|mask|>"
    rows = _ar(ar_dirs["llama"]).get_input_embeddings().weight.shape[0]
    assert llama.config.vocab_size == llama.tokenizer.vocab_size > rows and llama.config.mask_token_id >= rows
    for name in ("embed_tokens.weight", "lm_head.weight"):  # new rows: the mean of the source rows
        weight = llama.state_dict[name]
        assert torch.allclose(weight[llama.config.mask_token_id], weight[:rows].mean(0), atol=1e-6)


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (dst / "config.json").write_text(json.dumps(config))
    return dst


def test_refusals_are_one_line_user_errors(ar_dirs, tmp_path):
    llama, moe = ar_dirs["llama"], ar_dirs["qwen3_moe"]
    cases = {
        "GPT2LMHeadModel' is not supported; supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM": _edit_config(
            llama, tmp_path / "gpt2", model_type="gpt2", architectures=["GPT2LMHeadModel"]
        ),
        "rope scaling 'llama3'": _edit_config(
            llama, tmp_path / "rope", rope_parameters={"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0}
        ),
        "mlp_bias": _edit_config(llama, tmp_path / "mlp_bias", mlp_bias=True),
        "attention_bias": _edit_config(llama, tmp_path / "attn_bias", attention_bias=True),
        "mlp.gate_proj.weight": _edit_config(llama, tmp_path / "shape", intermediate_size=80),
        "'Qwen2MoeForCausalLM' is not supported (its shared expert is scaled by a learnt sigmoid gate": _edit_config(
            moe, tmp_path / "qwen2_moe", model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"]
        ),
        "sliding-window attention": _edit_config(moe, tmp_path / "moe_window", use_sliding_window=True),
        "decoder_sparse_step must be >= 1": _edit_config(moe, tmp_path / "moe_step", decoder_sparse_step=0),
    }
    for message, directory in cases.items():
        with pytest.raises(UserError, match=None) as info:
            read_hf_dir(directory)
        assert message in str(info.value) and "\n" not in str(info.value), str(info.value)
    pickled = _edit_config(llama, tmp_path / "pickled")
    (pickled / "model.safetensors").rename(pickled / "pytorch_model.bin")
    with pytest.raises(UserError, match="only pickled weights"):
        read_hf_dir(pickled)
    no_tokenizer = _edit_config(llama, tmp_path / "no_tokenizer")
    (no_tokenizer / "tokenizer.json").unlink()
    with pytest.raises(UserError, match="has no tokenizer"):
        read_hf_dir(no_tokenizer)


@pytest.mark.multiproc
@pytest.mark.parametrize("kind", ["qwen3", pytest.param("qwen3_moe", marks=pytest.mark.slow)])  # MoE: 13 s
def test_convert_from_hf_writes_a_megatron_checkpoint(ar_dirs, kind, tmp_path, capsys):
    """`setdiff convert from-hf` (the whole model written by its one process) of a dense model and
    of a mixture of experts: the published layout, weights only, read back exactly, the megatron
    body checked, an existing output refused."""
    out = tmp_path / f"{kind}-setdiff"
    proc = convert_from_hf(ar_dirs[kind], out, "--check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"clean stream (left to right) vs {kind} source logits" in proc.stdout and "megatron model vs" in proc.stdout
    step = out / "checkpoints" / "step_00000000"
    assert (out / "checkpoints" / "latest").read_text().strip() == step.name
    assert {"manifest.json", "train_state.json", "recipe.yaml", "tokenizer", "metadata.json"} <= {
        p.name for p in step.iterdir()
    }
    state = json.loads((step / "train_state.json").read_text())
    source = read_hf_dir(ar_dirs[kind])
    assert state["weights_only"] and "run_id" not in state and state["model"]["qk_norm"]
    assert state["layout"]["tp"] == state["layout"]["pp"] == 1 and state["layout"]["distributed_optimizer"] is None
    assert state["scheduler"] == {} and state["model"]["num_experts"] == source.config.num_experts  # the run's own
    ckpt = read_source(out)
    assert ckpt.config == source.config and ckpt.tokenizer.sha256 == source.tokenizer.sha256
    assert all(torch.equal(ckpt.state_dict[k], source.state_dict[k]) for k in source.state_dict)
    assert main(["convert", "from-hf", str(ar_dirs[kind]), str(out)]) == 2
    assert "already exists" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]


def test_short_adaptation_lowers_the_set_diffusion_loss(ar_dirs):
    """A few optimizer steps of the set diffusion objective from the imported Qwen2 (in process;
    the engine run through model.init_from is test_slow_roundtrip's)."""
    source = read_hf_dir(ar_dirs["qwen2"])
    model = verify.torch_model(source.config, source.state_dict).train()
    text = "def add(a, b):\n    return a + b\nfor i in range(10):\n    print(i * i)\n" * 2
    tokens = torch.tensor([source.tokenizer.encode(text)[:48]] * 4)
    optimizer = torch.optim.AdamW(model.parameters(), lr=5e-3)
    policy, gen = Staggered(d=2), torch.Generator().manual_seed(0)

    def loss() -> torch.Tensor:
        return model.loss(tokens, policy, generator=gen).loss

    with torch.no_grad():
        before = sum(loss().item() for _ in range(4)) / 4
    for _ in range(12):
        optimizer.zero_grad()
        loss().backward()
        optimizer.step()
    with torch.no_grad():
        after = sum(loss().item() for _ in range(4)) / 4
    assert after < before - 1.0, (before, after)


def test_reading_never_unpickles(ar_dirs, export_dir, monkeypatch):
    """Hugging Face directories are read from safetensors only: torch.load is never called."""
    from setdiff_megatron.sources.hf_export import load_hf_export

    def refuse(*args, **kwargs):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", refuse)
    for kind in KINDS:
        read_hf_dir(ar_dirs[kind])
    load_hf_export(export_dir[0])
