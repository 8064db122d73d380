"""The baselines' decoders (sampling/masked_sampler.py): the cached BD3-LM decode equals the decode
the training forward computes with no cache, the MDLM decode its bidirectional forward over the
whole canvas, one row at a time or batched, as the reference decodes (docs/method.md, "The
baselines"): aligned blocks, the most confident MASK plus every one at the threshold per step."""

from dataclasses import replace

import pytest
import torch

from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.masked_sampler import MaskedDiffusionSampler
from tests.conftest import debug_config, randomized

CONTEXT = 32


@pytest.fixture(scope="module")
def model():
    """A random model whose attention is far from uniform (q and k scaled up, a faint MASK
    embedding), so that its tokens and confidences vary along the canvas."""
    torch.manual_seed(0)
    cfg = debug_config(max_seq_len=CONTEXT, attention_impl="sdpa")
    m = SetDiffusionTransformer(cfg)
    weights = randomized(m.state_dict(), 1)
    weights["embed_tokens.weight"] *= 3
    weights["embed_tokens.weight"][cfg.mask_token_id] *= 0.05
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] *= 3
    m.load_state_dict(weights)
    return m.eval()


def reference_decode(model, family, prompt, cfg):
    """The reference's loop, written out on the training forward (no cache): blocks of S from the
    prompt's end rounded down, ceil(N / S) of them; each step scores the block and commits the
    most confident MASK and every one at the threshold. Returns (tokens, steps, trace)."""
    mask, size = model.config.mask_token_id, cfg.block_size
    canvas = list(prompt) + [mask] * cfg.max_new_tokens
    start = len(prompt) // size * size
    steps, trace = 0, []
    for b in range(-(-cfg.max_new_tokens // size)):
        lo, hi = start + b * size, min(start + (b + 1) * size, len(canvas))
        while mask in canvas[lo:hi]:
            x = torch.tensor([canvas])
            if family == "mdlm":
                padded = torch.tensor([canvas + [mask] * (CONTEXT - len(canvas))])
                positions = torch.arange(CONTEXT)[None]
                logits = model(None, padded, positions, groups=torch.zeros_like(padded))[0, lo:hi]
            else:
                positions = torch.arange(len(canvas))[None]
                logits = model(x, x, positions, groups=positions // size)[0, lo:hi]
            probs = logits.index_fill(-1, torch.tensor([mask]), float("-inf")).softmax(-1)
            conf, tok = probs.max(-1)
            open_ = torch.tensor([t == mask for t in canvas[lo:hi]])
            conf = torch.where(open_, conf, -1.0)
            pick = torch.zeros_like(open_)
            pick[conf.argmax()] = True
            if cfg.threshold is not None:
                pick |= open_ & (conf >= cfg.threshold)
            new = [(lo + j, int(tok[j])) for j in range(hi - lo) if pick[j]]
            for p, t in new:
                canvas[p] = t
            steps += 1
            trace.append(new)
        if any(t in cfg.eos_token_ids for t in canvas[len(prompt) : hi]):
            end = next(i for i in range(len(prompt), hi) if canvas[i] in cfg.eos_token_ids) + 1
            return [t for t in canvas[:end] if t != mask], steps, trace
    return [t for t in canvas if t != mask], steps, trace


PROMPTS = [[5, 9, 11, 3, 7], [2, 4, 6, 8], [13], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
"""Prompt lengths 5, 4, 1 and 11: a block-aligned one, one shorter than a block, others not."""


@pytest.mark.parametrize("family", ["bd3lm", "mdlm"])
@pytest.mark.parametrize("threshold", [None, 0.05])
def test_decodes_as_the_reference_loop_alone_and_batched(model, family, threshold):
    cfg = DecodingConfig(block_size=4, window=4, threshold=threshold, max_new_tokens=12)
    sampler = MaskedDiffusionSampler(
        model, family=family, mask_token_id=model.config.mask_token_id, context_len=CONTEXT
    )
    batched = sampler.generate(PROMPTS, cfg, trace=True)
    for prompt, row in zip(PROMPTS, batched.rows):
        tokens, steps, trace = reference_decode(model, family, prompt, cfg)
        assert row.tokens == tokens and row.steps == steps
        assert [t.decoded for t in row.trace] == trace
        alone = sampler.generate([prompt], cfg).rows[0]
        assert alone.tokens == row.tokens and alone.steps == row.steps
    if threshold is not None:  # the threshold decides several tokens in some steps
        assert any(len(t.decoded) > 1 for r in batched.rows for t in r.trace)
    else:
        assert all(r.tokens_per_step == 1 for r in batched.rows)


def test_a_long_prompt_is_prefilled_once_then_decoded_with_the_cache(model):
    cfg = DecodingConfig(block_size=4, window=4, max_new_tokens=8)
    sampler = MaskedDiffusionSampler(
        model, family="bd3lm", mask_token_id=model.config.mask_token_id, context_len=CONTEXT
    )
    row = sampler.generate([PROMPTS[3]], cfg).rows[0]
    assert row.nfe == row.steps + 1  # the aligned prefix (8 tokens): one prefill forward
    # blocks [8, 12) and [12, 16): ceil(8 / 4) blocks from the aligned prompt end, as the reference
    # counts them, leave positions 16-18 undecided (dropped)
    assert row.prompt_len == 11 and row.num_decoded == 1 + 4 and len(row.tokens) == 16


def test_eos_ends_the_completion_after_its_block(model):
    mask = model.config.mask_token_id
    cfg = DecodingConfig(block_size=4, window=4, max_new_tokens=12)
    free = MaskedDiffusionSampler(model, family="bd3lm", mask_token_id=mask, context_len=CONTEXT)
    tokens = free.generate([PROMPTS[1]], cfg).rows[0].tokens
    eos = tokens[5]  # the second token of the completion
    row = free.generate([PROMPTS[1]], DecodingConfig(**{**cfg.__dict__, "eos_token_ids": (eos,)})).rows[0]
    assert row.finish_reason == "stop" and row.tokens == tokens[: tokens.index(eos, 4) + 1]


def test_spans_of_a_prompt_are_infilled(model):
    mask = model.config.mask_token_id
    prompt = [5, 9, mask, mask, mask, 3, 7, 1, 2]
    for family in ("bd3lm", "mdlm"):
        sampler = MaskedDiffusionSampler(model, family=family, mask_token_id=mask, context_len=CONTEXT)
        row = sampler.generate([prompt], DecodingConfig(block_size=4, window=4, max_new_tokens=0)).rows[0]
        assert len(row.tokens) == len(prompt) and mask not in row.tokens and row.num_decoded == 3
        assert [row.tokens[i] for i in (0, 1, 5, 6, 7, 8)] == [5, 9, 3, 7, 1, 2]


def reference_cached_infill(model, prompt, size):
    """The reference's BD3-LM infill, on the training forward: the prompt's whole blocks (MASKs
    and right context included), then the span's blocks decoded so far and the block being
    decoded, one sequence whose x0 stream is clean and whose last block is the noisy one; one
    token per step."""
    mask = model.config.mask_token_id
    canvas = list(prompt)
    context = canvas[: len(canvas) // size * size]
    for lo in sorted({i // size * size for i, t in enumerate(prompt) if t == mask}):
        hi = min(lo + size, len(canvas))
        while mask in canvas[lo:hi]:
            x = torch.tensor([context + canvas[lo:hi]])
            positions = torch.arange(x.shape[1])[None]
            logits = model(x, x, positions, groups=positions // size)[0, len(context) :]
            probs = logits.index_fill(-1, torch.tensor([mask]), float("-inf")).softmax(-1)
            conf, tok = probs.max(-1)
            j = int(torch.where(torch.tensor([t == mask for t in canvas[lo:hi]]), conf, -1.0).argmax())
            canvas[lo + j] = int(tok[j])
        context += canvas[lo:hi]
    return canvas


def test_bd3lm_infills_over_the_whole_input_cached_as_the_reference(model):
    mask = model.config.mask_token_id
    prompts = [  # a span inside a block, one across three blocks, one in the last, partial block, a short prompt
        [5, 9, mask, mask, 3, 7, 1, 2, 11],
        [5, 9, 11, 3, 7, mask, mask, mask, mask, mask, mask, 1, 2, 3, 4, 5, 6, 7],
        [1, 2, 3, 4, 5, 6, 7, 8, 9, mask, mask],
        [5, mask, 9],
    ]
    cfg = DecodingConfig(block_size=4, window=4, max_new_tokens=0, cache_infill_input=True)
    sampler = MaskedDiffusionSampler(model, family="bd3lm", mask_token_id=mask, context_len=CONTEXT)
    rows = sampler.generate(prompts, cfg).rows
    for prompt, row in zip(prompts, rows):
        assert row.tokens == reference_cached_infill(model, prompt, 4)
        assert row.nfe == row.steps + (len(prompt) >= 4)  # the whole blocks: one prefill forward
        assert sampler.generate([prompt], cfg).rows[0].tokens == row.tokens  # alone as batched
    # The right context changes the fills (without the cache it lies in blocks the span never sees).
    plain = sampler.generate(prompts, DecodingConfig(block_size=4, window=4, max_new_tokens=0)).rows
    assert [r.tokens for r in plain] != [r.tokens for r in rows]
    # Cached tokens and blocks past the context are refused, as every decode past it is here.
    long = [1] * 14 + [mask] * 8 + [2] * 3  # 24 cached, blocks [12, 24) run to position 36
    assert "past context_len = 32" in sampler.request_problem(long, cfg)
    assert sampler.request_problem(long, replace(cfg, cache_infill_input=False)) is None
    # Two spans, the last in a block cut short: 16 cached, blocks [8, 18) run to position 26.
    short = MaskedDiffusionSampler(model, family="bd3lm", mask_token_id=mask, context_len=26)
    two = [1, 2, 3, 4, 5, 6, 7, 8, mask, 9, 10, 11, 12, 13, 14, 15, 16, mask]
    assert short.request_problem(two, cfg) is None
    assert "past context_len = 25" in MaskedDiffusionSampler(
        model, family="bd3lm", mask_token_id=mask, context_len=25
    ).request_problem(two, cfg)
    (row,) = short.generate([two], cfg).rows
    assert len(row.tokens) == len(two) and mask not in row.tokens and row.steps == 2


def test_requests_it_cannot_decode(model):
    mask = model.config.mask_token_id
    sampler = MaskedDiffusionSampler(model, family="bd3lm", mask_token_id=mask, context_len=CONTEXT)
    assert "needs a block size" in sampler.request_problem([1, 2], DecodingConfig(max_new_tokens=4))
    assert "longer than the context" in sampler.request_problem(
        [1] * 30, DecodingConfig(block_size=4, max_new_tokens=4)
    )
    with pytest.raises(ValueError, match="family must be one of mdlm, bd3lm"):
        MaskedDiffusionSampler(model, family="bd3", mask_token_id=mask, context_len=CONTEXT)
