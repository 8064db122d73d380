"""Weight maps torch <-> megatron: round trips over TP/PP/VP splits, megatron's fused layouts,
vocabulary padding, tied embeddings, and refusal of incomplete or mis-shaped weights."""

import itertools

import pytest
import torch

from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.models.weight_maps.megatron_map import megatron_to_torch, torch_to_megatron
from setdiff_megatron.models.weight_maps.parallel import padded_vocab_size, stage_layers
from tests.conftest import debug_config, dit_config, randomized
from tests.models.megatron_shards import merge_megatron_shards


def _weights(**changes):
    cfg = debug_config(num_layers=4, **changes)
    torch.manual_seed(0)
    return cfg, SetDiffusionTransformer(cfg).state_dict()


def _split(sd, cfg, tp, pp, vp=None, backend="local"):
    return {
        (t, p) + ((v,) if vp else ()): torch_to_megatron(
            sd,
            cfg,
            tp_rank=t,
            tp_size=tp,
            pp_rank=p,
            pp_size=pp,
            vp_size=vp,
            vp_stage=v if vp else None,
            backend=backend,
        )
        for t in range(tp)
        for p in range(pp)
        for v in range(vp or 1)
    }


@pytest.mark.parametrize("tie,qk_norm,backend", list(itertools.product([True, False], [True, False], ["local", "te"])))
@pytest.mark.parametrize("tp,pp,vp", [(1, 1, None), (2, 1, None), (2, 2, None), (1, 2, 2), (2, 2, 2)])
def test_round_trip_is_exact(tie, qk_norm, backend, tp, pp, vp):
    cfg, sd = _weights(tie_embeddings=tie, qk_norm=qk_norm)
    back = megatron_to_torch(merge_megatron_shards(_split(sd, cfg, tp, pp, vp, backend), cfg), cfg, backend=backend)
    assert back.keys() == sd.keys()
    assert all(torch.equal(back[k], sd[k]) for k in sd)


@pytest.mark.parametrize("adaln", [False, True])
@pytest.mark.parametrize("tp,pp,vp", [(1, 1, None), (2, 1, None), (2, 2, None), (2, 2, 2)])
def test_dit_round_trip_covers_every_bias_and_norm(tp, pp, vp, adaln):
    cfg = dit_config(num_layers=4, adaln=adaln, adaln_cond_dim=8)
    torch.manual_seed(0)
    sd = randomized(SetDiffusionTransformer(cfg).state_dict())
    back = megatron_to_torch(merge_megatron_shards(_split(sd, cfg, tp, pp, vp), cfg), cfg)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    if adaln:  # every pipeline chunk holds the time embedding; the final norm's modulation is the last's
        chunks = [torch_to_megatron(sd, cfg, tp_rank=1, tp_size=2, pp_rank=r, pp_size=2) for r in (0, 1)]
        assert all(torch.equal(c["time_embedding.linear_2.bias"], sd["time_embedding.linear_2.bias"]) for c in chunks)
        assert torch.equal(chunks[1]["decoder.final_layernorm.modulation.weight"], sd["norm_modulation.weight"])
        assert torch.equal(
            chunks[1]["decoder.layers.1.adaln_modulation.weight"], sd["layers.3.adaln_modulation.weight"]
        )
        assert "decoder.final_layernorm.modulation.weight" not in chunks[0]
    # A GELU MLP's fc1 is up alone, split over TP with its bias; fc2's bias is whole on every
    # rank; the output bias is padded and split like the output layer's rows.
    last = torch_to_megatron(sd, cfg, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    half = slice(cfg.intermediate_size // 2, None)
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc1.weight"], sd["layers.2.mlp.up_proj.weight"][half])
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc1.bias"], sd["layers.2.mlp.up_proj.bias"][half])
    assert torch.equal(last["decoder.layers.0.mlp.linear_fc2.bias"], sd["layers.2.mlp.down_proj.bias"])
    assert last["output_layer.bias"].shape == (64,) and torch.count_nonzero(last["output_layer.bias"]) == 0
    assert torch.equal(torch_to_megatron(sd, cfg)["output_layer.bias"][:64], sd["lm_head.bias"])
    with pytest.raises(ValueError, match="te' backend"):
        torch_to_megatron(sd, cfg, backend="te")
    with pytest.raises(KeyError, match="lm_head.bias"):
        torch_to_megatron({k: t for k, t in sd.items() if k != "lm_head.bias"}, cfg)


MOE = dict(num_experts=4, moe_top_k=2, moe_intermediate_size=32, num_shared_experts=1, moe_layer_freq=[1, 0, 1, 1])


@pytest.mark.parametrize("backend", ["local", "te"])
@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 1), (2, 1, 2), (2, 2, 2), (1, 2, 4), (2, 2, 1)])
def test_moe_round_trip_covers_every_key_and_expert(backend, tp, pp, ep):
    cfg, sd = _weights(**MOE)
    shards = {
        (t, p) + ((e,) if ep > 1 else ()): torch_to_megatron(
            sd, cfg, tp_rank=t, tp_size=tp, pp_rank=p, pp_size=pp, ep_rank=e, ep_size=ep, backend=backend
        )
        for t in range(tp)
        for p in range(pp)
        for e in range(ep)
    }
    back = megatron_to_torch(merge_megatron_shards(shards, cfg, ep_size=ep), cfg, backend=backend)
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)
    # Expert e sits on EP rank e // (4 / ep) as local expert e % (4 / ep); the shared experts on every one.
    local = "mlp.experts.linear_fc1.weight{}" if backend == "te" else "mlp.experts.local_experts.{}.linear_fc1.weight"
    last = shards[(0, 0) + ((ep - 1,) if ep > 1 else ())]
    gate = sd["layers.0.mlp.experts.3.gate_proj.weight"].chunk(tp)[0]
    assert torch.equal(last["decoder.layers.0." + local.format(4 // ep - 1)][: gate.shape[0]], gate)
    assert (
        "decoder.layers.0.mlp.shared_experts.linear_fc1.weight" in last
        and "decoder.layers.1.mlp.router.weight" not in last
    )


def test_moe_shards_missing_an_expert_parallel_rank_are_refused():
    cfg, sd = _weights(**MOE)
    shards = {(0, 0, 0): torch_to_megatron(sd, cfg, ep_rank=0, ep_size=2)}
    with pytest.raises(KeyError, match="ep_rank"):
        merge_megatron_shards(shards, cfg, ep_size=2)


def test_fused_qkv_and_fc1_follow_megatron_layout():
    cfg, sd = _weights()  # 4 heads, 2 KV groups, head dim 16
    d, i = cfg.head_dim, cfg.intermediate_size
    q, k, v = (sd[f"layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    for tp_rank in range(2):
        shard = torch_to_megatron(sd, cfg, tp_rank=tp_rank, tp_size=2)
        # TP rank r holds KV group r: its two query heads, then its key, then its value.
        expected = torch.cat(
            [
                q[2 * d * tp_rank : 2 * d * (tp_rank + 1)],
                k[d * tp_rank : d * (tp_rank + 1)],
                v[d * tp_rank : d * (tp_rank + 1)],
            ]
        )
        assert torch.equal(shard["decoder.layers.0.self_attention.linear_qkv.weight"], expected)
        half = slice(i // 2 * tp_rank, i // 2 * (tp_rank + 1))
        gate_up = torch.cat([sd["layers.0.mlp.gate_proj.weight"][half], sd["layers.0.mlp.up_proj.weight"][half]])
        assert torch.equal(shard["decoder.layers.0.mlp.linear_fc1.weight"], gate_up)


def test_vocab_is_padded_with_zero_rows_and_tied_output_lives_on_the_last_stage():
    cfg, sd = _weights()
    assert padded_vocab_size(64, 1) == padded_vocab_size(64, 2) == 128
    assert padded_vocab_size(50258, 8) == 50304 and padded_vocab_size(129, 3) == 384
    first, last = (torch_to_megatron(sd, cfg, tp_rank=1, tp_size=2, pp_rank=p, pp_size=2) for p in range(2))
    assert torch.count_nonzero(first["embedding.word_embeddings.weight"]) == 0  # rank 1: rows 64..127
    assert torch.equal(last["output_layer.weight"], first["embedding.word_embeddings.weight"])
    assert "output_layer.weight" not in torch_to_megatron(sd, cfg)  # pp == 1 shares the embedding itself


def test_stage_layers_follow_megatrons_even_and_interleaved_split():
    assert [list(stage_layers(4, 2, r)) for r in range(2)] == [[0, 1], [2, 3]]
    assert [list(stage_layers(8, 2, r, 2, v)) for v in range(2) for r in range(2)] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    with pytest.raises(ValueError, match="divide evenly"):
        stage_layers(4, 3, 0)


def test_incomplete_or_misshaped_weights_are_refused():
    cfg, sd = _weights()
    with pytest.raises(KeyError, match="missing"):
        torch_to_megatron({k: t for k, t in sd.items() if k != "norm.weight"}, cfg)
    with pytest.raises(ValueError, match="wrong shapes"):
        torch_to_megatron({**sd, "norm.weight": torch.ones(3)}, cfg)
    with pytest.raises(ValueError, match="divisible"):
        torch_to_megatron(sd, cfg, tp_size=4)  # 2 KV heads over 4 ranks
    shards = _split(sd, cfg, 2, 2)
    with pytest.raises(KeyError, match="missing"):
        merge_megatron_shards({k: s for k, s in shards.items() if k != (1, 1)}, cfg)
    shards[(0, 0)]["decoder.layers.0.self_attention.linear_qkv._extra_state"] = torch.zeros(0)  # TE: ignored
    shards[(0, 0)]["decoder.layers.0.unknown.weight"] = torch.zeros(1)
    with pytest.raises(KeyError, match="not mapped"):
        megatron_to_torch(merge_megatron_shards(shards, cfg), cfg)
    shards = _split(sd, cfg, 1, 2)
    shards[(0, 1)]["output_layer.weight"] = shards[(0, 1)]["output_layer.weight"] + 1
    with pytest.raises(ValueError, match="tied embedding"):
        merge_megatron_shards(shards, cfg)
