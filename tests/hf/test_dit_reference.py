"""The reference implementation's DiT, imported: the NLL it computes under its own orders, its
greedy decode trace, both of its checkpoint layouts, and what the import refuses.

How tests/fixtures/dit/ was made, once (the tests need neither the reference nor a network):

  reference    github.com/kuleshov-group/setdlms at commit 549f0bbe35d3653c0d70c7e20e52a29523dcf0a9,
               its src/ tree (backbone/dit.py, denoiser/setdlm.py, noise_schedule/noise_schedules.py)
  environment  Python 3.11 in a throwaway venv: torch 2.13.0 (CPU), transformers 4.52.4,
               huggingface_hub 0.36.2, hydra-core 1.3.2, einops 0.8.1, tokenizers 0.21.4, numpy 2.4.6
  command      tests/fixtures/make_reference_fixtures.py (its docstring says how to run it and
               what a rerun reproduced), with the reference's checkout on its path; this package
               holds none of the reference's code. It builds the reference's DIT and SetDLM
               classes and saves what follows
  settings     the DIT as the released OpenWebText and LM1B models build it (adaln false,
               causal_attention false, attn_backend sdpa, dropout 0.1, inactive in eval,
               tie_word_embeddings true, which the DIT does not apply) at length 32, hidden 24,
               4 heads, 2 layers, vocabulary 64 (EOS 60, BOS 61, PAD 62, MASK 63), random weights
               (seed 0, norms and biases random too); the SetDLM denoiser around it with
               StaggeredNoise d = 4, m = 8, block size = length, keep_clean_bos

  hub/            the backbone's save_pretrained (PyTorchModelHubMixin: config.json,
                  model.safetensors) and the word-level tokenizer beside it
  composer.pt     state.model named as composer's HuggingFaceModel names a compiled backbone
                  (model.backbone._orig_mod.*), state.integrations.huggingface (the denoiser's
                  config and the tokenizer's files), and numpy RNG state, which
                  torch.load(weights_only=True) refuses
  reference.json  a batch of 2 rows (BOS first); for seeds 11 and 12 the order the denoiser's eval
                  forward drew and -log p of each rank's target from its query stream; the greedy
                  decode of its generate (predict_and_noise, max_window_size 4, confidence_threshold
                  0.3, 14 new tokens after a 5-token prompt) with each step's queried and decoded
                  positions

Measured: the largest |NLL difference| is 2.3e-5 (fused attention; NLLs up to 11.4), within the
reference's own float32 error (its NLLs differ from a float64 run of the same model by 6.6e-5);
the decode trace is equal step for step.
"""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from setdiff_megatron.errors import UserError
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sources.read import fit_source, read_source
from tests.hf.conftest import ROOT, convert_from_hf, greedy_trace, rank_nll

FIXTURES = ROOT / "tests" / "fixtures" / "dit"
HUB, COMPOSER = FIXTURES / "hub", FIXTURES / "composer.pt"
REFERENCE = json.loads((FIXTURES / "reference.json").read_text())
MASK = REFERENCE["settings"]["mask"]
NLL_TOLERANCE = 1e-4
"""float32 on both sides: measured 2.3e-5 (the reference is 6.6e-5 off its float64 self)."""


def _model(source, impl: str = "fused") -> SetDiffusionTransformer:
    model = SetDiffusionTransformer(source.config.replace(attention_impl=impl))
    model.load_state_dict(source.state_dict)
    return model.eval()


@pytest.mark.parametrize("impl", ["fused", "dense"])
def test_the_reference_orders_score_as_the_reference_scores_them(impl):
    """The imported model's per-rank NLL under the orders the reference's forward drew (clean
    stream x[perm], all-MASK queries, rotary ids perm) is the reference's."""
    model = _model(read_source(HUB), impl)
    for perm, expected in zip(REFERENCE["orders"], REFERENCE["nll"]):
        nll = rank_nll(model, REFERENCE["batch"], perm, MASK)
        assert (nll - torch.tensor(expected)).abs().max() < NLL_TOLERANCE


def test_greedy_decoding_follows_the_reference_trace():
    """The set sampler on the imported model queries and decodes what the reference's generate
    did, step by step (window 4, threshold 0.3, greedy)."""
    decode = REFERENCE["decode"]
    row, steps = greedy_trace(_model(read_source(HUB)), decode, MASK)
    assert row.tokens == decode["tokens"] and steps == decode["steps"]
    assert row.tokens_per_step == pytest.approx(decode["parallelism_factor"])


def _same_model(a, b) -> None:
    assert a.config == b.config and a.tokenizer.sha256 == b.tokenizer.sha256
    assert a.state_dict.keys() == b.state_dict.keys()
    assert all(torch.equal(a.state_dict[k], b.state_dict[k]) for k in a.state_dict)


def test_a_composer_checkpoint_is_read_safely_as_the_released_model(tmp_path):
    """Plain weights_only loading refuses composer's pickle; the reader reads it without running
    any of it: alone (config and tokenizer from its integrations), or without them from a
    config.json and a tokenizer beside it."""
    # In a fresh interpreter: a library imported by other tests may have allowed numpy's globals.
    plain = subprocess.run(
        [sys.executable, "-c", f"import torch; torch.load({str(COMPOSER)!r}, weights_only=True)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert plain.returncode != 0 and "UnpicklingError" in plain.stderr, plain.stderr[-2000:]
    hub = read_source(HUB)
    alone = tmp_path / "alone" / "best-rank0.pt"
    alone.parent.mkdir()
    shutil.copy(COMPOSER, alone)
    composer = read_source(alone)
    assert composer.kind == hub.kind == "dit" and composer.path == alone
    _same_model(composer, hub)
    # numpy's RNG state, dropped and said so; in a fresh interpreter too, since megatron-core,
    # once imported by another test, allows numpy's globals for the whole process
    fresh = subprocess.run(
        [
            sys.executable,
            "-c",
            f"from setdiff_megatron.sources.read import read_source; print(read_source({str(alone)!r}).notes)",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    (note,) = ast.literal_eval(fresh.stdout.strip().splitlines()[-1])
    assert note.startswith("best-rank0.pt: dropped the objects of globals torch.load(weights_only=True) refuses: ")
    assert {"numpy.ndarray", "numpy.dtype"} <= set(note.partition("refuses: ")[2].partition(" (")[0].split(", "))
    assert not hub.notes

    beside = tmp_path / "beside"
    shutil.copytree(HUB, beside, ignore=shutil.ignore_patterns("model.safetensors"))
    weights = {f"model.backbone.{k}": v for k, v in load_file(str(HUB / "model.safetensors")).items()}
    torch.save({"state": {"model": weights}, "rng": [{"numpy": np.random.get_state()}]}, beside / "ep0-ba1.pt")
    _same_model(read_source(beside / "ep0-ba1.pt"), hub)


class _Touch:
    """A pickle that would create a file when loaded by an unsafe loader."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return Path.mkdir, (self.path,)


def test_a_malicious_checkpoint_runs_nothing(tmp_path):
    sentinel = tmp_path / "ran"
    torch.save(
        {"state": {"model": {"model.backbone.vocab_embed.embedding": torch.zeros(2, 2)}, "x": _Touch(sentinel)}},
        tmp_path / "evil.pt",
    )
    with pytest.raises(UserError, match="cannot read .* safely.*Trying to call reduce") as err:
        read_source(tmp_path / "evil.pt")
    assert not sentinel.exists() and "\n" not in str(err.value)


def _edited_hub(tmp_path: Path, config: dict | None = None, weights: dict | None = None) -> Path:
    out = tmp_path / "hub"
    shutil.copytree(HUB, out)
    if config:
        (out / "config.json").write_text(json.dumps(json.loads((HUB / "config.json").read_text()) | config))
    if weights:
        save_file(load_file(str(HUB / "model.safetensors")) | weights, str(out / "model.safetensors"))
    return out


@pytest.mark.parametrize(
    "config,weights,message",
    [
        (dict(adaln=True), None, "missing ['layers.0.adaln_modulation.bias'"),
        ({"adaln": True, "cond_dim": None}, None, "adaln: true without its cond_dim"),
        (dict(causal_attention=True), None, "autoregressive baseline"),
        (dict(vocab_size=60), None, "is not one of the checkpoint's 60 rows"),
        (None, {"rotary_emb.inv_freq": torch.ones(3)}, "rotary frequencies"),
        (None, {"sigma_map.mlp.0.weight": torch.zeros(2, 2)}, "unexpected ['time_embedding.linear_1.weight']"),
        (None, {"sigma_map.mlp.1.weight": torch.zeros(2, 2)}, "not mapped: ['sigma_map.mlp.1.weight']"),
        (dict(num_layers=3), None, "missing ['layers.2.input_layernorm.weight'"),
    ],
)
def test_what_the_family_cannot_hold_is_refused_in_one_line(tmp_path, config, weights, message):
    with pytest.raises(UserError) as err:
        read_source(_edited_hub(tmp_path, config, weights))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.multiproc
def test_convert_from_hf_takes_a_composer_checkpoint(tmp_path):
    """`setdiff convert from-hf` of the composer .pt: a megatron run directory whose megatron
    body, checked on the verification batch, holds the released weights exactly."""
    out = tmp_path / "run"
    proc = convert_from_hf(COMPOSER, out, "--check")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count(" ok") == 2, proc.stdout
    converted, hub = read_source(out), read_source(HUB)
    assert converted.kind == "megatron" and asdict(converted.config) == asdict(hub.config)
    assert all(torch.equal(converted.state_dict[k], hub.state_dict[k]) for k in hub.state_dict)


def test_a_dit_source_fits_a_recipe_with_more_vocabulary_rows():
    """`model.init_from` a DiT into a padded vocabulary: the untied output layer's bias grows with
    its weight, the new rows the mean of the tokenizer's."""
    hub = read_source(HUB)
    wider = replace(hub.config, vocab_size=hub.config.vocab_size + 16)
    fitted = fit_source(hub, wider, hub.tokenizer)
    SetDiffusionTransformer(wider).load_state_dict(fitted)
    bias = fitted["lm_head.bias"]
    assert bias.shape == (wider.vocab_size,)
    torch.testing.assert_close(bias[-1], hub.state_dict["lm_head.bias"][: hub.tokenizer.vocab_size].mean())
