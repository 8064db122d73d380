"""The set sampler: exactness against the training forward, batch invariance, AR, parallel steps."""

from dataclasses import replace

import pytest
import torch

from setdiff_megatron.core.orders import Staggered
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig, RowPolicy, process_logits
from setdiff_megatron.sampling.sample_request import Request
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.sampling.step_compiler import StepCompiler
from setdiff_megatron.sampling.step_layout import bucket
from tests.conftest import debug_config

MASK = 63


class Recorder:
    """A StepModel that remembers every step's query logits."""

    def __init__(self, model):
        self.model, self.logits = model, []

    def new_cache(self, batch_size, capacity):
        return self.model.new_cache(batch_size, capacity)

    def step(self, tokens, position_ids, cache, num_commit, commit_valid=None):
        layout = cache.layout  # a packed step's logits, as [B, Q, V] in the batch's row order
        out = self.model.step(tokens, position_ids, cache, num_commit, commit_valid)
        self.logits.append((out if layout is None else layout.queries(out)).clone())
        return out


def random_prompts(gen, lengths, spans=()):
    """Prompts of the given lengths; `spans` = (start, length) MASK runs put into every prompt long enough."""
    prompts = []
    for n in lengths:
        p = torch.randint(0, 60, (n,), generator=gen).tolist()
        for start, size in spans:
            if start + size < n:
                p[start : start + size] = [MASK] * size
        prompts.append(p)
    return prompts


def scratch_queries(prompt, trace, step):
    """Per query of `step`: (clean tokens, clean positions, query position) of the training forward
    that scores it: the clean prefix is the prefill (visible tokens in position order), then every
    earlier step's decoded set in commit order; the query is the next rank."""
    tokens = [(p, t) for p, t in enumerate(prompt) if t != MASK]
    for earlier in trace[:step]:
        tokens += earlier.decoded
    return [([t for _, t in tokens], [p for p, _ in tokens], q) for q in trace[step].queried]


def training_logits(model, items):
    """Query logits [len(items), V] from one dense training forward per item (batched)."""
    length = max(len(toks) for toks, _, _ in items) + 1
    clean = torch.zeros(len(items), length, dtype=torch.long)
    pos = torch.zeros(len(items), length, dtype=torch.long)
    for i, (toks, positions, q) in enumerate(items):
        clean[i, : len(toks)] = torch.tensor(toks, dtype=torch.long)
        pos[i, : len(toks)] = torch.tensor(positions, dtype=torch.long)
        pos[i, len(toks)] = q
    logits = model(clean, torch.full_like(clean, MASK), pos)
    rank = torch.tensor([len(toks) for toks, _, _ in items])
    return logits[torch.arange(len(items)), rank]


@pytest.fixture
def models():
    torch.manual_seed(0)
    cached = SetDiffusionTransformer(debug_config(qk_norm=True)).double()
    dense = SetDiffusionTransformer(debug_config(qk_norm=True, attention_impl="dense")).double()
    dense.load_state_dict(cached.state_dict())
    return cached, dense


EXACTNESS_CASES = {
    "ar": (DecodingConfig(window=1, max_new_tokens=6), [5, 1, 8], ()),
    "span-k1": (DecodingConfig(window=3, max_new_tokens=7), [4, 9, 2, 6], ()),
    "span-tau": (DecodingConfig(window=5, threshold=0.025, max_new_tokens=9), [3, 7, 0, 5], ()),
    "fill-k2-tau": (
        DecodingConfig(window=4, fill_window=True, tokens_per_step=2, threshold=0.025, max_new_tokens=6),
        [6, 2, 9],
        (),
    ),
    "block-4": (DecodingConfig(window=8, block_size=4, threshold=0.025, max_new_tokens=9), [3, 6, 0], ()),
    "infill-2-spans": (DecodingConfig(window=4, threshold=0.025, max_new_tokens=3), [12, 10, 7], ((2, 3), (7, 2))),
    "infill-only-fill": (
        DecodingConfig(window=3, fill_window=True, tokens_per_step=2, max_new_tokens=0),
        [11, 9, 14],
        ((1, 2), (5, 3)),
    ),
    "sampled": (
        DecodingConfig(
            window=4,
            temperature=0.8,
            top_k=20,
            top_p=0.9,
            repetition_penalty=1.3,
            threshold=0.04,
            max_new_tokens=8,
            seed=3,
        ),
        [4, 6],
        ((1, 2),),
    ),
}


@pytest.mark.parametrize("case", list(EXACTNESS_CASES))
def test_every_step_equals_a_training_forward(models, case):
    cached, dense = models
    cfg, lengths, spans = EXACTNESS_CASES[case]
    prompts = random_prompts(torch.Generator().manual_seed(len(case)), lengths, spans)
    recorder = Recorder(cached)
    out = SetSampler(recorder, mask_token_id=MASK, context_len=128).generate(prompts, cfg, trace=True)
    assert len(recorder.logits) == max(r.nfe for r in out.rows)
    for forward, logits in enumerate(recorder.logits):
        # Every row joins at the first forward and retires in place after its last, so the batch
        # of a forward holds the rows not yet done, in order; a row with visible tokens spends its
        # first forward on its prefill, and decodes from the next one on.
        live = [i for i, r in enumerate(out.rows) if forward < r.nfe]
        assert logits.shape[0] == len(live)
        for slot_row, i in enumerate(live):
            step = forward - (out.rows[i].nfe - out.rows[i].steps)
            if step < 0:
                continue
            items = scratch_queries(prompts[i], out.rows[i].trace, step)
            want = training_logits(dense, items)
            torch.testing.assert_close(logits[slot_row, : len(items)], want, rtol=0, atol=1e-5)
    if cfg.threshold is not None:  # rows then commit different numbers of tokens in a step
        assert any(len({len(r.trace[s].decoded) for r in out.rows if r.steps > s}) > 1 for s in range(3))
    for prompt, row in zip(prompts, out.rows):
        assert [t for t in prompt if t != MASK] == [t for t, p in zip(row.tokens, prompt) if p != MASK]
        assert MASK not in row.tokens and len(row.tokens) == len(prompt) + cfg.max_new_tokens
        assert sum(len(s.decoded) for s in row.trace) == row.num_decoded == prompt.count(MASK) + cfg.max_new_tokens
        assert all(len(s.decoded) <= len(s.queried) <= cfg.window for s in row.trace)


def test_batch_invariance_of_greedy_decoding(debug_model):
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 20, (16,), generator=gen).tolist()
    prompts = random_prompts(gen, lengths, ((3, 4),))
    # The random model mostly emits 41, 62 and 7; tau sits among its confidences.
    cfg = DecodingConfig(window=6, threshold=0.025, max_new_tokens=12, eos_token_ids=(62,), stop_sequences=((7, 7),))
    sampler = SetSampler(debug_model, mask_token_id=MASK, context_len=128)
    batched = sampler.generate(prompts, cfg).rows
    chunked = sampler.generate(prompts, cfg, batch_size=5).rows
    singles = [sampler.generate([p], cfg).rows[0] for p in prompts]
    for one, many, some in zip(singles, batched, chunked):
        assert one.tokens == many.tokens == some.tokens
        assert one.nfe == many.nfe == some.nfe and one.finish_reason == many.finish_reason
    steps = {r.steps for r in batched}
    assert len(steps) > 3, "rows should progress at different paces"
    assert {r.finish_reason for r in batched} == {"stop", "length"}


def test_dropless_moe_decodes_the_same_rows_in_any_batch():
    """Routing is per token without a capacity, so batch invariance stays exact for an MoE model."""
    torch.manual_seed(0)
    model = (
        SetDiffusionTransformer(
            debug_config(num_experts=4, moe_top_k=2, moe_intermediate_size=32, num_shared_experts=1)
        )
        .double()
        .eval()
    )
    gen = torch.Generator().manual_seed(8)
    prompts = random_prompts(gen, torch.randint(1, 16, (8,), generator=gen).tolist(), ((2, 3),))
    cfg = DecodingConfig(window=4, threshold=0.05, max_new_tokens=8)
    sampler = SetSampler(model, mask_token_id=MASK, context_len=128)
    batched, chunked = sampler.generate(prompts, cfg).rows, sampler.generate(prompts, cfg, batch_size=3).rows
    singles = [sampler.generate([p], cfg).rows[0] for p in prompts]
    for one, many, some in zip(singles, batched, chunked):
        assert one.tokens == many.tokens == some.tokens and one.nfe == many.nfe == some.nfe


def test_window_one_is_greedy_left_to_right(debug_model):
    prompt = [3, 17, 42, 8]
    out = SetSampler(debug_model, mask_token_id=MASK, context_len=128).generate(
        [prompt], DecodingConfig(window=1, max_new_tokens=10)
    )
    seq = list(prompt)
    for i in range(len(prompt), len(prompt) + 10):
        x = torch.tensor([seq + [0]])
        # Identity order: the query at position i sees the tokens before i.
        logits = debug_model(x, torch.full_like(x, MASK), torch.arange(i + 1)[None])[0, i]
        logits[MASK] = float("-inf")
        seq.append(int(logits.argmax()))
    row = out.rows[0]
    assert row.tokens == seq and row.steps == 10 and row.nfe == 11


@pytest.mark.parametrize("fill_window", [False, True])
def test_block_decoding_finishes_each_block_before_the_next(copying_model, fill_window):
    """BD3-style decoding: every query lies in the block (positions [4j, 4j + 4)) of the leftmost
    masked position, however wide the window and however confident the model is further right."""
    model, rows = copying_model
    cfg = DecodingConfig(window=16, block_size=4, threshold=0.5, fill_window=fill_window, max_new_tokens=13)
    free = SetSampler(model, mask_token_id=MASK, context_len=32).generate(
        rows[:4, :3].tolist(), replace(cfg, block_size=None), trace=True
    )
    assert max(len(s.queried) for r in free.rows for s in r.trace) > 4, "without blocks the window reaches further"
    out = SetSampler(model, mask_token_id=MASK, context_len=32).generate(rows[:4, :3].tolist(), cfg, trace=True)
    for row in out.rows:
        todo = set(range(3, 16))
        for step in row.trace:
            block = min(todo) // 4
            assert step.queried and all(p // 4 == block for p in step.queried)
            todo -= {p for p, _ in step.decoded}
        assert not todo and row.steps >= 4  # blocks [3, 4), [4, 8), [8, 12), [12, 16)


def test_stop_sequence_cuts_completion(debug_model):
    sampler = SetSampler(debug_model, mask_token_id=MASK, context_len=128)
    free = sampler.generate([[1, 2, 3]], DecodingConfig(window=4, max_new_tokens=12)).rows[0]
    stop = tuple(free.completion[4:6])
    cut = sampler.generate([[1, 2, 3]], DecodingConfig(window=4, max_new_tokens=12, stop_sequences=(stop,))).rows[0]
    first = next(i for i in range(len(free.completion) - 1) if tuple(free.completion[i : i + 2]) == stop)
    assert cut.finish_reason == "stop" and cut.completion == free.completion[: first + 2]
    assert cut.steps <= free.steps


def test_long_output_keeps_the_prompt_and_evicts_the_middle(debug_model):
    """Past the context, each row keeps its prompt and drops its oldest generated entries, in
    chunks of at least 1/8 of the room after the prompt. Cached K/V are never recomputed, so the
    check is on the cache itself: after each step it holds the prompt's entries unchanged, then
    the previous entries less the dropped ones, then the step's commits."""
    prompt, context = [7, 30, 11, 52, 4, 19], 16
    snapshots = []
    inner = debug_model.step

    class Spy:
        new_cache = debug_model.new_cache

        def step(self, tokens, positions, cache, num_commit, commit_valid=None):
            out = inner(tokens, positions, cache, num_commit, commit_valid)
            snapshots.append(cache.keys[:, 0, :, : int(cache.lengths[0])].clone())
            return out

    cfg = DecodingConfig(window=3, threshold=0.025, max_new_tokens=40)
    row = SetSampler(Spy(), mask_token_id=MASK, context_len=context).generate([prompt], cfg, trace=True).rows[0]
    assert len(row.tokens) == len(prompt) + 40 and row.tokens[: len(prompt)] == prompt
    budget, sink = context - 1, len(prompt)
    chunk, length, pending, evictions = (budget - sink) // 8, sink, 0, 0
    for before, after, trace in zip(snapshots, snapshots[1:], row.trace):
        drop = max(length + pending - budget, chunk) if length + pending > budget else 0
        kept = torch.cat([before[..., :sink, :], before[..., sink + drop :, :]], dim=2)
        assert after.shape[2] == length - drop + pending <= budget
        torch.testing.assert_close(after[..., : length - drop, :], kept, rtol=0, atol=0)
        length, pending, evictions = length - drop + pending, len(trace.decoded), evictions + (drop > 0)
    assert evictions >= 5


def test_metrics(debug_model):
    out = SetSampler(debug_model, mask_token_id=MASK, context_len=128).generate(
        [[1, 2], [3, 4, 5, 6]], DecodingConfig(window=4, tokens_per_step=2, max_new_tokens=8)
    )
    m = out.metrics
    assert m.num_rows == 2 and m.num_tokens == 16 and m.row_steps == 8 and m.tokens_per_step == 2
    assert m.forwards == 1 + 4 and 0 < m.prefill_s < m.total_s and 0 < m.forward_s < m.total_s
    assert 0 < m.bookkeeping_share < 1 and m.tokens_per_s > 0
    assert all(r.nfe == 5 and r.tokens_per_step == 2 and 0 < r.prefill_s < r.seconds for r in out.rows)


def test_sampling_is_deterministic_given_the_seed(debug_model):
    sampler = SetSampler(debug_model, mask_token_id=MASK, context_len=128)
    prompts = [[1, 2, 3], [4, MASK, MASK, 5]]

    def sample(seed):
        cfg = DecodingConfig(window=4, temperature=1.0, top_p=0.95, max_new_tokens=10, seed=seed)
        return [r.tokens for r in sampler.generate(prompts, cfg).rows]

    assert sample(1) == sample(1) != sample(2)


def test_logit_processing():
    logits = torch.tensor([[[2.0, 1.0, 0.0, -1.0, 5.0]]])  # token 4 is MASK
    canvas = torch.tensor([[0, 3]])

    def processed(**kw):
        return process_logits(logits, canvas, RowPolicy.from_configs([DecodingConfig(**kw)]), 4)

    def kept(**kw):
        return torch.isfinite(processed(**kw))[0, 0].tolist()

    assert kept() == [True, True, True, True, False]
    assert kept(top_k=2) == [True, True, False, False, False]
    # softmax over [2, 1, 0, -1] is about [.64, .24, .09, .03]: 0.7 needs the first two tokens.
    assert kept(top_p=0.7) == [True, True, False, False, False] and kept(top_p=0.6) == [True] + [False] * 4
    penalized = processed(repetition_penalty=2.0)[0, 0, :4]
    assert penalized.tolist() == [1.0, 1.0, 0.0, -2.0]  # tokens 0 and 3 are in the row
    assert processed(temperature=0.5)[0, 0, 0] == 4.0


def test_rows_of_one_batch_each_get_their_own_policy():
    """Four policies in one batch: each row's processed logits are what that row gets alone."""
    logits = torch.randn(4, 3, 9, generator=torch.Generator().manual_seed(0))
    canvas = torch.tensor([[0, 3], [1, 1], [5, 8], [2, 0]])
    cfgs = [
        DecodingConfig(top_k=2),
        DecodingConfig(top_p=0.5, temperature=0.7),
        DecodingConfig(),
        DecodingConfig(repetition_penalty=1.5, top_k=4),
    ]
    together = process_logits(logits, canvas, RowPolicy.from_configs(cfgs), 4)
    for i, cfg in enumerate(cfgs):
        alone = process_logits(logits[i : i + 1], canvas[i : i + 1], RowPolicy.from_configs([cfg]), 4)
        assert torch.equal(together[i : i + 1], alone)


@pytest.mark.parametrize(
    "changes, match",
    [
        (dict(window=0), "window must be >= 1"),
        (dict(tokens_per_step=0), "tokens_per_step must be >= 1"),
        (dict(block_size=0), "block_size must be >= 1"),
        (dict(threshold=0.0), r"threshold must be in \(0, 1\]"),
        (dict(threshold=1.5), r"threshold must be in \(0, 1\]"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=0), "top_k"),
        (dict(temperature=-1.0), "temperature"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(max_new_tokens=-1), "max_new_tokens"),
        (dict(stop_sequences=((),)), "stop_sequences"),
    ],
)
def test_bad_config(changes, match):
    with pytest.raises(ValueError, match=match):
        DecodingConfig(**changes)


def test_bad_requests(debug_model):
    sampler = SetSampler(debug_model, mask_token_id=MASK, context_len=16)
    cfg = DecodingConfig(window=4, max_new_tokens=4)
    for prompts, kwargs, match in [
        ([], {}, "at least one prompt"),
        ([[1, 2], list(range(12))], {}, r"prompts\[1\] is longer than the context"),
        ([[1, 2]], dict(batch_size=0), "batch_size must be >= 1"),
        ([[1, -2]], {}, r"prompts\[0\] must hold token ids >= 0"),
    ]:
        with pytest.raises(ValueError, match=match):
            sampler.generate(prompts, cfg, **kwargs)
    with pytest.raises(ValueError, match="nothing to decode"):
        sampler.generate([[1, 2]], DecodingConfig(max_new_tokens=0))
    with pytest.raises(ValueError, match="MASK"):
        sampler.generate([[1, 2]], DecodingConfig(eos_token_ids=(MASK,)))
    with pytest.raises(ValueError, match="context_len must be >= 2"):
        SetSampler(debug_model, mask_token_id=MASK, context_len=1)


@pytest.fixture(scope="module")
def copying_model():
    """A debug model trained for 120 steps on rows that repeat one token: having learned to copy,
    it is confident about every masked position at once."""
    torch.manual_seed(0)
    model = SetDiffusionTransformer(debug_config(max_seq_len=32))
    gen = torch.Generator().manual_seed(0)
    corpus = torch.randint(0, 60, (4096, 1), generator=gen).expand(-1, 16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    for _ in range(120):
        batch = corpus[torch.randint(0, len(corpus), (32,), generator=gen)]
        loss = model.loss(batch, Staggered(d=4), generator=gen).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, corpus[:16]


@pytest.mark.parametrize(
    "cfg, min_tokens_per_step",
    [
        (DecodingConfig(window=8, threshold=0.9, max_new_tokens=13), 4.0),  # saw 6.5 (13 tokens in 2 steps)
        (DecodingConfig(window=8, tokens_per_step=3, max_new_tokens=13), 2.5),  # saw 2.6 (3, 3, 3, 3, 1)
    ],
    ids=["threshold", "set-size"],
)
def test_parallel_policies_decode_sets_on_a_trained_model(copying_model, cfg, min_tokens_per_step):
    model, rows = copying_model
    out = SetSampler(model, mask_token_id=MASK, context_len=32).generate(rows[:, :3].tolist(), cfg)
    correct = sum(a == b for r, want in zip(out.rows, rows.tolist()) for a, b in zip(r.completion, want[3:]))
    print(f"{out.metrics.tokens_per_step:.2f} tokens/step, {correct}/{13 * len(rows)} tokens right")
    assert out.metrics.tokens_per_step >= min_tokens_per_step
    assert correct >= 0.95 * 13 * len(rows)


def eager_static(monkeypatch) -> None:
    """Static steps run their bucketed shapes eagerly: what a compiled step computes, without the
    compile (tests/sampling/test_static_steps.py compiles for real)."""
    monkeypatch.setattr(StepCompiler, "_compile", lambda self: self._model.step)


@pytest.mark.parametrize("compile", ["off", "on"])
def test_requests_joining_a_running_batch_decode_as_alone(debug_model, monkeypatch, compile):
    """32 requests arriving at random steps, with mixed lengths, spans, windows, thresholds,
    stops, a sampled one and chunked prefill: each decodes exactly as it does alone, joining
    rows' prefills packed with the others' decode steps; with compile on, decode steps run
    bucketed (static shapes: padding rows and slots)."""
    eager_static(monkeypatch)
    gen = torch.Generator().manual_seed(11)
    lengths = torch.randint(0, 24, (32,), generator=gen).tolist()
    prompts = random_prompts(gen, lengths, ((2, 3),))
    cfgs = [
        DecodingConfig(
            window=1 + i % 6,
            threshold=(0.025 if i % 3 else None),
            tokens_per_step=1 + i % 2,
            max_new_tokens=4 + i % 9,
            eos_token_ids=(62,) if i % 4 == 0 else (),
            fill_window=i % 5 == 0,
            temperature=0.9 if i == 7 else 0.0,
            seed=i,
        )
        for i in range(32)
    ]

    def make(**kw):
        return SetSampler(debug_model, mask_token_id=MASK, context_len=64, prefill_chunk=5, **kw)

    alone = []
    for i, (prompt, cfg) in enumerate(zip(prompts, cfgs)):
        engine = make(max_rows=1)
        engine.submit(Request(key=i, prompt=tuple(prompt), cfg=cfg, seed=cfg.seed))
        (result,) = [row for _ in range(1000) if not engine.idle for _, row in engine.step()]
        alone.append(result)
    engine = make(max_rows=6, kv_budget=6 * 48, compile=compile)
    arrivals = torch.randint(0, 40, (32,), generator=gen).tolist()
    together, step = {}, 0
    while len(together) < 32:
        for i in [i for i, a in enumerate(arrivals) if a == step]:
            engine.submit(Request(key=i, prompt=tuple(prompts[i]), cfg=cfgs[i], seed=cfgs[i].seed))
        together |= dict(engine.step())
        step += 1
        assert len(engine.rows) <= 6 and (engine.cache is None or len(engine.rows) * engine.cache.capacity <= 6 * 48)
        if compile == "on" and engine.cache is not None:
            assert engine.cache.rows == bucket(len(engine.rows))
    for i, row in enumerate(alone):
        assert together[i].tokens == row.tokens and together[i].finish_reason == row.finish_reason, i
        assert together[i].steps == row.steps and together[i].nfe == row.nfe
    assert {r.finish_reason for r in alone} == {"stop", "length"}
    assert compile == "off" or len(engine.compiler.compiled) > 1


def test_cancel_frees_the_row_and_a_request_over_the_budget_waits(debug_model):
    engine = SetSampler(debug_model, mask_token_id=MASK, context_len=64, max_rows=2)
    cfg = DecodingConfig(window=2, max_new_tokens=30)
    for key in "abc":
        engine.submit(Request(key=key, prompt=(1, 2, 3), cfg=cfg))
    engine.step()
    assert [r.request.key for r in engine.rows] == ["a", "b"] and [r.key for r in engine.waiting] == ["c"]
    engine.cancel("a")
    finished = engine.step()
    assert [(k, r.finish_reason) for k, r in finished] == [("a", "cancelled")]
    assert [r.request.key for r in engine.rows] == ["b", "c"]  # the waiting one took the freed row
    with pytest.raises(ValueError, match="needs more KV cache than the whole budget"):
        SetSampler(debug_model, mask_token_id=MASK, context_len=64, kv_budget=20).submit(
            Request(key="big", prompt=(1,) * 10, cfg=cfg)
        )
