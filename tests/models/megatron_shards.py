"""Megatron chunk state dicts of a TP/PP(/VP)/EP split merged into one whole model's, the form
`weight_maps.megatron_map.megatron_to_torch` reads: the tests' way back from `torch_to_megatron`'s
shards and from every rank of a parallel run (production only ever reads TP = PP = EP = 1
checkpoints)."""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch

from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.parallel import check_ep_split, check_tp_split, stage_layers

_LAYER = re.compile(r"decoder\.layers\.(\d+)\.(.*)")
_LOCAL_EXPERT = re.compile(r"(mlp\.experts\.(?:local_experts\.|linear_fc[12]\.weight))(\d+)")
_FC1 = re.compile(r"\.linear_fc1\.(weight\d*|bias)$")
"""Each TP rank holds [gate ; up] of its own shard of the MLP width (a gelu MLP: its shard of up)."""
_TP_DIM = [
    (re.compile(r"\.(linear_proj|linear_fc2)\.weight\d*$"), 1),
    (
        re.compile(
            r"(\.linear_qkv\.(weight|bias)|^embedding\.word_embeddings\.weight"
            r"|^output_layer\.(weight|bias))$"
        ),
        0,
    ),
]
"""Weights split over TP along a dim (whole KV groups for linear_qkv); the others are replicated."""


def merge_megatron_shards(
    shards: Mapping[tuple[int, ...], Mapping[str, torch.Tensor]], cfg: ModelConfig, *, ep_size: int = 1
) -> dict[str, torch.Tensor]:
    """One TP = PP = EP = 1 megatron state dict from every chunk of a split.

    `shards` is keyed by (tp_rank, pp_rank) or, with virtual pipeline stages, by
    (tp_rank, pp_rank, vp_stage); with ep_size > 1 every key ends with the expert-parallel rank.
    Every combination must be present. What the EP ranks replicate is read from EP rank 0; with
    more than one pipeline chunk, a tied model's copy of the embedding on the last chunk must equal
    the embedding and is dropped.
    """
    check_ep_split(cfg, ep_size)
    keys = sorted(shards)
    with_ep = ep_size > 1
    model_keys = sorted({k[:-1] for k in keys}) if with_ep else keys
    tp_size, pp_size = model_keys[-1][0] + 1, max(k[1] for k in model_keys) + 1
    vp_size = max(k[2] for k in model_keys) + 1 if len(model_keys[0]) == 3 else None
    grid = {
        (t, p) + ((v,) if vp_size else ()) + ((e,) if with_ep else ())
        for t in range(tp_size)
        for p in range(pp_size)
        for v in range(vp_size or 1)
        for e in range(ep_size)
    }
    if set(keys) != grid:
        raise KeyError(
            f"shards must cover every (tp_rank, pp_rank[, vp_stage][, ep_rank]); missing {sorted(grid - set(keys))}"
        )
    check_tp_split(cfg, tp_size)
    per_rank = cfg.num_experts // ep_size
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for key in keys:  # EP rank 0 first within each (tp_rank, chunk)
        chunk, ep_rank = key[1 : len(key) - with_ep], key[-1] if with_ep else 0
        layers = stage_layers(cfg.num_layers, pp_size, chunk[0], vp_size, chunk[1] if vp_size else None)
        for name, t in shards[key].items():
            if not name.endswith("_extra_state"):
                parts.setdefault(_whole_model_name(name, layers, ep_rank * per_rank), {}).setdefault(key[0], t)
    merged = {name: _merge_tp(name, by_rank, tp_size, gated=cfg.mlp == "swiglu") for name, by_rank in parts.items()}
    if cfg.tie_embeddings and pp_size * (vp_size or 1) > 1:
        copy = merged.pop("output_layer.weight")[: cfg.vocab_size]
        if not torch.equal(copy, merged["embedding.word_embeddings.weight"][: cfg.vocab_size]):
            raise ValueError("the last stage's copy of the tied embedding differs from the embedding")
    return merged


def _whole_model_name(name: str, layers: range, first_expert: int) -> str:
    """A chunk's name in the whole model: its layer's global index and, for an expert, its own."""
    match = _LAYER.fullmatch(name)
    if match is None:
        return name
    rest = _LOCAL_EXPERT.sub(lambda m: m[1] + str(first_expert + int(m[2])), match[2], count=1)
    return f"decoder.layers.{layers[int(match[1])]}.{rest}"


def _merge_tp(name: str, by_rank: Mapping[int, torch.Tensor], tp_size: int, *, gated: bool) -> torch.Tensor:
    """The whole weight from its shards on every TP rank; one that is not split, as the lowest TP
    rank holding it has it (what no rank should hold is left for megatron_to_torch to refuse)."""
    fc1 = _FC1.search(name) is not None
    dim = 0 if fc1 and not gated else next((d for pattern, d in _TP_DIM if pattern.search(name)), None)
    gate_up = fc1 and gated
    if dim is None and not gate_up:
        return by_rank[min(by_rank)]
    if len(by_rank) != tp_size:
        raise KeyError(f"megatron shards of TP ranks {sorted(set(range(tp_size)) - set(by_rank))} have no {name!r}")
    parts = [by_rank[t] for t in range(tp_size)]
    if gate_up:
        halves = [p.chunk(2) for p in parts]
        return torch.cat([torch.cat([h[j] for h in halves]) for j in range(2)])
    return torch.cat(parts, dim=dim)
