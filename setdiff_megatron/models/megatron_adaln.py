"""adaLN (models/adaln.py) on megatron-core: a transformer layer and a final norm that modulate.

megatron's TransformerLayer has no slot for modulated norms or gated residuals, so an adaLN layer
runs a short forward of its own over megatron's submodules. Layers and final norm read the
conditioning vector through `condition`, a plain function (a module would be copied with the
specs). Every pipeline chunk holds a copy of the time embedding; docs/dit.md ("adaLN") says how
its gradients are summed over the stages and counted once in the gradient norm.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from megatron.core.transformer.transformer_config import TransformerConfig
from megatron.core.transformer.transformer_layer import TransformerLayer

from setdiff_megatron.models.adaln import Modulation, TimestepEmbedding, modulate
from setdiff_megatron.models.torch_model import LayerNorm as TorchLayerNorm

__all__ = ["AdaLNFinalNorm", "AdaLNTransformerLayer", "time_embedding"]

Condition = Callable[[], torch.Tensor]


def _tag(module: torch.nn.Module, config: TransformerConfig) -> None:
    for p in module.parameters():
        p.sequence_parallel = config.sequence_parallel


def time_embedding(config: TransformerConfig, cond_dim: int, *, first_chunk: bool) -> TimestepEmbedding:
    """This chunk's copy of the conditioning MLP, tagged for megatron-core: `pipeline_parallel`
    (with the config's `has_cond_embedder`, finalize_model_grads sums its gradients over the
    stages), `shared_embedding` (a bucket per parameter: the distributed optimizer shards it alike
    on every stage before that sum) and, past the first chunk, `shared` (one copy in the norm)."""
    module = TimestepEmbedding(cond_dim, dtype=config.params_dtype)
    _tag(module, config)
    for p in module.parameters():
        p.pipeline_parallel = p.shared_embedding = True
        p.shared = not first_chunk
    config.has_cond_embedder = True
    return module


def _output(out_with_bias: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
    out, bias = out_with_bias
    return out if bias is None else out + bias


class AdaLNTransformerLayer(TransformerLayer):
    """megatron's layer with the DiT's adaLN: modulated norms, gated residual branches.

    Runs without dropout (the recipes' hidden dropout is 0) and without megatron's inference,
    offloading and CUDA-graph paths, which the set diffusion layers do not use. The last layer's
    attention may return the query rows only; the residual is cut to match.
    """

    def __init__(self, *args, condition: Condition, cond_dim: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.adaln_modulation = Modulation(cond_dim, self.config.hidden_size, 6, dtype=self.config.params_dtype)
        _tag(self.adaln_modulation, self.config)
        self._condition = condition

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask=None,
        rotary_pos_emb: torch.Tensor | None = None,
        context: torch.Tensor | None = None,
        **unused,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        shift_a, scale_a, gate_a, shift_m, scale_m, gate_m = self.adaln_modulation(self._condition())
        attended = _output(
            self.self_attention(
                modulate(self.input_layernorm(hidden_states), shift_a, scale_a),
                attention_mask=attention_mask,
                rotary_pos_emb=rotary_pos_emb,
            )
        )
        x = hidden_states[hidden_states.shape[0] - attended.shape[0] :] + gate_a * attended
        x = x + gate_m * _output(self.mlp(modulate(self.pre_mlp_layernorm(x), shift_m, scale_m)))
        return x, context


class AdaLNFinalNorm(TorchLayerNorm):
    """The final LayerNorm with the DiT output layer's shift and scale (its weight tagged for
    sequence parallelism, as models/megatron_model.py's norms are)."""

    def __init__(
        self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, *, condition: Condition, cond_dim: int
    ):
        super().__init__(hidden_size, eps, dtype=config.params_dtype)
        self.modulation = Modulation(cond_dim, hidden_size, 2, dtype=config.params_dtype)
        _tag(self, config)
        self._condition = condition

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return modulate(super().forward(x), *self.modulation(self._condition()))
