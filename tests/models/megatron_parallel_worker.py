"""Two-rank worker (torchrun, gloo, CPU): megatron layouts against TP=1/PP=1, and the distributed
optimizer against the plain one. Rank 0 writes the measured differences as JSON; the tests in
test_parallel_parity.py hold the tolerances.

Every layout goes through the real training path: megatron DDP, get_forward_backward_func() over
NUM_MICROBATCHES micro-batches, finalize_model_grads with per-token loss. Gradients of all ranks
are merged into torch-model names by the weight map, so one comparison covers every split.
"""

from __future__ import annotations

import sys
import warnings
from dataclasses import replace
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.pipeline_parallel import get_forward_backward_func

from setdiff_megatron.core.loss import loss_weights
from setdiff_megatron.distributed.megatron_cpu import auto_cpu_mode, dist_backend, model_parallel_seed
from setdiff_megatron.models.megatron_forward import (
    build_model_chunks,
    forward_step,
    pipeline_seq_length,
    transformer_config_from,
)
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.models.weight_maps.megatron_map import megatron_to_torch, torch_to_megatron
from tests.models.megatron_cases import (
    LENGTH,
    MICRO_BATCH,
    batches,
    compare_sampling,
    dit_parallel_config,
    parallel_config,
    reference_weights,
    write_worker_results,
)
from tests.models.megatron_shards import merge_megatron_shards

warnings.filterwarnings("ignore")

LAYOUTS = {
    "tp2": dict(tp=2),
    "tp2_sp": dict(tp=2, sequence_parallel=True),
    "tp2_sp_selective_recompute": dict(tp=2, sequence_parallel=True, recompute="selective"),
    "tp2_sp_full_recompute": dict(tp=2, sequence_parallel=True, recompute="full"),
    "pp2": dict(pp=2),
    "pp2_vpp2": dict(pp=2, vpp=2),
    "cp2": dict(cp=2),
}


def _init(tp: int = 1, pp: int = 1, vpp: int | None = None, ep: int = 1, cp: int = 1) -> None:
    parallel_state.destroy_model_parallel()
    parallel_state.initialize_model_parallel(
        tp, pp, virtual_pipeline_model_parallel_size=vpp, expert_model_parallel_size=ep, context_parallel_size=cp
    )
    model_parallel_seed(1234)


def _ddp_chunks(cfg, weights, tc, *, use_distributed_optimizer: bool = False):
    """Model chunks of this rank loaded with `weights` and wrapped in megatron DDP."""
    tp_rank, pp_rank = (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_rank(),
    )
    vpp = tc.virtual_pipeline_model_parallel_size
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=use_distributed_optimizer
    )
    chunks = []
    for vp_stage, chunk in enumerate(build_model_chunks(cfg, tc)):
        chunk.load_state_dict(
            torch_to_megatron(
                weights,
                cfg,
                tp_rank=tp_rank,
                tp_size=tc.tensor_model_parallel_size,
                pp_rank=pp_rank,
                pp_size=tc.pipeline_model_parallel_size,
                vp_size=vpp,
                vp_stage=vp_stage if vpp else None,
                ep_rank=parallel_state.get_expert_model_parallel_rank(),
                ep_size=tc.expert_model_parallel_size,
            )
        )
        chunks.append(DistributedDataParallel(tc, ddp_config, chunk))
    tc.finalize_model_grads_func = finalize_model_grads
    return chunks


def _train_step(chunks, data) -> tuple[list[float], str]:
    """One forward/backward over `data` (a list of micro-batches); per-micro-batch losses (a
    context-parallel rank reports its chunks' sums: they are added over the CP group first)."""
    for chunk in chunks:
        chunk.zero_grad_buffer()
    schedule = get_forward_backward_func()
    cp = parallel_state.get_context_parallel_world_size()
    reports = schedule(
        forward_step_func=partial(forward_step, weigh=lambda b: loss_weights(b.loss_mask, "per_token")),
        data_iterator=[iter(data) for _ in chunks],
        model=chunks,
        num_microbatches=len(data),
        seq_length=pipeline_seq_length(LENGTH, streams=1 if data[0].clean_tokens is None else 2),
        micro_batch_size=MICRO_BATCH,
    )
    if not reports:
        return [], schedule.__name__
    sums = torch.stack([r["lm loss"] for r in reports])
    if cp > 1:
        dist.all_reduce(sums, group=parallel_state.get_context_parallel_group())
    return [(nll / count).item() for nll, count in sums], schedule.__name__


def _merged(per_chunk: list[dict[str, torch.Tensor]], cfg=None) -> dict[str, torch.Tensor]:
    """Tensors of every rank's chunks, merged into torch-model names by the weight map."""
    key = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    vpp = len(per_chunk) > 1
    ep_size = parallel_state.get_expert_model_parallel_world_size()
    ep = (parallel_state.get_expert_model_parallel_rank(),) if ep_size > 1 else ()
    mine = {key + ((v,) if vpp else ()) + ep: sd for v, sd in enumerate(per_chunk)}
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    cfg = cfg or parallel_config()
    merged = merge_megatron_shards({k: sd for shards in gathered for k, sd in shards.items()}, cfg, ep_size=ep_size)
    return megatron_to_torch(merged, cfg)


def _losses_everywhere(losses: list[float]) -> list[float]:
    """The last pipeline stage's losses (other stages report none), on every rank."""
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, losses)
    return next(g for g in gathered if g)


def run_layout(cfg, weights, data, *, tp=1, pp=1, vpp=None, ep=1, cp=1, sequence_parallel=False, recompute="none"):
    """Per-micro-batch losses, merged gradients and the schedule's name for one layout."""
    _init(tp, pp, vpp, ep, cp)
    tc = transformer_config_from(
        cfg, tp=tp, pp=pp, vpp=vpp, ep=ep, cp=cp, sequence_parallel=sequence_parallel, recompute=recompute
    )
    chunks = _ddp_chunks(cfg, weights, tc)
    losses, schedule = _train_step(chunks, data)
    grads = _merged([{n: p.main_grad for n, p in c.module.named_parameters()} for c in chunks], cfg)
    return _losses_everywhere(losses), grads, schedule


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def optimizer_params(cfg, weights, data, *, use_distributed_optimizer: bool, steps: int = 3, ep: int = 1):
    """Parameters after `steps` Adam steps at DP=2, each rank on its own micro-batches."""
    _init(ep=ep)
    tc = transformer_config_from(cfg, ep=ep)
    chunks = _ddp_chunks(cfg, weights, tc, use_distributed_optimizer=use_distributed_optimizer)
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-2,
            weight_decay=0.1,
            clip_grad=1.0,
            use_distributed_optimizer=use_distributed_optimizer,
        ),
        chunks,
    )
    rank, per_rank = dist.get_rank(), len(data) // (2 * steps)
    for step in range(steps):
        first = (2 * step + rank) * per_rank
        optimizer.zero_grad()
        _train_step(chunks, data[first : first + per_rank])
        ok, grad_norm, _ = optimizer.step()
        assert ok and grad_norm > 0
    return {n: p.detach().clone() for n, p in chunks[0].module.named_parameters()}


def tp2_sampling(cfg, weights) -> dict:
    """The sampler over the TP=2 megatron model (KV cache of each rank's heads) against the torch
    model: the tokens every rank decides must be the torch model's."""
    _init(tp=2)
    (chunk,) = build_model_chunks(cfg, transformer_config_from(cfg, tp=2))
    chunk.load_state_dict(
        torch_to_megatron(weights, cfg, tp_rank=parallel_state.get_tensor_model_parallel_rank(), tp_size=2)
    )
    reference = SetDiffusionTransformer(cfg)
    reference.load_state_dict(weights)
    result = compare_sampling(chunk.eval(), reference.eval(), cfg)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, result)
    return {**result, "ranks_agree": all(g == gathered[0] for g in gathered)}


RECORD_LAYOUTS = {
    "tp2_records": dict(tp=2, sequence_parallel=True),
    "pp2_records": dict(pp=2),
    "pp2_vpp2_records": dict(pp=2, vpp=2),
    "cp2_records": dict(cp=2),
}
"""Layouts checked on supervised records against one rank (test_parallel_parity)."""
"""The reference DiT's layout (LayerNorm, GELU MLP with biases, output bias) with adaLN against one
rank: the pipeline layouts sum the time embedding's gradients over the stages (each holds a copy)."""
DIT_LAYOUTS = {
    "dit_tp2": dict(tp=2),
    "dit_tp2_sp": dict(tp=2, sequence_parallel=True),
    "dit_pp2": dict(pp=2),
    "dit_pp2_vpp2": dict(pp=2, vpp=2),
}
FAMILY_LAYOUTS = {
    "bd3lm_tp2_sp": ("bd3lm", dict(tp=2, sequence_parallel=True)),
    "bd3lm_pp2": ("bd3lm", dict(pp=2)),
    "mdlm_tp2": ("mdlm", dict(tp=2)),
    "mdlm_pp2_vpp2": ("mdlm", dict(pp=2, vpp=2)),
    "bd3lm_records_tp2": ("bd3lm_records", dict(tp=2)),
    "mdlm_records_pp2": ("mdlm_records", dict(pp=2)),
}
"""The masked-diffusion baselines' batches (grouped attention; MDLM's one stream) against one rank."""
FOUR_RANK_LAYOUTS = {"cp2_tp2_sp": dict(cp=2, tp=2, sequence_parallel=True), "cp2_pp2": dict(cp=2, pp=2)}
"""Context parallelism composed with TP (and SP) or PP: four ranks (test_parallel_parity, slow)."""


def main(out: Path) -> None:
    auto_cpu_mode()
    dist.init_process_group(dist_backend())
    cfg = parallel_config()
    weights, data = reference_weights(cfg), batches(cfg)
    ref_losses, ref_grads, _ = run_layout(cfg, weights, data)
    grad_scale = max(g.abs().max().item() for g in ref_grads.values())
    results = {"reference": {"losses": ref_losses, "grad_scale": grad_scale}}
    four = dist.get_world_size() == 4
    for name, layout in (FOUR_RANK_LAYOUTS if four else LAYOUTS).items():
        losses, grads, schedule = run_layout(cfg, weights, data, **layout)
        results[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "num_losses": len(losses),
            "grad_diff": _max_diff(grads, ref_grads),
            "schedule": schedule,
        }
    if four:
        write_worker_results(out, results)
        return
    # Packed windows of three documents: ring attention masks them across the CP ranks' chunks.
    doc_data = batches(cfg, documents=True)
    doc_losses, doc_grads, _ = run_layout(cfg, weights, doc_data)
    cp_losses, cp_grads, _ = run_layout(cfg, weights, doc_data, cp=2)
    unmasked, _, _ = run_layout(cfg, weights, [replace(b, document_ids=None) for b in doc_data])
    results["cp2_documents"] = {
        "loss_diff": max(abs(a - b) for a, b in zip(cp_losses, doc_losses)),
        "num_losses": len(cp_losses),
        "grad_diff": _max_diff(cp_grads, doc_grads),
        "differs_from_unmasked": max(abs(a - b) for a, b in zip(doc_losses, unmasked)),
    }
    # Rows of supervised records (two packed in a row): per-record positions and document ids.
    record_data = batches(cfg, records=True)
    record_losses, record_grads, _ = run_layout(cfg, weights, record_data)
    for name, layout in RECORD_LAYOUTS.items():
        losses, grads, _ = run_layout(cfg, weights, record_data, **layout)
        results[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, record_losses)),
            "num_losses": len(losses),
            "grad_diff": _max_diff(grads, record_grads),
        }
    family_data = {family: batches(cfg, family=family) for family in ("bd3lm", "mdlm")}
    family_data |= {f"{family}_records": batches(cfg, family=family, records=True) for family in ("bd3lm", "mdlm")}
    family_single = {family: run_layout(cfg, weights, data) for family, data in family_data.items()}
    for name, (family, layout) in FAMILY_LAYOUTS.items():
        losses, grads, _ = run_layout(cfg, weights, family_data[family], **layout)
        one_losses, one_grads, _ = family_single[family]
        results[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, one_losses)),
            "num_losses": len(losses),
            "grad_diff": _max_diff(grads, one_grads),
        }
    dit = dit_parallel_config()
    dit_weights, dit_data = reference_weights(dit), batches(dit)
    dit_losses, dit_grads, _ = run_layout(dit, dit_weights, dit_data)
    for name, layout in DIT_LAYOUTS.items():
        losses, grads, _ = run_layout(dit, dit_weights, dit_data, **layout)
        results[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, dit_losses)),
            "num_losses": len(losses),
            "grad_diff": _max_diff(grads, dit_grads),
            "grad_scale": max(g.abs().max().item() for g in dit_grads.values()),
        }
    results["tp2_sampling"] = tp2_sampling(cfg, weights)
    opt_data = batches(cfg, count=12, seed=1)
    plain = _merged([optimizer_params(cfg, weights, opt_data, use_distributed_optimizer=False)])
    distributed = _merged([optimizer_params(cfg, weights, opt_data, use_distributed_optimizer=True)])
    results["distributed_optimizer"] = {
        "param_diff": _max_diff(plain, distributed),
        "param_change": _max_diff(plain, weights),
    }
    write_worker_results(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
