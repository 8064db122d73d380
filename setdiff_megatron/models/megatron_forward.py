"""What megatron-core's training machinery needs around the set diffusion body of
models/megatron_model.py: the TransformerConfig of a ModelConfig under a parallel layout, this
rank's model chunks, and the schedule's hooks (forward_step with its loss_func, the sequence
length the pipeline stages exchange, the context-parallel slice of a batch).

Kept apart from the body so that the layers and specs read on their own; the megatron engine,
checkpoint conversion and sampling build their models through here.

Shapes: b micro-batch, L ranks per stream.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import fields, replace
from functools import partial
from typing import Literal

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.transformer_config import TransformerConfig

from setdiff_megatron.core.loss import LossWeights
from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.errors import UserError
from setdiff_megatron.kernels.ring_attention import zigzag_ranks
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.megatron_model import SetDiffusionGPT
from setdiff_megatron.models.weight_maps.parallel import check_ep_split, check_tp_split, stage_layers

__all__ = [
    "batch_nll",
    "build_model_chunks",
    "forward_step",
    "loss_func",
    "pipeline_seq_length",
    "transformer_config_from",
]

Recompute = Literal["none", "selective", "full"]


def transformer_config_from(
    model_cfg: ModelConfig,
    *,
    tp: int = 1,
    pp: int = 1,
    vpp: int | None = None,
    ep: int = 1,
    cp: int = 1,
    sequence_parallel: bool = False,
    recompute: Recompute = "none",
    params_dtype: torch.dtype = torch.float32,
    calculate_per_token_loss: bool = True,
    **overrides,
) -> TransformerConfig:
    """megatron's TransformerConfig for `model_cfg` under a (tp, pp, vpp, ep, cp) layout.

    `calculate_per_token_loss` (default) makes the schedule back-propagate NLL sums and divide
    the gradients by the global number of target tokens: core/loss.py's per-token mean over the
    whole global batch. `overrides` replace or add TransformerConfig fields (dropout, fp8, ...).
    Sequence parallelism is switched off at tp == 1, as megatron's own arguments do.
    """
    try:
        check_tp_split(model_cfg, tp)
        check_ep_split(model_cfg, ep)
        stage_layers(model_cfg.num_layers, pp, 0, vpp, 0 if vpp else None)
    except ValueError as exc:
        raise UserError(f"parallel layout tp={tp} pp={pp} vpp={vpp} ep={ep}: {exc}") from None
    if recompute not in ("none", "selective", "full"):
        raise UserError(f"recompute must be 'none', 'selective' or 'full'; got {recompute!r}")
    full = recompute == "full"
    fields = dict(
        num_layers=model_cfg.num_layers,
        hidden_size=model_cfg.hidden_size,
        num_attention_heads=model_cfg.num_heads,
        num_query_groups=model_cfg.num_kv_heads,
        kv_channels=model_cfg.head_dim,
        ffn_hidden_size=model_cfg.intermediate_size,
        normalization="LayerNorm" if model_cfg.norm == "layernorm" else "RMSNorm",
        layernorm_epsilon=model_cfg.norm_eps,
        qk_layernorm=model_cfg.qk_norm,
        gated_linear_unit=model_cfg.mlp == "swiglu",
        activation_func=F.silu if model_cfg.mlp == "swiglu" else gelu_tanh,
        add_bias_linear=False,  # MLP biases come with the spec's linears (layer_spec)
        add_qkv_bias=model_cfg.qkv_bias,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=model_cfg.init_std,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        context_parallel_size=cp,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=sequence_parallel and tp > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        recompute_granularity=None if recompute == "none" else recompute,
        recompute_method="uniform" if full else None,
        recompute_num_layers=1 if full else None,
        calculate_per_token_loss=calculate_per_token_loss,
        # Interleaved PP over two ranks sends both directions to the same peer; batched p2p then
        # silently mixes up tensors (docs/megatron-on-cpu.md, "Around the layer"), so interleaving
        # uses unbatched p2p.
        batch_p2p_comm=vpp is None,
    )
    return TransformerConfig(**(fields | _moe_fields(model_cfg, ep, tp * cp) | overrides))


def _moe_fields(cfg: ModelConfig, ep: int, tp_cp: int) -> dict:
    """megatron's MoE settings for models/moe.py's mixture of experts: all-to-all dispatch over the
    expert-parallel group, experts split over TP like dense MLPs, routers as documented there.

    megatron-core divides the z-loss coefficient by TP x CP, but each rank's z-loss is already a
    sum over its own tokens only: the coefficient is scaled back up so that the gradient is one
    rank's on every layout (the load-balancing loss: models/megatron_moe.py).
    """
    if not cfg.num_experts:
        return {}
    return dict(
        num_moe_experts=cfg.num_experts,
        moe_router_topk=cfg.moe_top_k,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_shared_expert_intermediate_size=cfg.num_shared_experts * cfg.moe_intermediate_size or None,
        moe_layer_freq=[int(m) for m in cfg.moe_layers],
        moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_router_load_balancing_type="aux_loss" if cfg.moe_aux_loss_coeff else "none",
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_z_loss_coeff=cfg.moe_z_loss_coeff * tp_cp or None,
        moe_expert_capacity_factor=cfg.moe_capacity_factor,
        moe_token_drop_policy="probs",
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep,
    )


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """The tanh-approximated GELU of the DiT's MLP (models/moe.py's MLP computes the same)."""
    return F.gelu(x, approximate="tanh")


def build_model_chunks(
    model_cfg: ModelConfig,
    config: TransformerConfig,
    *,
    backend: str = "local",
    pg_collection: ProcessGroupCollection | None = None,
) -> list[SetDiffusionGPT]:
    """This rank's model chunks (one per virtual pipeline stage), with megatron's first/last
    stage roles. parallel_state must be initialised, and on a machine without a GPU
    distributed.megatron_cpu.auto_cpu_mode() must have run (distributed.runtime does it first)."""
    pp_size, pp_rank = (
        parallel_state.get_pipeline_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp) if vpp else [None]:
        first_chunk, last_chunk = vp_stage in (None, 0), vp_stage in (None, vpp - 1 if vpp else None)
        chunks.append(
            SetDiffusionGPT(
                config,
                model_cfg,
                backend=backend,
                vp_stage=vp_stage,
                pg_collection=pg_collection,
                pre_process=pp_rank == 0 and first_chunk,
                post_process=pp_rank == pp_size - 1 and last_chunk,
            )
        )
    for chunk in chunks:
        _keep_experts_apart(chunk)
    return chunks


def _keep_experts_apart(chunk: torch.nn.Module) -> None:
    """Routed experts' weights go to megatron's expert-parallel gradient buffers and optimizer at
    every EP size, EP = 1 included (megatron does so only at EP > 1): the optimizer's checkpoint
    then has one structure, dense and expert parts, and reshards between EP sizes. At EP = 1 the
    expert data-parallel group is the data-parallel group, so the arithmetic is unchanged."""
    for name, param in chunk.named_parameters():
        if ".mlp.experts." in name:
            param.allreduce = False


def pipeline_seq_length(length: int, streams: int = 2) -> int:
    """The sequence length megatron's schedules communicate between stages: two streams of L, or
    MDLM's one (the schedules divide it by the context-parallel size themselves)."""
    return streams * length


def _cp_ranks(length: int, device: torch.device) -> torch.Tensor | None:
    """This context-parallel rank's zigzag ranks of a stream of `length`, None without CP."""
    cp = parallel_state.get_context_parallel_world_size()
    if cp == 1:
        return None
    return zigzag_ranks(length, cp, parallel_state.get_context_parallel_rank(), device=device)


def context_parallel_slice(batch: TwoStreamBatch) -> TwoStreamBatch:
    """This context-parallel rank's zigzag chunks of every [b, L] field (megatron's
    get_batch_on_this_cp_rank for two streams); valid_len and document_ids stay whole, since ring
    attention masks every rank's chunks with them."""
    rows = _cp_ranks(batch.position_ids.shape[1], batch.position_ids.device)
    if rows is None:
        return batch
    per_rank = {
        f.name: t[:, rows]
        for f in fields(batch)
        if isinstance(t := getattr(batch, f.name), torch.Tensor) and t.dim() == 2 and f.name != "document_ids"
    }
    return replace(batch, **per_rank)


def context_parallel_weights(weights: LossWeights, length: int) -> LossWeights:
    """This context-parallel rank's share of a whole batch's loss weights: the weights of its
    zigzag ranks, and the whole denominator on the first CP rank only, so that the sums over CP
    ranks are the batch's (a row's count spans every CP rank's chunks)."""
    rows = _cp_ranks(length, weights.weight_BL.device)
    if rows is None:
        return weights
    first = parallel_state.get_context_parallel_rank() == 0
    return LossWeights(weights.weight_BL[:, rows], weights.denominator if first else weights.denominator * 0)


def loss_func(weights: LossWeights, nll: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """Megatron's loss-function contract, 3-tuple form: (weighted NLL sum, denominator, report).
    With calculate_per_token_loss the schedule and finalize_model_grads sum both over micro-batches
    and ranks and divide the gradients by the denominator: core/loss.py's normalised loss over the
    whole global batch (per target token, or per row)."""
    nll_sum = weights.apply(nll).sum()
    denominator = weights.denominator.to(torch.int)
    return nll_sum, denominator, {"lm loss": torch.stack([nll_sum.detach(), denominator.float()])}


def forward_step(
    data_iterator: Iterator[TwoStreamBatch],
    model: torch.nn.Module,
    *,
    weigh: Callable[[TwoStreamBatch], LossWeights],
) -> tuple[torch.Tensor, Callable[[torch.Tensor], tuple]]:
    """Megatron's forward_step(data_iterator, model) -> (output, loss function of the output),
    once `weigh` (a batch's loss weights, e.g. training/objective.py's) is bound with partial.

    Every pipeline stage draws the whole batch: each one needs the positions (rotary), valid_len
    and document ids (attention), the first the tokens and the last the targets and loss weights.
    Under context parallelism each rank keeps its zigzag chunks, the weights weighed on the whole
    batch first; the schedule and finalize_model_grads sum the NLL, the denominator and the
    gradients over the CP ranks too.
    """
    whole = next(data_iterator)
    nll = batch_nll(model, context_parallel_slice(whole))
    return nll, partial(loss_func, context_parallel_weights(weigh(whole), whole.position_ids.shape[1]))


def batch_nll(model: torch.nn.Module, batch: TwoStreamBatch) -> torch.Tensor:
    """The megatron body's NLL [b, L] of each target of `batch`: the one call of the model.

    On a last stage; other stages return the hidden states. At the batch's sampling temperature
    where it has one (RL's PolicyBatch)."""
    return model(
        batch.clean_tokens,
        batch.query_tokens,
        batch.position_ids,
        valid_len=batch.valid_len,
        targets=batch.targets,
        document_ids=batch.document_ids,
        groups=batch.groups,
        group_within=batch.group_within,
        temperature=getattr(batch, "temperature", 1.0),
    )
