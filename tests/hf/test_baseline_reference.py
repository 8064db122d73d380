"""This project's MDLM and BD3-LM against the reference's own numbers on its released folders
(tests/fixtures/baselines/, written by the reference's code), over the Qwen3 backbone and over the
DiT with adaLN of its LM1B recipes: the release read as the family, the masked batch drawn as the
reference draws it (forced noise levels, seeded masking and BD3-LM's masked-block rule), each
row's training loss and each position's log p within float32 rounding (1e-5 + 2e-6 of the value),
and the greedy decode traces (tokens, steps, per-step decided positions) identical, BD3-LM's
infills (the input's whole blocks cached, cache_infill_input) included.

Decodes past the trained length (the fixtures' second prompt: 11 + 32 tokens over L = 32, which
the reference runs with a sliding window or a cropped cache) are refused here, not reproduced."""

from __future__ import annotations

import json

import pytest
import torch

from setdiff_megatron.core.loss import token_nll
from setdiff_megatron.core.masked_diffusion import masked_two_stream_batch, sample_masked_batch
from setdiff_megatron.distributed.runtime import Ranks
from setdiff_megatron.inference.sampling_model import load_sampling_model
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sources.read import read_source
from tests.hf.conftest import ROOT

FIXTURES = ROOT / "tests" / "fixtures" / "baselines"
BASE = ROOT / "tests" / "fixtures" / "setdlm" / "tiny-qwen3-base"
RELEASES = ("mdlm", "bd3lm", "dit-mdlm", "dit-bd3lm")
"""The fixtures' names: the families over Qwen3, then over the adaLN DiT."""


def _reference(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}-reference.json").read_text())


@pytest.fixture(scope="module", params=RELEASES)
def release(request):
    ref = _reference(request.param)
    sm = load_sampling_model(read_source(FIXTURES / ref["release"], base=BASE), Ranks(), device="cpu")
    return ref["family"], ref, sm


def test_the_release_reads_as_its_family(release):
    family, ref, sm = release
    assert sm.family == family and sm.trained_length == ref["settings"]["length"] == 32
    assert sm.model.config.adaln == ref["release"].startswith("tiny-dit-adaln")
    assert sm.decoding.block_size == (ref["settings"]["block_size"] or 32) and sm.decoding.threshold == 0.9
    assert not sm.add_bos


def test_training_rows_as_the_reference_computes_them(release):
    family, ref, sm = release
    losses, block = ref["losses"], ref["settings"]["block_size"]
    x0 = torch.tensor(losses["input_ids"])
    t = torch.tensor(losses["t"], dtype=torch.float32)
    batch = sample_masked_batch(
        x0,
        mask_token_id=sm.tokenizer.mask_id,
        block_size=block,
        prompt_mask=torch.tensor(losses["context_mask"]).bool(),
        pad_mask=~torch.tensor(losses["attention_mask"]).bool(),
        t=t[:, None].expand_as(x0) if t.dim() == 1 else t,
        generator=torch.Generator().manual_seed(losses["train"]["seed"]),
    )
    assert batch.xt.tolist() == losses["train"]["xt"]  # the same draws: masks and BD3-LM's top-up
    two = masked_two_stream_batch(batch, block)
    with torch.no_grad():
        logits = sm.model(two.clean_tokens, two.query_tokens, two.position_ids, two.valid_len, groups=two.groups)
    log_p = torch.where(two.loss_mask, -token_nll(logits, two.targets, sm.tokenizer.mask_id), 0.0)
    expected = torch.where(two.loss_mask, torch.tensor(losses["train"]["log_p"]), 0.0)
    # float32 rounding, the reference's and ours (our rotary adds x * cos and its half-turn roll
    # times a signed sin, the reference rotates halves): 1e-5 near 8, 2.3e-5 near 21 (the DiT's
    # largest), 2e-5 near 3.7 seen on one machine
    torch.testing.assert_close(log_p, expected, rtol=2e-6, atol=3e-5)
    rows = -log_p.sum(1) / two.loss_mask.sum(1).clamp(min=1)
    torch.testing.assert_close(rows, torch.tensor(losses["train"]["row_loss"]), rtol=2e-6, atol=1e-5)
    assert rows.mean().item() == pytest.approx(losses["train"]["loss"], rel=2e-6, abs=1e-5)


def _follows(sampler, decode: dict) -> None:
    """Our greedy decode under the fixture's settings: the reference's tokens (cut to the request
    where the reference's MDLM decodes its last block whole), the positions decided at every
    step, its NFE, backbone forwards (the prefill included) and tokens per step."""
    kwargs = decode["generation_config"]["kwargs"]
    cfg = DecodingConfig(
        block_size=kwargs["block_size"],
        window=kwargs["block_size"],
        threshold=None if decode["threshold"] >= 1 else decode["threshold"],
        max_new_tokens=decode["max_new_tokens"],
        align_inputs_to_blocks=kwargs["align_inputs_to_blocks"],
    )
    row = sampler.generate([decode["prompt"]], cfg, trace=True).rows[0]
    assert row.tokens == decode["tokens"][: len(decode["prompt"]) + decode["max_new_tokens"]]
    assert [[list(p) for p in s.decoded] for s in row.trace] == [s["decoded"] for s in decode["steps"]]
    assert (row.steps, row.nfe) == (decode["nfe"], decode["backbone_forwards"])
    assert row.tokens_per_step == pytest.approx(decode["parallelism_factor"])


def test_greedy_decodes_follow_the_reference_traces(release):
    family, ref, sm = release
    sampler = sm.sampler()
    fitting = [d for d in ref["decode"] if len(d["prompt"]) + d["max_new_tokens"] <= sm.trained_length]
    assert len(fitting) == 2
    for decode in fitting:
        _follows(sampler, decode)
    long = next(d for d in ref["decode"] if d not in fitting)
    assert "longer than the context" in sampler.request_problem(
        long["prompt"], DecodingConfig(block_size=4, max_new_tokens=long["max_new_tokens"])
    )


@pytest.mark.parametrize("name", ["bd3lm", "dit-bd3lm"])
def test_bd3lm_infills_follow_the_reference_traces(name):
    ref = _reference(name)
    sm = load_sampling_model(read_source(FIXTURES / ref["release"], base=BASE), Ranks(), device="cpu")
    sampler = sm.sampler()
    for infill in ref["infill"]:
        threshold = None if infill["threshold"] >= 1 else infill["threshold"]
        cfg = DecodingConfig(block_size=4, window=4, threshold=threshold, max_new_tokens=0, cache_infill_input=True)
        row = sampler.generate([infill["prompt"]], cfg, trace=True).rows[0]
        assert row.tokens == infill["tokens"]
        assert [[list(p) for p in s.decoded] for s in row.trace] == [s["decoded"] for s in infill["steps"]]
        assert row.steps == infill["nfe"] and row.tokens_per_step == pytest.approx(infill["parallelism_factor"])
        # One prefill forward; the reference caches each decided block in a forward of its own
        # (its fused cache is off for infills), here it joins the next block's first step.
        blocks = len({tuple(s["queried"]) for s in infill["steps"]})
        assert row.nfe == row.steps + 1 and infill["backbone_forwards"] == row.steps + 1 + blocks
        plain = sampler.generate(
            [infill["prompt"]], DecodingConfig(block_size=4, window=4, threshold=threshold, max_new_tokens=0)
        )
        assert plain.rows[0].tokens != row.tokens  # without the cache the right context is never seen


def test_unaligned_decodes_follow_the_reference_traces(release):
    """align_inputs_to_blocks false, as the paper's throughput scripts decode: the first block at
    the prompt's end (P = 5, not a multiple of either family's block; P = 8, one), BD3-LM with the
    whole prompt prefilled and its blocks straddling two of the model's, and a request that is not
    a whole number of blocks (18 new tokens: MDLM's reference decodes 24 and returns them all)."""
    family, ref, sm = release
    sampler = sm.sampler()
    assert len(ref["decode_unaligned"]) == 6
    for decode in ref["decode_unaligned"]:
        assert decode["generation_config"]["kwargs"]["align_inputs_to_blocks"] is False
        _follows(sampler, decode)
