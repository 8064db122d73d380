"""The reference's released models as they are published (SetDLM folders, Qwen3 and DiT
backbones): the numbers of the reference's own loader, the settings it evaluates them with, the
way back (`convert to-hf --layout setdlm`), and what is refused.

How tests/fixtures/setdlm/ was made, once (the tests need neither the reference nor a network):

  reference    github.com/kuleshov-group/setdlms at commit 549f0bbe35d3653c0d70c7e20e52a29523dcf0a9
  environment  Python 3.11 in a throwaway venv: torch 2.13.0 (CPU), transformers 4.52.4,
               huggingface_hub 0.36.2, hydra-core 1.3.2, einops 0.8.1, tokenizers 0.21.4, rich; a
               stand-in for composer.utils.dist, which the loader's module imports but never calls
  command      tests/fixtures/make_reference_fixtures.py (its docstring says how to run it and
               what a rerun reproduced), with the reference's checkout on its path; this package
               holds none of the reference's code.
               For each backbone it builds the reference's SetDLM denoiser (BD3LMConfig:
               L = 32, block size 32, StaggeredNoise d = 4, m = 8, keep_clean_bos, sdpa), adds
               random noise to every backbone weight (norms too), writes the folder with the
               reference's own src/utils.py::save_pretrained_or_push_to_hub(local=True), loads it
               back with scripts/eval/model_loading.py::load_eval_model, and records its numbers
  backbones    qwen3: AutoModelFromPreTrained over a tiny random Qwen3 base (`tiny-qwen3-base`:
               3 layers x 32, 4 heads, 2 KV heads, head dim 8, tied embeddings, rope theta 1e6),
               cut to num_layers 2; dit: the DIT as the released OpenWebText/LM1B models build it
               (adaln false, 2 layers x 24, 4 heads). Vocabulary 64 (EOS 60, BOS 61, PAD 62, MASK
               63), the word-level tokenizer of tests/fixtures/dit/hub.

  tiny-*-setdlm-smax8/   the release folders as written, less the python sources the save copies
                         beside them (the reference's code; the tests add a stand-in)
  tiny-qwen3-base/       the base model's config.json (its weights are not needed: the release
                         holds every weight)
  *-reference.json       a batch of 2 rows (BOS first); for seeds 11 and 12 the order the
                         loaded model's eval forward drew (other_loss_terms.permutation_order) and
                         its -log p of each rank's target (log_p_theta, BOS dropped); the greedy
                         decode of its generate as the paper's evaluation runs it (predict_and_noise,
                         first_hitting false, max_window_size 4, confidence_threshold 0.15, 14 new
                         tokens after a 5-token prompt), each step's queried positions and the
                         (position, token) pairs it decoded, recorded around _generate_unconditional

Measured: the largest |NLL difference| is 2.9e-6 (Qwen3) and 2.4e-6 (DiT) in float32; the decode
traces are equal step for step.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from setdiff_megatron.errors import UserError
from setdiff_megatron.hf.release_export import export_release
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sources.read import read_source
from setdiff_megatron.sources.setdlm_release import QWEN3_ARCHITECTURE, static_attention_mask
from tests.cli_runs import setdiff
from tests.hf.conftest import ROOT, convert_from_hf, greedy_trace, rank_nll

FIXTURES = ROOT / "tests" / "fixtures" / "setdlm"
BASE = FIXTURES / "tiny-qwen3-base"
RELEASES = {"qwen3": FIXTURES / "tiny-qwen3-setdlm-smax8", "dit": FIXTURES / "tiny-dit-setdlm-smax8"}
REFERENCE = {kind: json.loads((FIXTURES / f"{kind}-reference.json").read_text()) for kind in RELEASES}
NLL_TOLERANCE = 1e-5
"""float32 on both sides: measured 2.9e-6."""


def _read(kind: str, folder: Path | None = None, **kwargs):
    return read_source(folder or RELEASES[kind], base=BASE if kind == "qwen3" else None, **kwargs)


def _model(source, impl: str = "fused") -> SetDiffusionTransformer:
    model = SetDiffusionTransformer(source.config.replace(attention_impl=impl))
    model.load_state_dict(source.state_dict)
    return model.eval()


@pytest.mark.parametrize("impl", ["fused", "dense"])
@pytest.mark.parametrize("kind", list(RELEASES))
def test_the_reference_loaders_nll_under_its_orders(kind, impl):
    """Per-rank NLL of the release read here, under the orders the reference's loaded model drew
    (clean stream x[perm], all-MASK queries, rotary ids perm), against its log_p_theta."""
    ref = REFERENCE[kind]
    model = _model(_read(kind), impl)
    for perm, expected in zip(ref["orders"], ref["nll"]):
        nll = rank_nll(model, ref["batch"], perm, ref["settings"]["mask"])
        assert (nll[:, 1:] - torch.tensor(expected)).abs().max() < NLL_TOLERANCE


@pytest.mark.parametrize("kind", list(RELEASES))
def test_greedy_decoding_follows_the_reference_trace(kind):
    """Token ids, queried and decoded positions per step and the number of decode forwards are
    the reference's (window 4, threshold 0.15, greedy)."""
    source, decode = _read(kind), REFERENCE[kind]["decode"]
    row, steps = greedy_trace(_model(source), decode, source.tokenizer.mask_id)
    assert row.tokens == decode["tokens"] and steps == decode["steps"]
    assert row.steps == decode["nfe"] and row.tokens_per_step == pytest.approx(decode["parallelism_factor"])


@pytest.mark.parametrize("kind", list(RELEASES))
def test_the_evaluation_settings_are_the_reference_loaders(kind):
    source = _read(kind)
    loaded, recipe = REFERENCE[kind]["loaded"], source.recipe
    assert source.kind == "setdlm" and source.add_bos == loaded["keep_clean_bos"] is True
    assert (recipe.method.order, recipe.method.d, recipe.method.m) == (
        "staggered",
        loaded["desired_block_size"],
        loaded["max_block_size"],
    )
    assert recipe.data.seq_len == loaded["length"] == 32
    assert source.tokenizer.mask_id == REFERENCE[kind]["settings"]["mask"]
    # The order law those settings give here is the one the reference's loaded noise schedule drew from.
    k, b, _ = recipe.method.order_policy().schedule(recipe.data.seq_len)
    assert k == pytest.approx(loaded["k"], rel=1e-12) and b == pytest.approx(loaded["b"], rel=1e-12)


def _copy(kind: str, tmp_path: Path, config: dict | None = None) -> Path:
    out = tmp_path / RELEASES[kind].name
    shutil.copytree(RELEASES[kind], out)
    if config:
        (out / "config.json").write_text(json.dumps(json.loads((out / "config.json").read_text()) | config))
    return out


def test_the_python_sources_beside_the_weights_never_run(tmp_path):
    """The save copies the reference's modules beside the weights; reading the folder imports
    none of them, and says so in one line."""
    folder = _copy("dit", tmp_path)
    sentinel = tmp_path / "ran"
    for name in ("setdlm.py", "backbone_dit.py", "__init__.py"):
        (folder / name).write_text(f"open({str(sentinel)!r}, 'w').close()\n")
    source = read_source(folder)
    assert not sentinel.exists()
    assert any("python source files" in note and "never executed" in note for note in source.notes)


def test_an_m_equal_to_the_block_size_means_two_d_as_in_the_reference_loader(tmp_path):
    """Exported configs can carry max_block_size == length; the reference's loader then uses 2d."""
    noise = json.loads((RELEASES["dit"] / "config.json").read_text())["noise_config"] | {"max_block_size": 32}
    assert read_source(_copy("dit", tmp_path, {"noise_config": noise})).recipe.method.m == 8


@pytest.mark.parametrize("kind", list(RELEASES))
def test_ours_to_a_release_and_back_is_bitwise(kind, tmp_path):
    """A model read here, written as a release, reads back with the same config, tokenizer and
    weights, bit for bit; the folder holds what the reference's loader reads."""
    source = _read(kind)
    out = tmp_path / "release"
    lines = export_release(source.path, out, base_name="Qwen/Qwen3-1.7B-Base", base=BASE)
    assert "bit for bit" in lines[-1]
    back = read_source(out)  # a Qwen3 release written here names every architecture number: no base needed
    assert back.config == source.config and back.tokenizer.sha256 == source.tokenizer.sha256
    assert all(torch.equal(back.state_dict[k], source.state_dict[k]) for k in source.state_dict)
    assert (back.recipe.method, back.recipe.data.seq_len) == (source.recipe.method, source.recipe.data.seq_len)
    written = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert torch.equal(
        written["static_attention_mask"],
        torch.load(RELEASES[kind] / "pytorch_model.bin", weights_only=True)["static_attention_mask"],
    )
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["SetDLM"] and config["model_type"] == "bd3lm"
    # What the reference's save wrote: the same tensor names, the same config keys (less the
    # transformers version its save_pretrained adds; a Qwen3 backbone here names its architecture
    # numbers too, so that no base model is needed), the same files the loader reads.
    theirs = json.loads((RELEASES[kind] / "config.json").read_text())
    assert written.keys() == torch.load(RELEASES[kind] / "pytorch_model.bin", weights_only=True).keys()
    assert config.keys() == theirs.keys() - {"transformers_version"}
    for section in ("noise_config", "tokenization_config"):
        assert config[section].keys() == theirs[section].keys(), section
    architecture = set(QWEN3_ARCHITECTURE) if kind == "qwen3" else set()
    assert config["backbone_config"].keys() == theirs["backbone_config"].keys() | architecture
    assert {"config.json", "pytorch_model.bin", "tokenizer.json", "tokenizer_config.json"} <= {
        p.name for p in out.iterdir()
    }
    if kind == "qwen3":  # tied, as the reference saves it: one storage under both names
        assert (
            written["backbone.model.lm_head.weight"].data_ptr()
            == written["backbone.model.model.embed_tokens.weight"].data_ptr()
        )


def test_an_adaln_dit_release_goes_to_a_release_and_back_bitwise(tmp_path):
    """The LM1B backbone's adaLN (models/adaln.py): a release with it reads (its time embedding and
    modulations under the reference's names, cond_dim from its config), modulates the logits, and
    is written back under the same names, bit for bit."""
    backbone = json.loads((RELEASES["dit"] / "config.json").read_text())["backbone_config"]
    folder = _copy("dit", tmp_path, {"backbone_config": backbone | {"adaln": True, "cond_dim": 8}})
    weights = torch.load(folder / "pytorch_model.bin", weights_only=True)
    e, gen = backbone["hidden_size"], torch.Generator().manual_seed(0)
    shapes = {"sigma_map.mlp.0": (8, 256), "sigma_map.mlp.2": (8, 8), "output_layer.adaLN_modulation": (2 * e, 8)}
    shapes |= {f"blocks.{i}.adaLN_modulation": (6 * e, 8) for i in range(backbone["num_layers"])}
    for name, (rows, cols) in shapes.items():
        weights[f"backbone.{name}.weight"] = 0.1 * torch.randn(rows, cols, generator=gen)
        weights[f"backbone.{name}.bias"] = 0.1 * torch.randn(rows, generator=gen)
    torch.save(weights, folder / "pytorch_model.bin")
    source, plain = _read("dit", folder), _read("dit")
    assert source.config == plain.config.replace(adaln=True, adaln_cond_dim=8)
    tokens = torch.tensor([REFERENCE["dit"]["batch"][0]])
    positions = torch.arange(tokens.shape[1])[None]
    logits = [_model(s)(tokens, torch.full_like(tokens, 63), positions) for s in (source, plain)]
    assert (logits[0] - logits[1]).abs().max() > 0.1
    out = tmp_path / "release"
    export_release(source.path, out)
    back = read_source(out)
    assert back.config == source.config
    assert all(torch.equal(back.state_dict[k], source.state_dict[k]) for k in source.state_dict)
    written = torch.load(out / "pytorch_model.bin", weights_only=True)
    assert {f"backbone.{name}.{p}" for name in shapes for p in ("weight", "bias")} <= written.keys()


UNFLATTENED = {
    "backbone_dit.DIT": "src.backbone.dit.DIT",
    "backbone_automodel.AutoModelFromPreTrained": "src.backbone.automodel.AutoModelFromPreTrained",
    "noise_schedule_noise_schedules.StaggeredNoise": "src.noise_schedule.noise_schedules.StaggeredNoise",
}
"""The `_target_`s of the reference's configs, which its save function flattens and a plain
save_pretrained keeps."""


@pytest.mark.parametrize("kind", list(RELEASES))
def test_a_plain_save_pretrained_folder_reads_as_the_release(kind, tmp_path):
    """The denoiser saved by transformers' own save_pretrained: `_target_`s as the configs write
    them, model.safetensors with the buffers, the tied Qwen3 output layer stored once (transformers
    keeps one name of tensors that share storage); no pytorch_model.bin."""
    folder = tmp_path / RELEASES[kind].name
    shutil.copytree(RELEASES[kind], folder, ignore=shutil.ignore_patterns("pytorch_model.bin"))
    config = json.loads((folder / "config.json").read_text())
    for section in ("backbone_config", "noise_config"):
        config[section]["_target_"] = UNFLATTENED[config[section]["_target_"]]
    (folder / "config.json").write_text(json.dumps(config))
    state = torch.load(RELEASES[kind] / "pytorch_model.bin", weights_only=True)
    state.pop("backbone.model.lm_head.weight", None)
    save_file({k: v.clone() for k, v in state.items()}, str(folder / "model.safetensors"))
    assert "static_attention_mask" in state and (kind == "qwen3" or "backbone.rotary_emb.inv_freq" in state)

    saved, release = _read(kind, folder), _read(kind)
    assert saved.kind == "setdlm" and saved.config == release.config
    assert saved.state_dict.keys() == release.state_dict.keys()
    assert all(torch.equal(saved.state_dict[k], release.state_dict[k]) for k in release.state_dict)
    assert (saved.recipe.method, saved.recipe.data.seq_len) == (release.recipe.method, release.recipe.data.seq_len)


def test_the_static_mask_is_the_reference_buffer():
    saved = torch.load(RELEASES["dit"] / "pytorch_model.bin", weights_only=True)["static_attention_mask"]
    assert torch.equal(static_attention_mask(32), saved)


@pytest.mark.multiproc
def test_convert_from_hf_records_the_evaluation_settings(tmp_path):
    """`setdiff convert from-hf` of a Qwen3 release with --base: a megatron run whose recipe holds
    L, d, m and the clean BOS, and whose weights are the release's."""
    out = tmp_path / "run"
    proc = convert_from_hf(RELEASES["qwen3"], out, "--check", "--base", str(BASE))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ignored attn_backend 'sdpa'" in proc.stdout and proc.stdout.count(" ok") == 2, proc.stdout
    run, release = read_source(out), _read("qwen3")
    assert run.config == release.config and run.recipe.method == release.recipe.method
    assert run.recipe.data.seq_len == 32 and run.add_bos
    assert all(torch.equal(run.state_dict[k], release.state_dict[k]) for k in release.state_dict)


@pytest.mark.multiproc
def test_sample_reads_a_release_directly(tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "w33 w33 w1 w47"}) + "\n")
    options = ["--prompts", prompts, "--out", tmp_path / "out.jsonl", "--max-new-tokens", "6", "--window", "4"]
    setdiff("sample", RELEASES["qwen3"], "--base", BASE, *options, "--no-progress", timeout=300)
    (result,) = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert result["num_decoded"] == 6


def _truncated(folder: Path) -> None:
    data = (folder / "pytorch_model.bin").read_bytes()
    (folder / "pytorch_model.bin").write_bytes(data[: len(data) // 2])


@pytest.mark.multiproc
@pytest.mark.parametrize(
    "kind,edit,message",
    [
        ("dit", _truncated, "pytorch_model.bin safely"),
        ("dit", {"length": 16}, "length is 16, but pytorch_model.bin's static_attention_mask is (64, 64)"),
        ("qwen3", {}, "pass --base DIR"),
        ("dit", {"backbone_config": {"_target_": "backbone_dit_legacy.DITLegacy"}}, "is not a released backbone"),
        (
            "dit",
            {"noise_config": {"_target_": "noise_schedule_noise_schedules.LinearNoise"}},
            "StaggeredNoise set diffusion trains with",
        ),
        ("dit", {"mask_token_id": 5, "tokenization_config": {"mask_token_id": 5}}, "mask_token_id is 5"),
        ("qwen3", {"eos_token_id": 7, "tokenization_config": {"eos_token_id": 7}}, "eos_token_id is 7, but"),
        (
            "dit",
            {"tokenization_config": {"pad_token_id": 60}},
            "pad_token_id is 60, but the tokenizer beside it has id 62",
        ),
    ],
)
def test_bad_releases_are_one_line_and_convert_writes_nothing(tmp_path, kind, edit, message):
    folder = _copy(kind, tmp_path, edit if isinstance(edit, dict) else None)
    if callable(edit):
        edit(folder)
    with pytest.raises(UserError) as err:
        read_source(folder)  # no base given: the Qwen3 case
    assert message in str(err.value) and "\n" not in str(err.value)
    out = tmp_path / "out"
    proc = convert_from_hf(folder, out)
    assert proc.returncode == 2 and message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
    assert not out.exists() and not out.with_name("out.partial").exists()


def test_a_missing_base_directory_is_one_line(tmp_path):
    with pytest.raises(UserError, match="--base .*: no config.json there"):
        read_source(RELEASES["qwen3"], base=tmp_path)
