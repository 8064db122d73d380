"""tests/fixtures/baselines/ holds together: the reference's MDLM and BD3-LM releases and what its
own code made of them (tests/fixtures/make_baseline_fixtures.py wrote them; its docstring says how
and what each field means). Only the files are read here; the package is not involved.

Each check is a relation the reference's code guarantees, so a fixture edited by hand, or a field
that names something else than the docstring says, fails here."""

from __future__ import annotations

import json

import pytest
import torch

from tests.hf.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "baselines"
RELEASES = {
    "mdlm": "tiny-qwen3-mdlm",
    "bd3lm": "tiny-qwen3-bd3lm-s4",
    "dit-mdlm": "tiny-dit-adaln-mdlm",
    "dit-bd3lm": "tiny-dit-adaln-bd3lm-s4",
}
"""The fixtures' names and their release folders: the families over Qwen3, then over the DiT
with adaLN (the LM1B recipes' backbone)."""
BASE = json.loads((ROOT / "tests" / "fixtures" / "setdlm" / "tiny-qwen3-base" / "config.json").read_text())


def _reference(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}-reference.json").read_text())


@pytest.mark.parametrize("name", list(RELEASES))
def test_the_release_folder_is_the_family_on_its_backbone(name):
    ref = _reference(name)
    family, folder = ref["family"], FIXTURES / ref["release"]
    config = json.loads((folder / "config.json").read_text())
    ids = {key: config[f"{key}_token_id"] for key in ("eos", "bos", "pad", "mask")}
    assert ref["release"] == RELEASES[name] and config["model_type"] == family == name.removeprefix("dit-")
    assert ids == {key: ref["settings"][key] for key in ids}
    assert config["length"] == ref["settings"]["length"] and config.get("block_size") == ref["settings"]["block_size"]
    assert config["keep_clean_bos"] is False and config["noise_config"]["_target_"].endswith("LinearNoise")
    weights = torch.load(folder / "pytorch_model.bin", weights_only=True)
    backbone = config["backbone_config"]
    if name.startswith("dit-"):  # the LM1B scripts' DiT: adaLN on, no dropout (a reproducible loss)
        assert backbone["adaln"] is True and backbone["dropout"] == 0 and backbone["_target_"] == "backbone_dit.DIT"
        layers = {int(key.split(".")[2]) for key in weights if ".blocks." in key}
        embedding = weights["backbone.vocab_embed.embedding"]
        shape = (backbone["vocab_size"], backbone["hidden_size"])
        assert weights["backbone.blocks.0.adaLN_modulation.weight"].shape == (6 * shape[1], backbone["cond_dim"])
    else:
        layers = {int(key.split(".")[4]) for key in weights if ".layers." in key}
        embedding = weights["backbone.model.model.embed_tokens.weight"]
        shape = (BASE["vocab_size"], BASE["hidden_size"])
    assert layers == set(range(backbone["num_layers"]))
    assert embedding.shape == shape and (folder / "tokenizer.json").is_file()


@pytest.mark.parametrize("name", list(RELEASES))
def test_the_loss_rows_follow_the_masking_and_the_loss_formulas(name):
    family = _reference(name)["family"]
    losses, mask = _reference(name)["losses"], _reference(name)["settings"]["mask"]
    x0, t = torch.tensor(losses["input_ids"]), torch.tensor(losses["t"])
    targets = torch.tensor(losses["attention_mask"]).bool() & ~torch.tensor(losses["context_mask"]).bool()
    assert t.shape == ((3,) if family == "mdlm" else (3, 32))
    per_position = t[:, None].expand(3, 32) if family == "mdlm" else t
    for mode in ("train", "eval"):
        terms = losses[mode]
        xt, log_p = torch.tensor(terms["xt"]), torch.tensor(terms["log_p"], dtype=torch.float64)
        masked = xt == mask
        assert terms["mode"] == mode and torch.equal(xt[~masked], x0[~masked]) and not (masked & ~targets).any()
        assert (log_p[~masked] == 0).all() and (log_p[masked] < 0).all()
        if mode == "train":
            rows = -log_p.sum(-1) / masked.sum(-1)
        else:
            nlls = torch.tensor(terms["nlls"], dtype=torch.float64)
            torch.testing.assert_close(nlls, -log_p / per_position.double() * targets, rtol=1e-5, atol=0)
            rows = nlls.sum(-1) / targets.sum(-1)
        torch.testing.assert_close(torch.tensor(terms["row_loss"], dtype=torch.float64), rows, rtol=1e-6, atol=0)
        assert terms["loss"] == pytest.approx(sum(terms["row_loss"]) / 3, rel=1e-6)
    if family == "bd3lm":  # training tops up every block that has no prompt or PAD token
        train = torch.tensor(losses["train"]["xt"]) == mask
        assert torch.equal(t, t[:, ::4].repeat_interleave(4, dim=1))
        free = targets.view(3, 8, 4).all(-1)
        assert train.view(3, 8, 4).any(-1)[free].all()


@pytest.mark.parametrize("name", list(RELEASES))
def test_the_decode_traces_add_up(name):
    family = _reference(name)["family"]
    for decode in _reference(name)["decode"]:
        steps, prompt = decode["steps"], decode["prompt"]
        committed = [pair for step in steps for pair in step["decoded"]]
        positions = [p for p, _ in committed]
        assert len(positions) == len(set(positions)) and min(positions) >= len(prompt)
        assert all(p in step["queried"] for step in steps for p, _ in step["decoded"])
        assert decode["tokens"] == prompt + [token for _, token in sorted(committed)]
        assert decode["nfe"] == len(steps) and decode["backbone_forwards"] == len(steps) + len(decode["cache_forwards"])
        assert decode["parallelism_factor"] == len(committed) / len(steps)
        kwargs = decode["generation_config"]["kwargs"]
        assert kwargs["use_cache"] is (family == "bd3lm") and kwargs["block_size"] == (8 if family == "mdlm" else 4)
        for step in steps:
            (start, stop), (first, last) = step["input"], step["positions"]
            assert stop - start == last - first and step["cache"] == (0 if family == "mdlm" else first)
