"""Set-causal attention: the mask against the rule, and every implementation against dense."""

import itertools
from functools import partial

import pytest
import torch

from setdiff_megatron.core.attention import set_causal_attention, set_causal_mask
from setdiff_megatron.core.step_attention import set_causal_step_attention

IMPLS = ["sdpa", "fused"]


def rule(q: int, k: int, length: int) -> bool:
    """The rule of docs/method.md, "Set-causal attention", written over the 2L indices: stream and
    rank of an index are divmod(index, L)."""
    s_q, r_q = divmod(q, length)
    s_k, r_k = divmod(k, length)
    return (
        (s_q == 0 and s_k == 0 and r_q >= r_k) or (s_q == 1 and s_k == 0 and r_q > r_k) or (s_q == s_k and r_q == r_k)
    )


@pytest.mark.parametrize("length", range(1, 9))
def test_mask_equals_rule_exhaustively(length):
    mask = set_causal_mask(length)
    expected = torch.tensor([[rule(q, k, length) for k in range(2 * length)] for q in range(2 * length)])
    assert torch.equal(mask, expected)


def explicit_attention(q, k, v, length, valid_len=None):
    """Row by row softmax over the keys the rule allows (padding AND-ed on rows and columns)."""
    b, h, s, _ = q.shape
    groups = h // k.shape[1]
    out = torch.zeros_like(q)
    for bi, hi, qi in itertools.product(range(b), range(h), range(s)):
        keys = [
            ki
            for ki in range(s)
            if rule(qi, ki, length)
            and (valid_len is None or (qi % length < valid_len[bi] and ki % length < valid_len[bi]))
        ]
        if not keys:
            continue
        kk, vv = k[bi, hi // groups, keys], v[bi, hi // groups, keys]
        p = (kk @ q[bi, hi, qi] / q.shape[-1] ** 0.5).softmax(-1)
        out[bi, hi, qi] = p @ vv
    return out


@pytest.mark.parametrize("length", [1, 2, 5, 8])
def test_dense_equals_rule(length):
    g = torch.Generator().manual_seed(length)
    q = torch.randn(2, 4, 2 * length, 8, generator=g, dtype=torch.float64)
    k = torch.randn(2, 2, 2 * length, 8, generator=g, dtype=torch.float64)
    v = torch.randn(2, 2, 2 * length, 8, generator=g, dtype=torch.float64)
    valid = torch.tensor([length, max(length - 1, 0)])
    for vl in (None, valid):
        got = set_causal_attention(q, k, v, impl="dense", valid_len=vl)
        torch.testing.assert_close(got, explicit_attention(q, k, v, length, vl), rtol=0, atol=1e-12)


SHAPES = [  # (batch, heads, kv_heads, L, head_dim)
    (1, 1, 1, 1, 4),
    (2, 4, 2, 1, 8),
    (2, 4, 4, 7, 16),
    (3, 6, 2, 33, 8),
    (1, 8, 1, 64, 32),
    (2, 2, 2, 130, 16),
]


def _grads(impl, q, k, v, valid_len, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = set_causal_attention(q, k, v, impl=impl, valid_len=valid_len)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_impl_matches_dense_outputs_and_grads(impl, shape, dtype, tol, padded):
    b, h, g_, length, d = shape
    gen = torch.Generator().manual_seed(hash((shape, padded)) % 2**31)
    q = torch.randn(b, h, 2 * length, d, generator=gen, dtype=dtype)
    k = torch.randn(b, g_, 2 * length, d, generator=gen, dtype=dtype)
    v = torch.randn(b, g_, 2 * length, d, generator=gen, dtype=dtype)
    dout = torch.randn(b, h, 2 * length, d, generator=gen, dtype=dtype)
    valid_len = torch.randint(0, length + 1, (b,), generator=gen) if padded else None
    expected = _grads("dense", q, k, v, valid_len, dout)
    got = _grads(impl, q, k, v, valid_len, dout)
    for name, e, a in zip(["out", "dq", "dk", "dv"], expected, got):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol, msg=f"{impl} {name} differs")


@pytest.mark.parametrize("impl", ["dense", *IMPLS])
@pytest.mark.parametrize("shape", SHAPES[1:], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("padded", [False, True], ids=["nopad", "pad"])
def test_query_rows_only_equal_the_query_half(impl, shape, padded):
    """The last layer's mode: q holds only the query stream. Its outputs and the gradients of
    q, k and v equal those of the full computation when only the query half is read."""
    b, h, g_, length, d = shape
    gen = torch.Generator().manual_seed(hash((shape, padded, "rows")) % 2**31)
    q = torch.randn(b, h, 2 * length, d, generator=gen, dtype=torch.float64)
    k = torch.randn(b, g_, 2 * length, d, generator=gen, dtype=torch.float64)
    v = torch.randn(b, g_, 2 * length, d, generator=gen, dtype=torch.float64)
    dout = torch.randn(b, h, 2 * length, d, generator=gen, dtype=torch.float64)
    dout[:, :, :length] = 0  # nothing reads the clean rows
    valid_len = torch.randint(0, length + 1, (b,), generator=gen) if padded else None
    out, dq, dk, dv = _grads("dense", q, k, v, valid_len, dout)
    got = _grads(impl, q[:, :, length:], k, v, valid_len, dout[:, :, length:])
    for name, e, a in zip(["out", "dq", "dk", "dv"], [out[:, :, length:], dq[:, :, length:], dk, dv], got):
        torch.testing.assert_close(a, e, rtol=1e-10, atol=1e-10, msg=f"{impl} {name} differs")


def documents_reference(q, k, v, valid_len, document_ids):
    """Explicit softmax under set_causal_mask(L) & same document (& padding), written apart from
    the regrouping under test."""
    length = k.shape[2] // 2
    groups = q.shape[1] // k.shape[1]
    doc = document_ids.repeat(1, 2)
    real = (torch.arange(length) < valid_len[:, None]).repeat(1, 2)
    allowed = set_causal_mask(length) & (doc[:, :, None] == doc[:, None, :]) & real[:, :, None] & real[:, None, :]
    allowed = allowed[:, None, -q.shape[2] :]
    scores = q @ k.repeat_interleave(groups, 1).transpose(-1, -2) / q.shape[-1] ** 0.5
    has_key = allowed.any(-1, keepdim=True)
    p = scores.masked_fill(~allowed, float("-inf")).masked_fill(~has_key, 0.0).softmax(-1)
    return (p @ v.repeat_interleave(groups, 1)) * has_key


def _document_case(shape, dtype, seed):
    """q/k/v/dout, padding (a fully padded row included) and up to 4 documents per row."""
    b, h, g_, length, d = shape
    gen = torch.Generator().manual_seed(seed)
    q, dout = (torch.randn(b, h, 2 * length, d, generator=gen, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(b, g_, 2 * length, d, generator=gen, dtype=dtype) for _ in range(2))
    valid_len = torch.randint(0, length + 1, (b,), generator=gen)
    valid_len[0] = length
    document_ids = torch.randint(0, 4, (b, length), generator=gen)
    return q, k, v, dout, valid_len, document_ids


def _document_grads(fn, q, k, v, dout):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    out = fn(q, k, v)
    return (out, *torch.autograd.grad(out, (q, k, v), dout))


@pytest.mark.parametrize("impl", ["dense", *IMPLS])
@pytest.mark.parametrize(
    "shape", [(3, 4, 2, 9, 8), (2, 6, 3, 33, 16), (1, 2, 1, 1, 4)], ids=lambda s: "x".join(map(str, s))
)
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-5)], ids=["f64", "f32"])
@pytest.mark.parametrize("query_rows_only", [False, True], ids=["both", "queries"])
def test_document_mask_matches_masked_dense(impl, shape, dtype, tol, query_rows_only):
    """Outputs and q/k/v gradients of every implementation under document ids equal an explicit
    softmax under the set-causal mask AND-ed with same-document, with padding and GQA."""
    q, k, v, dout, valid_len, docs = _document_case(shape, dtype, hash((shape, query_rows_only)) % 2**31)
    rows = slice(shape[3] if query_rows_only else 0, None)
    got = _document_grads(
        partial(set_causal_attention, impl=impl, valid_len=valid_len, document_ids=docs),
        q[:, :, rows],
        k,
        v,
        dout[:, :, rows],
    )
    expected = _document_grads(
        lambda q_, k_, v_: documents_reference(q_, k_, v_, valid_len, docs), q[:, :, rows], k, v, dout[:, :, rows]
    )
    for name, e, a in zip(["out", "dq", "dk", "dv"], expected, got):
        torch.testing.assert_close(a, e, rtol=tol, atol=tol, msg=f"{impl} {name} differs")


@pytest.mark.parametrize("impl", ["dense", *IMPLS])
def test_no_attention_crosses_a_document_boundary(impl):
    """Changing every q/k/v row of one document leaves every other rank's output as it was."""
    q, k, v, _, valid_len, docs = _document_case((2, 4, 2, 24, 8), torch.float64, 5)
    attend = partial(set_causal_attention, impl=impl, valid_len=valid_len, document_ids=docs)
    changed = (docs == 1).repeat(1, 2)[:, None, :, None]
    noise = torch.randn_like(q)
    before = attend(q, k, v)
    after = attend(q + changed * noise, k + changed * noise[:, :2], v + changed * noise[:, 2:])
    torch.testing.assert_close(after * ~changed, before * ~changed, rtol=0, atol=1e-14)
    assert (after - before).abs().amax() > 1e-3  # the changed document itself did change


def test_one_document_equals_no_document_ids():
    q, k, v, _, valid_len, docs = _document_case((2, 4, 2, 12, 8), torch.float64, 6)
    torch.testing.assert_close(
        set_causal_attention(q, k, v, valid_len=valid_len, document_ids=torch.zeros_like(docs)),
        set_causal_attention(q, k, v, valid_len=valid_len),
        rtol=0,
        atol=1e-14,
    )


def test_fused_accepts_strided_inputs_and_bf16():
    """The model hands over transposed [B, S, H, D] views; bf16 runs with fp32 statistics."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(2, 40, 4, 16, generator=gen)
    q = base.transpose(1, 2)
    k = v = base[:, :, :2].transpose(1, 2)
    torch.testing.assert_close(set_causal_attention(q, k, v, impl="fused"), set_causal_attention(q, k, v, impl="dense"))
    out16 = set_causal_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), impl="fused")
    torch.testing.assert_close(out16.float(), set_causal_attention(q, k, v, impl="dense"), atol=3e-2, rtol=3e-2)


def explicit_step(q, k, v, kc, vc, num_commit, key_valid=None):
    """Commit row a: cache + commits <= a; query row: cache + all commits + itself."""
    b, h, t, d = q.shape
    groups = h // k.shape[1]
    c = kc.shape[2]
    keys_all, values_all = torch.cat([kc, k], 2), torch.cat([vc, v], 2)
    out = torch.zeros_like(q)
    for bi, hi, ti in itertools.product(range(b), range(h), range(t)):
        cols = list(range(c)) + [c + j for j in range(num_commit) if j <= ti or ti >= num_commit]
        if ti >= num_commit:
            cols.append(c + ti)
        if key_valid is not None:
            cols = [j for j in cols if j == c + ti or j >= c + num_commit or key_valid[bi, j]]
        kk, vv = keys_all[bi, hi // groups, cols], values_all[bi, hi // groups, cols]
        out[bi, hi, ti] = (kk @ q[bi, hi, ti] / d**0.5).softmax(-1) @ vv
    return out


@pytest.mark.parametrize("seed", range(6))
def test_step_equals_dense_rule(seed):
    gen = torch.Generator().manual_seed(seed)
    b, h, g_, d = 2, 4, 2, 8
    c = int(torch.randint(0, 6, (), generator=gen))
    n = int(torch.randint(0, 4, (), generator=gen))
    m = int(torch.randint(1 if n == 0 else 0, 4, (), generator=gen))
    t = n + m
    q = torch.randn(b, h, t, d, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(b, g_, t, d, generator=gen, dtype=torch.float64) for _ in range(2))
    kc, vc = (torch.randn(b, g_, c, d, generator=gen, dtype=torch.float64) for _ in range(2))
    got = set_causal_step_attention(q, k, v, kc, vc, num_commit=n)
    torch.testing.assert_close(got, explicit_step(q, k, v, kc, vc, n), rtol=0, atol=1e-12)
    cache_mask = torch.rand(b, c, generator=gen) > 0.3
    commit_mask = torch.rand(b, n, generator=gen) > 0.3
    got = set_causal_step_attention(q, k, v, kc, vc, num_commit=n, cache_mask=cache_mask, commit_mask=commit_mask)
    expected = explicit_step(q, k, v, kc, vc, n, torch.cat([cache_mask, commit_mask], 1))
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


def test_step_matches_training_attention():
    """Committing ranks 0..j-1 and querying rank j reproduces the training query output."""
    gen = torch.Generator().manual_seed(3)
    length = 6
    q = torch.randn(1, 2, 2 * length, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, 2 * length, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    train = set_causal_attention(q, k, v, impl="dense")
    for j in range(length):
        step = set_causal_step_attention(
            q[:, :, [length + j]],
            k[:, :, [length + j]],
            v[:, :, [length + j]],
            k[:, :, :j],
            v[:, :, :j],
            num_commit=0,
        )
        torch.testing.assert_close(step[:, :, 0], train[:, :, length + j], rtol=0, atol=1e-12)


BAD = [
    (dict(q=(2, 4, 8), k=(2, 4, 8, 4), v=(2, 4, 8, 4)), "4-D"),
    (dict(q=(2, 4, 7, 4), k=(2, 4, 7, 4), v=(2, 4, 7, 4)), "two streams"),
    (dict(q=(2, 4, 8, 4), k=(2, 3, 8, 4), v=(2, 3, 8, 4)), "multiple of key/value heads"),
    (dict(q=(2, 4, 8, 4), k=(2, 4, 6, 4), v=(2, 4, 6, 4)), "must agree"),
    (dict(q=(2, 4, 8, 4), k=(2, 4, 8, 4), v=(2, 4, 8, 2)), "same shape"),
]


@pytest.mark.parametrize("shapes,msg", BAD)
def test_bad_shapes_raise(shapes, msg):
    q, k, v = (torch.zeros(shapes[n]) for n in "qkv")
    with pytest.raises(ValueError, match=msg):
        set_causal_attention(q, k, v)


def test_bad_impl_and_valid_len_raise():
    x = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="attention_impl must be one of"):
        set_causal_attention(x, x, x, impl="flash9")
    with pytest.raises(ValueError, match="valid_len"):
        set_causal_attention(x, x, x, valid_len=torch.tensor([5]))
    with pytest.raises(ValueError, match="document_ids must have shape"):
        set_causal_attention(x, x, x, document_ids=torch.zeros(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="num_commit"):
        set_causal_step_attention(x, x, x, x[:, :, :0], x[:, :, :0], num_commit=9)
