"""The torch model: set-causal independence, AR equivalence, cache parity (also in the DiT
layout), learning, the DiT's float32 LayerNorm."""

import math

import pytest
import torch

from setdiff_megatron.core.loss import token_nll
from setdiff_megatron.core.orders import Staggered, Uniform, sample_order
from setdiff_megatron.models.torch_model import LayerNorm, SetDiffusionTransformer
from tests.conftest import debug_config, dit_config, randomized

MASK = 63


def test_query_rank_depends_only_on_earlier_clean_ranks(debug_model):
    length = 7
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 60, (1, length), generator=gen)
    perm = torch.randperm(length, generator=gen)[None]
    clean = tokens.gather(1, perm)
    query = torch.full_like(clean, MASK)
    base = debug_model(clean, query, perm)
    for j in range(length):
        perturbed = clean.clone()
        perturbed[0, j] = (perturbed[0, j] + 1) % 60
        changed = (debug_model(perturbed, query, perm) - base).abs().amax(-1)[0] > 1e-12
        assert changed.tolist() == [r > j for r in range(length)], f"perturbing rank {j}"


def test_d1_loss_is_left_to_right_next_token_nll(debug_model):
    gen = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 60, (3, 12), generator=gen)
    loss = debug_model.loss(tokens, Staggered(d=1), generator=gen).loss
    positions = torch.arange(12)[None].repeat(3, 1)
    logits = debug_model(tokens, torch.full_like(tokens, MASK), positions)
    # The query at position i sees tokens < i and predicts token i: next-token prediction.
    ar_nll = token_nll(logits, tokens, MASK).mean()
    assert math.isclose(loss.item(), ar_nll.item(), rel_tol=1e-12)


@pytest.mark.parametrize("impl", ["sdpa", "fused"])
def test_model_attention_impls_agree(impl):
    torch.manual_seed(0)
    dense = SetDiffusionTransformer(debug_config(attention_impl="dense", qk_norm=True)).double()
    other = SetDiffusionTransformer(debug_config(attention_impl=impl, qk_norm=True)).double()
    other.load_state_dict(dense.state_dict())
    tokens = torch.randint(0, 60, (2, 9))
    pad = torch.zeros(2, 9, dtype=torch.bool)
    pad[1, 7:] = True
    losses = []
    for model in (dense, other):
        out = model.loss(tokens, Uniform(), pad_mask=pad, generator=torch.Generator().manual_seed(5))
        out.loss.backward()
        losses.append(out.loss)
    assert math.isclose(losses[0].item(), losses[1].item(), rel_tol=1e-10)
    for (name, p), q in zip(dense.named_parameters(), other.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-9, atol=1e-10, msg=name)


@pytest.mark.parametrize("layout", ["qwen", "dit"])
def test_cached_steps_reproduce_training_logits(debug_model, layout):
    """Prefill a prompt, then commit ranks one set at a time: each query's logits equal the
    training forward's logits for that rank (the sampler's exactness rests on this), in both
    layouts of the body."""
    if layout == "dit":
        torch.manual_seed(0)
        debug_model = SetDiffusionTransformer(dit_config()).double()
        debug_model.load_state_dict(randomized(debug_model.state_dict()))
    length = 10
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 60, (2, length), generator=gen)
    perm = sample_order(Staggered(d=2), 2, length, generator=gen)
    clean = tokens.gather(1, perm)
    train_logits = debug_model(clean, torch.full_like(clean, MASK), perm)

    cache = debug_model.new_cache(2, capacity=length)
    debug_model.step(clean[:, :3], perm[:, :3], cache, num_commit=3)  # prefill ranks 0..2
    committed = 3
    for pending in (2, 1, 3):
        # Commit `pending` ranks and query the next two ranks in the same forward.
        commit = slice(committed, committed + pending)
        nxt = torch.arange(committed + pending, min(committed + pending + 2, length))
        tok = torch.cat([clean[:, commit], torch.full((2, len(nxt)), MASK)], 1)
        pos = torch.cat([perm[:, commit], perm[:, nxt]], 1)
        logits = debug_model.step(tok, pos, cache, num_commit=pending)
        committed += pending
        # Only the first queried rank is "next" in training; a later one sees fewer clean tokens
        # in training than in the step, so compare the first.
        torch.testing.assert_close(logits[:, 0], train_logits[:, committed], rtol=1e-9, atol=1e-9)
    assert cache.length == committed


def test_learns_a_small_corpus():
    """A tiny model drives the loss far below ln(vocab) on sequences it can infer."""
    torch.manual_seed(0)
    vocab, length = 64, 24
    model = SetDiffusionTransformer(debug_config(vocab_size=vocab, max_seq_len=length))
    gen = torch.Generator().manual_seed(0)
    # Arithmetic progressions mod 60: two revealed tokens determine the rest of the row.
    start = torch.randint(0, 60, (4096, 1), generator=gen)
    stride = torch.randint(1, 6, (4096, 1), generator=gen)
    corpus = (start + stride * torch.arange(length)) % 60
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    policy = Staggered(d=2)
    losses = []
    for _ in range(300):
        batch = corpus[torch.randint(0, len(corpus), (32,), generator=gen)]
        loss = model.loss(batch, policy, generator=gen).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    first, last = sum(losses[:10]) / 10, sum(losses[-20:]) / 20
    assert first > 0.9 * math.log(vocab - 1)
    assert last < 0.25 * math.log(vocab - 1), f"loss went from {first:.3f} to {last:.3f}"


def test_bad_inputs():
    model = SetDiffusionTransformer(debug_config(max_seq_len=8))
    x = torch.zeros(1, 9, dtype=torch.long)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(x, x, x)
    with pytest.raises(ValueError, match="batch, length"):
        model(x[0], x[0], x[0])
    for changes, msg in [
        (dict(num_heads=3), "hidden_size"),
        (dict(num_kv_heads=3), "multiple of num_kv_heads"),
        (dict(attention_impl="flash9"), "attention_impl"),
        (dict(mask_token_id=64), "mask_token_id"),
        (dict(num_layers=0), "num_layers"),
        (dict(norm="batchnorm"), "norm must be one of"),
        (dict(mlp="relu"), "mlp must be one of"),
        (dict(output_bias=True), "output_bias needs tie_embeddings: false"),
        (dict(mlp="gelu", num_experts=2), "SwiGLU experts without biases"),
    ]:
        with pytest.raises(ValueError, match=msg):
            debug_config(**changes)
    with pytest.raises(ValueError, match="capacity"):
        model.step(torch.zeros(1, 3, dtype=torch.long), torch.arange(3)[None], model.new_cache(1, 2), num_commit=3)


def test_num_params_matches_module():
    for cfg in (
        debug_config(),
        debug_config(tie_embeddings=False, qk_norm=True),
        dit_config(),
        dit_config(mlp="swiglu", tie_embeddings=True, output_bias=False),
    ):
        assert cfg.num_params() == sum(p.numel() for p in SetDiffusionTransformer(cfg).parameters())
    assert dit_config().intermediate_size == 4 * 64  # the DiT's MLP ratio


def test_layer_norm_computes_in_float32_without_a_bias():
    """The DiT's LayerNorm normalises bf16 activations in float32 and returns bf16, with a
    weight and no bias."""
    norm = LayerNorm(64, eps=1e-5)
    assert [n for n, _ in norm.named_parameters()] == ["weight"]
    with torch.no_grad():
        norm.weight.normal_()
    x = torch.randn(3, 64) * 100 + 50
    expected = torch.nn.functional.layer_norm(x.bfloat16().float(), (64,), norm.weight, None, 1e-5)
    out = norm(x.bfloat16())
    assert out.dtype == torch.bfloat16 and torch.equal(out, expected.bfloat16())


def test_identities_saved_before_the_layout_fields_read_as_the_defaults():
    """A checkpoint's model identity written before norm, mlp, mlp_bias and output_bias existed
    describes the Llama/Qwen body they default to, and resumes without a difference."""
    from setdiff_megatron.checkpoint.identity import config_from_identity, identity_difference, model_identity

    cfg = debug_config(tie_embeddings=False)
    old = {k: v for k, v in model_identity(cfg).items() if k not in ("norm", "mlp", "mlp_bias", "output_bias")}
    assert config_from_identity(old) == cfg
    assert identity_difference(old, model_identity(cfg)) is None
    assert "norm rmsnorm there, layernorm here" in identity_difference(old, model_identity(dit_config()))
