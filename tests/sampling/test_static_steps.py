"""Static-shape decoding: packed and bucketed step layouts, compiled steps against eager ones."""

import json
import time

import pytest
import torch

from setdiff_megatron.core.step_attention import step_mask
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.kv_cache import KVCache
from setdiff_megatron.sampling.sample_request import Request
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.sampling.step_compiler import COMPILE_COST_S, JUDGE_AFTER, StepCompiler
from setdiff_megatron.sampling.step_layout import StepLayout, bucket, pack
from tests.sampling.test_sampler import MASK, eager_static, random_prompts


def test_buckets_are_powers_of_two_above_a_floor():
    assert [bucket(n) for n in (0, 1, 2, 3, 5, 8, 9)] == [1, 1, 2, 4, 8, 8, 16]
    assert bucket(5, 64) == 64 and bucket(65, 64) == 128


def test_a_packed_step_holds_the_real_slots_and_maps_back_to_its_padded_view():
    gen = torch.Generator().manual_seed(0)
    commits, queries = torch.tensor([4, 1, 0]), torch.tensor([3, 0, 2])
    commit_valid = torch.arange(4) < commits[:, None]
    query_valid = torch.arange(3) < queries[:, None]
    commit_tok, commit_pos = torch.randint(0, 50, (3, 4), generator=gen), torch.randint(0, 50, (3, 4), generator=gen)
    query_tok, query_pos = torch.full((3, 3), MASK), torch.randint(0, 50, (3, 3), generator=gen)
    tokens, positions, layout = pack(commit_tok, commit_pos, commit_valid, query_tok, query_pos, query_valid, 5, 5)
    assert tokens[0].tolist() == commit_tok[commit_valid].tolist() + [MASK] * 5
    assert positions[0].tolist() == commit_pos[commit_valid].tolist() + query_pos[query_valid].tolist()
    assert layout.model_commits == 5 and layout.packed_queries == 5 and layout.commit_count.tolist() == [4, 1, 0]

    padded = torch.randn(3, 2, 7, 8, generator=gen)  # [B, H, K + Q, D]
    real = torch.cat([commit_valid, query_valid], 1)
    back = layout.to_padded(layout.to_model(padded))
    assert torch.equal(back[real[:, None].expand_as(back[..., 0])], padded[real[:, None].expand_as(padded[..., 0])])
    logits = torch.randn(1, 5, 11, generator=gen)  # the model's query rows
    by_row = layout.queries(logits)
    assert torch.equal(by_row[query_valid], logits[0])


def test_a_packed_step_whose_commit_slots_are_all_real_leaves_the_cache_unragged(debug_model):
    """A batch-1 prompt is prefilled packed (its query slots are empty); with no commit slot empty
    the commits are staged in place, so later steps need no per-row key mask."""
    sampler = SetSampler(debug_model, mask_token_id=MASK, context_len=64)
    prompt = [5, 6, 7, 8, 9]
    commit_valid, query_valid = torch.ones(1, 5, dtype=torch.bool), torch.zeros(1, 2, dtype=torch.bool)
    tok = torch.tensor([prompt])
    *_, layout = pack(tok, tok, commit_valid, tok[:, :2], tok[:, :2], query_valid, 5, 0)
    assert layout.commit_count is None
    sampler.submit(Request(key=0, prompt=tuple(prompt), cfg=DecodingConfig(window=2, max_new_tokens=6)))
    ragged, finished = [], []
    while not sampler.idle:
        finished += sampler.step()
        ragged.append(sampler.cache is not None and sampler.cache.ragged)
    assert len(ragged) > 3 and not any(ragged) and finished[0][1].num_decoded == 6


def test_an_eager_step_mask_is_the_general_rule():
    """The cached block of an unkeyed eager step gives the mask the per-row construction gives
    with every entry real."""
    for num_commit, num_query, cached in [(0, 4, 7), (1, 3, 0), (2, 2, 5), (3, 0, 1)]:
        fast = step_mask(num_commit, num_query, cached)
        rows = torch.ones(2, cached + num_commit, dtype=torch.bool)
        assert torch.equal(fast.expand(2, -1, -1, -1), step_mask(num_commit, num_query, cached, rows))


def test_padding_rows_and_slots_of_a_static_step_write_no_entry():
    """Rows 0-1 live, rows 2-3 padding; row 1 commits 1 of 4 slots: after the step, each live
    row holds exactly its old entries and its real commits, and padding rows stay empty."""
    gen = torch.Generator().manual_seed(1)
    cache = KVCache.allocate(num_layers=1, batch_size=4, num_kv_heads=1, head_dim=4, capacity=16)
    cache.keys[:, :, :, :16] = torch.randn(1, 4, 1, 16, 4, generator=gen)
    before = cache.keys.clone()
    cache.lengths[:] = torch.tensor([3, 5, 0, 0])
    cache.length = 5
    commit_valid = torch.tensor([[1, 1, 1, 1], [1, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0]]).bool()
    cache.plan(StepLayout.padded(4, 4, 2, commit_valid, span=8))
    q = torch.randn(4, 2, 6, 4, generator=gen)
    k, v = torch.randn(4, 1, 6, 4, generator=gen), torch.randn(4, 1, 6, 4, generator=gen)
    cache.attend(0, q, k, v, num_commit=4)
    cache.advance()
    assert cache.lengths.tolist() == [7, 6, 0, 0] and cache.length == 9
    torch.testing.assert_close(cache.keys[0, 0, :, 3:7], k[0, :, :4])
    torch.testing.assert_close(cache.keys[0, 1, :, 5:6], k[1, :, :1])
    for row, old in ((0, 3), (1, 5)):
        assert torch.equal(cache.keys[0, row, :, :old], before[0, row, :, :old])
        assert torch.equal(cache.keys[0, row, :, 8:16], before[0, row, :, 8:16])
    assert torch.equal(cache.keys[0, 2:, :, :16], before[0, 2:, :, :16])


def batch_invariance_case():
    gen = torch.Generator().manual_seed(7)
    lengths = torch.randint(1, 20, (16,), generator=gen).tolist()
    prompts = random_prompts(gen, lengths, ((3, 4),))
    cfg = DecodingConfig(window=6, threshold=0.025, max_new_tokens=12, eos_token_ids=(62,), stop_sequences=((7, 7),))
    return prompts, cfg


def test_bucketed_static_steps_decode_as_the_eager_sampler_at_any_batch(debug_model, monkeypatch):
    eager_static(monkeypatch)
    prompts, cfg = batch_invariance_case()
    eager = SetSampler(debug_model, mask_token_id=MASK, context_len=128).generate(prompts, cfg).rows
    static = SetSampler(debug_model, mask_token_id=MASK, context_len=128, compile="on")
    for batch in (None, 5):
        out = static.generate(prompts, cfg, batch_size=batch)
        for one, many in zip(eager, out.rows):
            assert one.tokens == many.tokens and one.nfe == many.nfe and one.finish_reason == many.finish_reason
    keys = static.compiler.compiled
    assert {rows for rows, *_ in keys} >= {2, 8, 16}, "rows are bucketed: 5 live rows run as 8, and fewer"
    assert {q for _, _, q, _, _ in keys} == {8}, "query slots: the widest window, 6, as 8"
    assert all(span == min(64, capacity) for *_, span, capacity in keys), "spans from 64, within the capacity"


def test_a_static_step_after_the_widest_row_is_cancelled_decodes_the_others_as_alone(debug_model, monkeypatch):
    """Cancelling the row of the widest window leaves query slots wider than the policy's widest
    window until the next step trims them: the bucket must cover them."""
    eager_static(monkeypatch)
    narrow, wide = DecodingConfig(window=2, max_new_tokens=12), DecodingConfig(window=8, max_new_tokens=12)
    alone = SetSampler(debug_model, mask_token_id=MASK, context_len=64).generate([[5, 9, 3]], narrow).rows[0]
    engine = SetSampler(debug_model, mask_token_id=MASK, context_len=64, compile="on")
    engine.submit(Request(key="narrow", prompt=(5, 9, 3), cfg=narrow))
    engine.submit(Request(key="wide", prompt=(7, 1), cfg=wide))
    done = dict(engine.step()) | dict(engine.step())
    engine.cancel("wide")
    while not engine.idle:
        done |= dict(engine.step())
    assert done["wide"].finish_reason == "cancelled" and done["narrow"].tokens == alone.tokens


def test_auto_compiles_a_bucket_once_its_eager_steps_have_paid_for_it(debug_model, tmp_path, monkeypatch):
    # A machine with no compile recorded (the session's others, made eager by eager_static, cost
    # about nothing and round to 0.0): the assumed cost.
    monkeypatch.setenv("SETDIFF_CACHE_DIR", str(tmp_path))
    compiler = StepCompiler(debug_model, "auto", torch.device("cpu"))
    key = (1, 1, 4, 64, 64)
    assert not compiler.wants(key) and compiler.expected_cost() == COMPILE_COST_S["cpu"]
    compiler.note_eager(key, compiler.expected_cost() - 0.5)
    assert not compiler.wants(key)
    compiler.note_eager(key, 0.5)
    assert compiler.wants(key) and not StepCompiler(debug_model, "off", torch.device("cpu")).wants(key)
    compiler.compiled.add(key)  # compiled steps no faster than the eager ones: back to eager
    for _ in range(JUDGE_AFTER):
        assert compiler.wants(key)
        compiler.note_compiled(key, compiler.eager_s[key] / compiler.eager_n[key])
    assert not compiler.wants(key) and compiler.summary()["slower_than_eager"] == 1
    with pytest.raises(ValueError, match="compile must be one of off, auto, on"):
        StepCompiler(debug_model, "always", torch.device("cpu"))


def test_auto_expects_the_compile_cost_measured_on_this_machine(debug_model, monkeypatch, tmp_path):
    """A compile's seconds are recorded on the machine; a later process's `auto` expects their
    median before it has compiled anything itself. An unreadable record is the assumed cost."""
    monkeypatch.setenv("SETDIFF_CACHE_DIR", str(tmp_path))
    cpu = torch.device("cpu")
    assert StepCompiler(debug_model, "auto", cpu).expected_cost() == COMPILE_COST_S["cpu"]
    for pause in (0.02, 0.3, 0.1):  # three processes, each compiling one bucket

        def compiled(self, pause=pause):
            return lambda *args: time.sleep(pause) or torch.zeros(1)

        monkeypatch.setattr(StepCompiler, "_compile", compiled)
        StepCompiler(debug_model, "on", cpu).step((1, 1, 4, 64, 64))
    recorded = json.loads((tmp_path / "compile_seconds.json").read_text())["cpu"]
    assert len(recorded) == 3 and StepCompiler(debug_model, "auto", cpu).expected_cost() == sorted(recorded)[1]
    (tmp_path / "compile_seconds.json").write_text('{"cpu": ["fast"]}')
    assert StepCompiler(debug_model, "auto", cpu).expected_cost() == COMPILE_COST_S["cpu"]


def test_a_model_that_does_not_compile_decodes_eagerly(debug_model, monkeypatch):
    def broken(self):
        def step(*args):
            raise RuntimeError("cannot trace this\nsecond line")

        return step

    monkeypatch.setattr(StepCompiler, "_compile", broken)
    prompts, cfg = batch_invariance_case()
    eager = SetSampler(debug_model, mask_token_id=MASK, context_len=128).generate(prompts[:4], cfg).rows
    engine = SetSampler(debug_model, mask_token_id=MASK, context_len=128, compile="on")
    assert [r.tokens for r in engine.generate(prompts[:4], cfg).rows] == [r.tokens for r in eager]
    assert engine.compiler.failed == "RuntimeError: cannot trace this" and not engine.compiler.enabled


@pytest.mark.slow
def test_compiled_steps_decode_as_eager_ones(debug_model):
    """torch.compile at static shapes (one row, spans of 64): the same tokens as eager decoding."""
    model = debug_model.float()
    prompts = [[5, 9, 3, 11], [8, 2]]
    cfg = DecodingConfig(window=4, max_new_tokens=10)
    eager = SetSampler(model, mask_token_id=MASK, context_len=64).generate(prompts, cfg, batch_size=1)
    engine = SetSampler(model, mask_token_id=MASK, context_len=64, compile="on")
    compiled = engine.generate(prompts, cfg, batch_size=1)
    assert [r.tokens for r in compiled.rows] == [r.tokens for r in eager.rows]
    assert engine.compiler.failed is None and len(engine.compiler.compiled) >= 1
