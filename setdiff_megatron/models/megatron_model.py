"""The set diffusion transformer on megatron-core: tensor, sequence and pipeline parallel.

megatron-core's GPT layer spec with the set-causal core attention, norms that allow sequence
parallelism and, as the model asks, MLP biases, MoE layers and adaLN (why these are not megatron's
stock ones: docs/dit.md, "Training it"; docs/megatron-on-cpu.md, "Around the layer"); it computes
what models/torch_model.py computes. The last layer runs on the query rows only, except under
sequence parallelism. The TransformerConfig, this rank's chunks and forward_step are in
models/megatron_forward.py.

Shapes: b micro-batch, L ranks per stream, S = 2L tokens, E hidden, V vocabulary (Vp padded),
np/hn heads per TP rank and head dim, D head dim.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add
from megatron.core.models.common.embeddings.language_model_embedding import LanguageModelEmbedding
from megatron.core.models.common.language_module.language_module import LanguageModule
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
from megatron.core.transformer.enums import AttnMaskType, ModelType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import (
    TransformerBlock,
    TransformerBlockSubmodules,
)
from megatron.core.transformer.transformer_config import TransformerConfig

from setdiff_megatron.core.attention import grouped_attention, resolve_attention_impl, set_causal_attention
from setdiff_megatron.errors import UserError, require
from setdiff_megatron.kernels.dispatch import context_parallel_kernel
from setdiff_megatron.kernels.ring_attention import ring_set_causal_attention
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.lora import LoraSpec, Rows, add_adapters
from setdiff_megatron.models.megatron_adaln import AdaLNFinalNorm, AdaLNTransformerLayer, time_embedding
from setdiff_megatron.models.megatron_moe import SetDiffusionRouter, clean_rows_mask
from setdiff_megatron.models.torch_model import LayerNorm as TorchLayerNorm
from setdiff_megatron.models.torch_model import Rotary, cache_attention_impl
from setdiff_megatron.models.weight_maps.megatron_map import check_backend, qkv_rows
from setdiff_megatron.models.weight_maps.parallel import padded_vocab_size, stage_layers
from setdiff_megatron.sampling.kv_cache import CacheSpec, KVCache

__all__ = ["SetCausalCoreAttention", "adapt_megatron_model", "adaln_specs", "layer_spec"]


class _SequenceParallelNorm:
    """Megatron's norm slot as a torch norm, with the weight tagged for sequence parallelism:
    under SP each TP rank normalises a different slice of the sequence, and finalize_model_grads
    all-reduces the gradients of weights carrying `.sequence_parallel`."""

    def __init__(self, config: TransformerConfig, hidden_size: int, eps: float = 1e-6, **unused):
        # In the params dtype, like megatron's own norms: a bf16 input with an fp32 weight would
        # miss the fused kernel.
        super().__init__(hidden_size, eps=eps, dtype=config.params_dtype)
        self.weight.sequence_parallel = config.sequence_parallel


class RMSNorm(_SequenceParallelNorm, torch.nn.RMSNorm):
    """torch RMSNorm in megatron's norm slot."""


class LayerNorm(_SequenceParallelNorm, TorchLayerNorm):
    """The torch body's LayerNorm (a weight, no bias, float32) in megatron's norm slot."""


class _WithBias:
    """A megatron linear built with its bias whatever the caller's `bias` (add_bias_linear) says."""

    def __init__(self, *args, bias: bool = False, **kwargs):
        super().__init__(*args, bias=True, **kwargs)


class ColumnParallelLinearWithBias(_WithBias, ColumnParallelLinear):
    """The MLP's fc1 of a model with mlp_bias."""


class RowParallelLinearWithBias(_WithBias, RowParallelLinear):
    """The MLP's fc2 of a model with mlp_bias (its bias is added after the TP reduction)."""


@dataclass
class StepContext:
    """A sampling step, carried to every layer's core attention in megatron's attention-mask
    slot: the KV cache of this TP rank's heads and how many leading step tokens are commits."""

    cache: KVCache
    num_commit: int
    commit_valid: torch.Tensor | None


def attention_mask_slot(
    valid_len: torch.Tensor | None,
    document_ids: torch.Tensor | None,
    groups: torch.Tensor | None = None,
    group_within: str = "group",
) -> torch.Tensor | None:
    """What a training forward carries in megatron's attention-mask slot: `valid_len` [b], or
    with document ids [b, L] (non-negative) those ids with -1 at padding ranks, or with groups
    [b, L] (non-negative) the groups and document ids (0 without) with -1 at padding ranks,
    stacked [b, 2, L], with a third row of zeros when groups see one another by rank
    (`group_within` 'rank'), from which `_attention_inputs` recovers them (padding comes last).
    One tensor, not a tuple: full recompute saves the slot with save_for_backward, which takes
    tensors only."""
    ids = document_ids
    if groups is not None:
        rows = [groups, torch.zeros_like(groups) if document_ids is None else document_ids]
        ids = torch.stack(rows + ([torch.zeros_like(groups)] if group_within == "rank" else []), 1)
    if ids is None:
        return valid_len
    if valid_len is None:
        return ids
    ranks = torch.arange(ids.shape[-1], device=ids.device)
    return ids.masked_fill(ranks >= valid_len.view(-1, *[1] * (ids.dim() - 1)), -1)


def _attention_inputs(
    slot: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, str]:
    """(valid_len, document_ids, groups, group_within) of an `attention_mask_slot`."""
    if slot is None or slot.dim() == 1:
        return slot, None, None, "group"
    if slot.dim() == 3:
        within = "rank" if slot.shape[1] == 3 else "group"
        return (slot[:, 0] >= 0).sum(dim=1), slot[:, 1].clamp(min=0), slot[:, 0].clamp(min=0), within
    return (slot >= 0).sum(dim=1), slot, None, "group"


class SetCausalCoreAttention(MegatronModule):
    """Megatron's core-attention slot running core/attention.py's set-causal attention.

    Takes q [S, b, np, hn] and k/v [S, b, ng, hn] for the local heads of this TP rank and returns
    [S, b, np * hn]. In training the mask is implied by the [clean ; query] layout and the
    attention-mask slot carries `valid_len` [b] (ranks at or beyond it are padding), document ids
    (`attention_mask_slot`) or None; in sampling it carries a `StepContext` and the step attends
    through the KV cache. The builder's other arguments (mask type, context-parallel settings)
    have no meaning here.
    """

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        cp_comm_type: str | None = None,
        softmax_scale: float | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        *,
        impl: str,
        query_rows_only: bool = False,
    ):
        super().__init__(config=config)
        resolve_attention_impl(impl)
        self.impl = impl
        self.query_rows_only = query_rows_only
        self.softmax_scale = softmax_scale
        self.layer_index = layer_number - 1  # megatron counts layers from 1, across pipeline stages

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params=None,
    ) -> torch.Tensor:
        if attention_bias is not None or packed_seq_params is not None:
            raise ValueError("set-causal attention takes neither an attention bias nor packed sequences")
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, S, hn]
        if isinstance(attention_mask, StepContext):
            step = attention_mask
            out = step.cache.attend(
                self.layer_index, q, k, v, num_commit=step.num_commit, commit_valid=step.commit_valid
            )
            return out.permute(2, 0, 1, 3).flatten(2)
        valid_len, document_ids, groups, within = _attention_inputs(attention_mask)
        if groups is not None:  # the masked-diffusion baselines: one stream or two, as k holds
            if self.query_rows_only and k.shape[2] == 2 * groups.shape[1]:
                q = q[:, :, q.shape[2] // 2 :]
            out = grouped_attention(
                q,
                k,
                v,
                groups=groups,
                valid_len=valid_len,
                scale=self.softmax_scale,
                document_ids=document_ids,
                within=within,
            )
            return out.permute(2, 0, 1, 3).flatten(2)
        if self.query_rows_only:
            q = q[:, :, q.shape[2] // 2 :]
        cp = self.config.context_parallel_size
        if cp > 1:  # this rank's zigzag chunks of both streams; the others' clean K/V come by ring
            out = ring_set_causal_attention(
                q,
                k,
                v,
                scale=self.softmax_scale or q.shape[-1] ** -0.5,
                group=parallel_state.get_context_parallel_group(),
                valid_len=valid_len,
                document_ids=document_ids,
                kernel=context_parallel_kernel(self.impl, q),
            )
        else:
            out = set_causal_attention(
                q, k, v, impl=self.impl, valid_len=valid_len, scale=self.softmax_scale, document_ids=document_ids
            )
        return out.permute(2, 0, 1, 3).flatten(2)


def _core_attention_spec(model_cfg: ModelConfig, query_rows_only: bool = False) -> ModuleSpec:
    return ModuleSpec(
        module=SetCausalCoreAttention, params={"impl": model_cfg.attention_impl, "query_rows_only": query_rows_only}
    )


def _residual_of_output_rows(training: bool, fused: bool) -> Callable:
    """Megatron's bias-dropout-add with the residual cut to the attention output's rows: the last
    layer's attention returns the query stream only, whose rows are the residual's last ones."""
    bda = get_bias_dropout_add(training, fused)

    def add(x_with_bias: tuple, residual: torch.Tensor, prob: float) -> torch.Tensor:
        return bda(x_with_bias, residual[residual.shape[0] - x_with_bias[0].shape[0] :], prob)

    return add


def query_rows_layer_spec(spec: ModuleSpec, model_cfg: ModelConfig) -> ModuleSpec:
    """The model's last layer: nothing reads its clean-stream outputs, so its core attention,
    output projection and MLP run on the query rows only (the QKV projection still runs on all
    2L tokens: the queries attend to the clean keys and values)."""
    spec = copy.deepcopy(spec)
    spec.submodules.self_attention.submodules.core_attention = _core_attention_spec(model_cfg, query_rows_only=True)
    spec.submodules.self_attn_bda = _residual_of_output_rows
    return spec


def full_rows_moe_layer_spec(spec: ModuleSpec) -> ModuleSpec:
    """The model's last layer under sequence parallelism, which runs on every row: its MoE
    leaves the clean rows out of the router losses (models/megatron_moe.py)."""
    spec = copy.deepcopy(spec)
    spec.submodules.mlp.submodules.router = functools.partial(SetDiffusionRouter, query_rows_only=True)
    return spec


def adaln_specs(
    specs: list[ModuleSpec], embedding: torch.nn.Module, cond_dim: int
) -> tuple[list[ModuleSpec], ModuleSpec]:
    """(layer specs, final norm spec) of a model with adaLN (models/megatron_adaln.py): the same
    submodules in a layer that modulates, every one reading `embedding`'s conditioning vector."""

    def condition() -> torch.Tensor:
        return embedding()

    params = {"condition": condition, "cond_dim": cond_dim}
    layers = [dataclasses.replace(s, module=AdaLNTransformerLayer, params={**s.params, **params}) for s in specs]
    return layers, ModuleSpec(module=AdaLNFinalNorm, params=params)


def _te_modules():
    """TE's layer spec and norm, imported only when asked for: TE needs a GPU and the te extra."""
    if not torch.cuda.is_available():
        raise UserError("the 'te' backend (Transformer Engine) needs a GPU; use backend 'local' on CPU")
    require("transformer_engine.pytorch", "te", "The 'te' backend")
    try:
        from megatron.core.extensions.transformer_engine import TENorm
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec
    except Exception as exc:  # noqa: BLE001 - a broken TE raises anything on import
        raise UserError(f"Transformer Engine is installed but unusable with megatron-core: {exc}") from exc
    return get_gpt_layer_with_transformer_engine_spec, TENorm


def layer_spec(model_cfg: ModelConfig, backend: str = "local", moe: bool = False) -> tuple[ModuleSpec, type]:
    """(transformer layer spec, final norm class) for a backend: megatron's GPT layer as it is
    (column-parallel QKV, row-parallel projection, GQA, q/k norm before rotary, the MLP the
    TransformerConfig asks for; its MoE MLP when `moe`: SequentialMLP experts locally, grouped
    GEMM under TE) with the set-causal core attention; the local backend also gets SP-capable
    norms of the model's kind and, with mlp_bias, MLP linears with biases."""
    try:
        check_backend(model_cfg, backend)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    experts = dict(num_experts=model_cfg.num_experts, moe_grouped_gemm=backend == "te") if moe else {}
    if backend == "te":
        te_layer_spec, final_norm = _te_modules()
        spec = te_layer_spec(qk_layernorm=model_cfg.qk_norm, **experts)
    else:
        norm = LayerNorm if model_cfg.norm == "layernorm" else RMSNorm
        spec, final_norm = get_gpt_layer_local_spec(qk_layernorm=model_cfg.qk_norm, **experts), norm
        spec.submodules.input_layernorm = norm
        spec.submodules.pre_mlp_layernorm = norm
        if model_cfg.mlp_bias and not moe:
            spec.submodules.mlp.submodules.linear_fc1 = ColumnParallelLinearWithBias
            spec.submodules.mlp.submodules.linear_fc2 = RowParallelLinearWithBias
        if model_cfg.qk_norm:
            spec.submodules.self_attention.submodules.q_layernorm = RMSNorm
            spec.submodules.self_attention.submodules.k_layernorm = RMSNorm
    attention = spec.submodules.self_attention
    attention.params = {"attn_mask_type": AttnMaskType.arbitrary}
    attention.submodules.core_attention = _core_attention_spec(model_cfg)
    if moe:
        spec.submodules.mlp.submodules.router = SetDiffusionRouter
    return spec, final_norm


class SetDiffusionGPT(LanguageModule):
    """One pipeline chunk of the set diffusion transformer (the whole model at pp == 1)."""

    def __init__(
        self,
        config: TransformerConfig,
        model_cfg: ModelConfig,
        *,
        backend: str = "local",
        pre_process: bool = True,
        post_process: bool = True,
        vp_stage: int | None = None,
        pg_collection: ProcessGroupCollection | None = None,
    ):
        super().__init__(config=config, pg_collection=pg_collection)
        self.model_cfg = model_cfg
        self.pre_process, self.post_process, self.vp_stage = pre_process, post_process, vp_stage
        self.share_embeddings_and_output_weights = model_cfg.tie_embeddings
        self.model_type = ModelType.encoder_or_decoder
        tp_size, tp_rank = self.tp_group.size(), self.tp_group.rank()
        self.vocab_size = padded_vocab_size(model_cfg.vocab_size, tp_size)

        if pre_process:  # a vocabulary-parallel embedding of the streams' tokens; MASK is an ordinary row
            self.embedding = LanguageModelEmbedding(
                config=config,
                vocab_size=self.vocab_size,
                max_sequence_length=2 * model_cfg.max_seq_len,
                position_embedding_type="none",
                tp_group=self.tp_group,
            )
        # A plain attribute, not a buffer: Float16Module casts buffers, and bf16 angles are wrong.
        self.inv_freq = Rotary(model_cfg.head_dim, model_cfg.rope_theta).inv_freq
        layers = stage_layers(
            model_cfg.num_layers,
            self.pp_group.size(),
            self.pp_group.rank(),
            config.virtual_pipeline_model_parallel_size,
            vp_stage,
        )
        specs = [layer_spec(model_cfg, backend, moe=model_cfg.moe_layers[i])[0] for i in layers]
        final_norm = layer_spec(model_cfg, backend)[1]
        num_layers = len(specs)
        # Under sequence parallelism each TP rank holds a slice of both streams, not of the query
        # stream, so the last layer cannot drop the clean rows locally: it runs in full there.
        self.last_layer_moe = bool(post_process and num_layers and model_cfg.moe_layers[layers[-1]])
        if post_process and num_layers and not config.sequence_parallel:
            specs[-1] = query_rows_layer_spec(specs[-1], model_cfg)
        elif self.last_layer_moe:
            specs[-1] = full_rows_moe_layer_spec(specs[-1])
        if model_cfg.adaln:
            first_chunk = self.pp_group.rank() == 0 and not vp_stage
            self.time_embedding = time_embedding(config, model_cfg.adaln_cond_dim, first_chunk=first_chunk)
            specs, final_norm = adaln_specs(specs, self.time_embedding, model_cfg.adaln_cond_dim)
        self.decoder = TransformerBlock(
            config=config,
            spec=TransformerBlockSubmodules(layer_specs=specs, layer_norm=final_norm),
            pre_process=pre_process,
            post_process=post_process,
            pg_collection=self.pg_collection,
            vp_stage=vp_stage,
        )
        if post_process:
            self.output_layer = tensor_parallel.ColumnParallelLinear(
                config.hidden_size,
                self.vocab_size,
                config=config,
                init_method=config.init_method,
                bias=model_cfg.output_bias,
                gather_output=False,
                skip_weight_param_allocation=pre_process and model_cfg.tie_embeddings,
                # Under SP _query_output gathers the sequence itself, and that gather's backward
                # already sums the input gradient over TP: the layer must neither gather nor reduce.
                disable_grad_reduce=config.sequence_parallel,
                tp_group=self.tp_group,
            )
            self.output_layer.sequence_parallel = False
            start = tp_rank * (self.vocab_size // tp_size)
            ids = torch.arange(start, start + self.vocab_size // tp_size)
            # MASK is never a prediction and padding rows are no tokens: both leave the softmax.
            self.register_buffer(
                "excluded_vocab", (ids == model_cfg.mask_token_id) | (ids >= model_cfg.vocab_size), persistent=False
            )
        if pre_process or post_process:  # ties the output layer to the embedding across stages, as GPTModel does
            self.setup_embeddings_and_output_layer()

    def sharded_state_dict(self, prefix: str = "", sharded_offsets: tuple = (), metadata: dict | None = None) -> dict:
        """megatron's, with the time embedding's copies told apart: each pipeline chunk holds
        one, and only the first chunk's is the main replica that a checkpoint saves."""
        state = super().sharded_state_dict(prefix, sharded_offsets, metadata)
        if self.model_cfg.adaln:
            chunk = self.pp_group.rank() + self.pp_group.size() * (self.vp_stage or 0)
            for key, tensor in state.items():
                if key.startswith(f"{prefix}time_embedding."):
                    tensor.replica_id = (chunk, *tensor.replica_id[1:])
        return state

    def set_input_tensor(self, input_tensor: torch.Tensor | list[torch.Tensor]) -> None:
        """Pipeline schedules hand a non-first stage its input here."""
        if isinstance(input_tensor, list):
            (input_tensor,) = input_tensor
        self.decoder.set_input_tensor(input_tensor)

    def rotary_freqs(self, position_ids: torch.Tensor) -> torch.Tensor:
        """[S, b, 1, D] rotary angles of tokens [b, S] at their original positions (megatron's own
        `rope` ignores position ids); megatron's rotate-half application of [angles, angles]
        equals the torch model's."""
        if self.inv_freq.device != position_ids.device:
            self.inv_freq = self.inv_freq.to(position_ids.device)
        angles = position_ids[..., None].float() * self.inv_freq
        return torch.cat([angles, angles], dim=-1).transpose(0, 1)[:, :, None]

    def forward(
        self,
        clean_tokens: torch.Tensor | None,
        query_tokens: torch.Tensor | None,
        position_ids: torch.Tensor,
        valid_len: torch.Tensor | None = None,
        targets: torch.Tensor | None = None,
        document_ids: torch.Tensor | None = None,
        groups: torch.Tensor | None = None,
        group_within: str = "group",
        temperature: float = 1.0,
    ) -> torch.Tensor:
        """Two streams of [b, L] tokens in rank order (needed on the first stage only); with
        `document_ids` [b, L] (rank order) attention stays within each document; with `groups`
        [b, L] ranks of a group are decided together (core/attention.py `grouped_mask`) and
        `clean_tokens` may be None on every stage: the query stream alone (MDLM). Under context
        parallelism the streams are this rank's zigzag chunks, and valid_len and document_ids
        still describe the whole sequence.

        Returns, on the last stage, the query stream's per-token NLL [b, L] (float32, MASK
        excluded; of logits / `temperature`, RL's sampling temperature) when `targets` is given,
        else its logits [b, L, V] gathered over TP; on other stages the hidden states [S(/tp under
        SP), b, E] for the next stage.
        """
        length = position_ids.shape[1]
        streams = 1 if groups is not None and clean_tokens is None else 2
        if length > self.model_cfg.max_seq_len:
            raise ValueError(f"sequence length {length} exceeds the model's max_seq_len={self.model_cfg.max_seq_len}")
        if self.config.sequence_parallel and streams * length % self.tp_group.size():
            raise ValueError(
                f"sequence parallelism splits the {streams * length} tokens of the streams over "
                f"{self.tp_group.size()} ranks: they must be divisible by the TP size"
            )
        hidden = None
        if self.pre_process:
            tokens = query_tokens if streams == 1 else torch.cat([clean_tokens, query_tokens], dim=1)
            hidden = self.embedding(input_ids=tokens, position_ids=None)
        clean_rows = None
        if self.last_layer_moe and self.config.sequence_parallel and streams == 2:
            tp = self.tp_group
            clean_rows = clean_rows_mask(2 * length, len(position_ids), tp.rank(), tp.size(), position_ids.device)
        hidden = self.decoder(
            hidden_states=hidden,
            attention_mask=attention_mask_slot(valid_len, document_ids, groups, group_within),
            rotary_pos_emb=self.rotary_freqs(position_ids.repeat(1, streams)),
            padding_mask=clean_rows,
        )
        if not self.post_process:
            return hidden
        return self._query_output(hidden, length, targets, temperature)

    def _check_sampling(self) -> None:
        if self.config.context_parallel_size > 1:
            raise UserError(
                "sampling runs the whole sequence on each rank: use context parallel size 1 "
                "(tensor parallelism is supported)"
            )
        if not (self.pre_process and self.post_process):
            raise UserError(
                "sampling runs the whole model on each rank: use pipeline parallel size 1 "
                "(tensor parallelism is supported)"
            )
        if self.config.sequence_parallel:
            raise UserError("sampling needs sequence_parallel off: a step's few tokens do not split over TP ranks")

    def cache_spec(self) -> CacheSpec:
        """The KV cache of this TP rank's key/value heads (the sampler's `StepModel` protocol)."""
        self._check_sampling()
        weight = self.embedding.word_embeddings.weight
        heads = self.model_cfg.num_kv_heads // self.tp_group.size()
        return CacheSpec(len(self.decoder.layers), heads, self.model_cfg.head_dim, weight.dtype, weight.device)

    def new_cache(self, batch_size: int, capacity: int) -> KVCache:
        weight = self.embedding.word_embeddings.weight
        return KVCache.of(self.cache_spec(), batch_size, capacity, cache_attention_impl(self.model_cfg, weight))

    def step(
        self,
        tokens: torch.Tensor,
        position_ids: torch.Tensor,
        cache: KVCache,
        num_commit: int,
        commit_valid: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One sampling forward (torch_model.SetDiffusionTransformer.step's contract): commit the
        first num_commit tokens [B, T], return the other queries' logits [B, T - num_commit, V],
        gathered over TP so every rank decides the same tokens."""
        self._check_sampling()
        hidden = self.embedding(input_ids=tokens, position_ids=None)
        hidden = self.decoder(
            hidden_states=hidden,
            attention_mask=StepContext(cache, num_commit, commit_valid),
            rotary_pos_emb=self.rotary_freqs(position_ids),
        )
        cache.advance()
        return self._query_output(hidden, tokens.shape[1] - num_commit, None)

    def _query_output(
        self, hidden: torch.Tensor, num_queries: int, targets: torch.Tensor | None, temperature: float = 1.0
    ) -> torch.Tensor:
        """Logits or NLL of the last `num_queries` rows of the final hidden states: the query
        stream (the last layer may already have dropped the clean rows)."""
        if self.config.sequence_parallel:
            hidden = tensor_parallel.gather_from_sequence_parallel_region(hidden, group=self.tp_group)
        weight = self.shared_embedding_or_output_weight() if self.share_embeddings_and_output_weights else None
        logits, _ = self.output_layer(hidden[hidden.shape[0] - num_queries :], weight=weight)  # [L, b, Vp/tp]
        if targets is None:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits, group=self.tp_group)
            return logits[..., : self.model_cfg.vocab_size].transpose(0, 1).contiguous()
        if temperature != 1.0:
            logits = logits / temperature
        logits = logits.masked_fill(self.excluded_vocab, float("-inf"))
        nll = tensor_parallel.vocab_parallel_cross_entropy(logits, targets.transpose(0, 1).contiguous())
        return nll.transpose(0, 1).contiguous()


_LORA_SITES = {
    "qkv": "self_attention.linear_qkv",
    "attention_output": "self_attention.linear_proj",
    "mlp_input": "mlp.linear_fc1",
    "mlp_output": "mlp.linear_fc2",
}
"""The megatron layer's linear under each LoRA target (models/lora.py); fc1's [gate ; up] rows are
the torch adapter's at TP = 1, linear_qkv's are regrouped (`qkv_rows`)."""


def adapt_megatron_model(chunk: SetDiffusionGPT, spec: LoraSpec, seed: int) -> None:
    """LoRA adapters (models/lora.py) on a whole model's layers (TP = PP = 1, local backend, dense:
    recipes/validation.py refuses the rest), drawn as the torch body draws them."""
    qkv = qkv_rows(chunk.model_cfg)

    def sites(layer, target: str) -> list[tuple[torch.nn.Module, Rows]]:
        linear = layer.get_submodule(_LORA_SITES[target])
        return [(linear, qkv.to(linear.weight.device) if target == "qkv" else slice(None))]

    add_adapters(chunk, ((layer.layer_number - 1, layer) for layer in chunk.decoder.layers), sites, spec, seed)
