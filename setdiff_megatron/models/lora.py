"""LoRA: low-rank adapters on a frozen model's linear layers, the same under both bodies.

An adapted linear computes W0 x + (alpha / rank) B A x with B zero at the start, so a fresh adapter
leaves the model's outputs unchanged; only adapters are trained. One adapter (one A) serves each
target, the projections that share one input (`torch_linears`). B's rows are the torch body's
under either body, so an adapter's tensors, `layers.{i}.lora_<target>.{A,B}` (megatron prefixes
`decoder.`), are the same whichever engine trained them. Each adapter is a child module of its
layer, added to the projections' outputs by forward hooks, so neither body's code changes.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.weight_maps.torch_layout import QKV, TORCH_LAYER, StateDict, mlp_inputs

__all__ = [
    "TARGETS",
    "LoraSpec",
    "Adapter",
    "Rows",
    "add_adapters",
    "adapter_state",
    "is_adapter_key",
    "load_weights",
    "merge_adapters",
    "torch_linears",
    "adapt_torch_model",
]

TARGETS = ("qkv", "attention_output", "mlp_input", "mlp_output")
_PREFIX = "lora_"

Rows = slice | torch.Tensor
"""The rows of an adapter's B that one linear's output takes (a range, or megatron's QKV order)."""


@dataclass(frozen=True)
class LoraSpec:
    """What recipe `model.lora` asks for."""

    rank: int
    alpha: float
    targets: tuple[str, ...]

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Adapter(nn.Module):
    """One target's A [rank, in] and B [out, rank], with the scale alpha / rank."""

    def __init__(self, out_features: int, spec: LoraSpec, a: torch.Tensor, like: torch.Tensor):
        super().__init__()
        self.A = nn.Parameter(a.to(device=like.device, dtype=like.dtype))
        self.B = nn.Parameter(torch.zeros(out_features, spec.rank, device=like.device, dtype=like.dtype))
        self.scale = spec.scale

    def delta(self, x: torch.Tensor, rows: Rows) -> torch.Tensor:
        """The adapter's term of output rows `rows`, (scale B[rows] A) x, without forming B A."""
        return F.linear(F.linear(x, self.A), self.B[rows]) * self.scale


def _add_delta(adapter: Adapter, rows: Rows, module: nn.Module, args: tuple, output):
    """Forward hook: a linear's output plus its adapter's term (megatron's: (output, bias))."""
    delta = adapter.delta(args[0], rows)
    if isinstance(output, tuple):
        return (output[0] + delta, *output[1:])
    return output + delta


def add_adapters(
    model: nn.Module,
    layers: Iterable[tuple[int, nn.Module]],
    sites: Callable[[nn.Module, str], list[tuple[nn.Module, Rows]]],
    spec: LoraSpec,
    seed: int,
) -> None:
    """Freeze `model` and give each of its (global index, layer) an adapter per target of `spec`
    on the linears `sites(layer, target)` names (each with its rows of B). A is drawn like a
    linear layer's weight (Kaiming-uniform) from `seed`, layer by layer in TARGETS order, so both
    bodies draw the same adapters (every layer must be given: one pipeline stage would draw
    another stage's adapters)."""
    model.requires_grad_(False)
    generator = torch.Generator().manual_seed(seed)
    for _, layer in sorted(layers, key=lambda pair: pair[0]):
        for target in (t for t in TARGETS if t in spec.targets):
            linears = sites(layer, target)
            weight = linears[0][0].weight
            a = torch.empty(spec.rank, weight.shape[1])
            nn.init.kaiming_uniform_(a, a=math.sqrt(5), generator=generator)
            rows = sum(linear.weight.shape[0] for linear, _ in linears)
            adapter = Adapter(rows, spec, a, weight)
            layer.add_module(_PREFIX + target, adapter)
            for linear, part in linears:
                linear.register_forward_hook(partial(_add_delta, adapter, part))


def torch_linears(cfg: ModelConfig, target: str) -> tuple[str, ...]:
    """The torch body's linears (layer-local names) under `target`, in B's row order: q, k, v
    (megatron's fused linear_qkv, whose adapter reads B through weight_maps/megatron_map.py `qkv_rows`),
    o_proj (linear_proj), gate and up or up alone for a GELU MLP (linear_fc1), down_proj
    (linear_fc2)."""
    return {
        "qkv": tuple(n.removesuffix(".weight") for n in QKV),
        "attention_output": ("self_attn.o_proj",),
        "mlp_input": tuple(f"mlp.{n}" for n in mlp_inputs(cfg, moe=False)),
        "mlp_output": ("mlp.down_proj",),
    }[target]


def _torch_sites(cfg: ModelConfig, layer: nn.Module, target: str) -> list[tuple[nn.Module, Rows]]:
    out, start = [], 0
    for name in torch_linears(cfg, target):
        linear = layer.get_submodule(name)
        out.append((linear, slice(start, start + linear.weight.shape[0])))
        start += linear.weight.shape[0]
    return out


def adapt_torch_model(model: nn.Module, spec: LoraSpec, seed: int) -> None:
    """Adapters on the torch body (models/torch_model.py), dense layers only."""
    cfg = model.config
    add_adapters(model, enumerate(model.layers), partial(_torch_sites, cfg), spec, seed)


def is_adapter_key(name: str) -> bool:
    return f".{_PREFIX}" in name and name.rsplit(".", 1)[-1] in ("A", "B")


def load_weights(
    module: nn.Module, state_dict: Mapping[str, torch.Tensor], what: str, *, adapters: bool = False
) -> None:
    """Load `state_dict` into `module`, strictly except for what it need not hold: the module's
    adapters (a base model has none), or with `adapters` (a LoRA checkpoint's) everything else,
    and Transformer Engine's `_extra_state` entries."""
    with torch.no_grad():
        missing, unexpected = module.load_state_dict(state_dict, strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state") and is_adapter_key(k) == adapters]
    if missing or unexpected:
        raise RuntimeError(f"{what}: weights missing {missing}, unexpected {unexpected}")


def adapter_state(module: nn.Module) -> StateDict:
    """The adapters' tensors of a module, under its state-dict names."""
    return {k: v for k, v in module.state_dict().items() if is_adapter_key(k)}


def merge_adapters(
    state: Mapping[str, torch.Tensor], adapters: Mapping[str, torch.Tensor], spec: LoraSpec, cfg: ModelConfig
) -> StateDict:
    """Torch weights with the adapters (torch names) folded in: W0 + scale * B @ A, computed in
    float64; every weight is stored in the wider of its dtype and the adapters' (a bf16 base
    trained in fp32 gives fp32 weights: the sum, rounded to bf16, would lose the adapters' small
    steps). Every adapter the spec names must be there, and no other."""
    wide = functools.reduce(torch.promote_types, (a.dtype for a in adapters.values()), torch.bfloat16)
    out = {k: v.to(torch.promote_types(v.dtype, wide)) if v.is_floating_point() else v for k, v in state.items()}
    unused = set(adapters)
    for i in range(cfg.num_layers):
        for target in spec.targets:
            key = TORCH_LAYER.format(i) + _PREFIX + target
            if f"{key}.A" not in adapters or f"{key}.B" not in adapters:
                raise KeyError(f"no adapter {key} (model.lora.targets names {target})")
            unused -= {f"{key}.A", f"{key}.B"}
            delta = spec.scale * (adapters[f"{key}.B"].double() @ adapters[f"{key}.A"].double())
            names = [TORCH_LAYER.format(i) + n + ".weight" for n in torch_linears(cfg, target)]
            for name, part in zip(names, delta.split([out[n].shape[0] for n in names])):
                out[name] = (out[name].double() + part).to(out[name].dtype)
    if unused:
        raise KeyError(f"adapters the recipe's model.lora does not name: {sorted(unused)}")
    return out
