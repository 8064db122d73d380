"""Two-rank worker (torchrun, gloo, CPU) for test_moe_cpu.py; rank 0 writes the differences as JSON.

- layer: megatron-core's MoE layer alone (top-2 router with the load-balancing loss, all-to-all
  token dispatcher, SequentialMLP experts) at expert parallelism 2 against EP = 1. Expert e's
  weights come from seed 100 + e in both layouts and both ranks see the same tokens, so every
  output and gradient must agree (the experts' summed over the ranks).
- model: the MoE set diffusion model through the real training path (parallel_worker.run_layout:
  DDP, the schedule over 4 micro-batches, per-token loss with the router losses) at EP = 2
  against EP = 1, and three Adam steps of the distributed optimizer at EP = 2 against the plain
  one at EP = 1; with four ranks instead, TP = 2 x EP = 2 against TP = 2.
- split: the same training path with each micro-batch's rows split over the ranks, TP = 2 with
  sequence parallelism and CP = 2, against one rank: the router losses' shares (the last layer's
  taken over its query rows only) must add up to one rank's.
- sampling: greedy decodes at TP = 2 and at EP = 2 against the torch model.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from setdiff_megatron.distributed.layout import Layout
from setdiff_megatron.distributed.runtime import init_model_parallel, world_size
from setdiff_megatron.models.megatron_forward import build_model_chunks, transformer_config_from
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.models.weight_maps.megatron_map import torch_to_megatron
from tests.models.megatron_cases import batches, compare_sampling, moe_config, reference_weights, write_worker_results
from tests.models.megatron_parallel_worker import _max_diff, _merged, optimizer_params, run_layout

warnings.filterwarnings("ignore")

NUM_EXPERTS, HIDDEN = 4, 32


def moe_layer(ep: int) -> torch.nn.Module:
    cfg = TransformerConfig(
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=4,
        ffn_hidden_size=64,
        num_moe_experts=NUM_EXPERTS,
        moe_router_topk=2,
        moe_ffn_hidden_size=48,
        moe_aux_loss_coeff=1e-2,
        moe_router_load_balancing_type="aux_loss",
        moe_token_dispatcher_type="alltoall",
        expert_model_parallel_size=ep,
        use_cpu_initialization=True,
        params_dtype=torch.float32,
        add_bias_linear=False,
        gated_linear_unit=True,
    )
    layer = build_module(
        get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False).submodules.mlp, config=cfg
    )
    first = parallel_state.get_expert_model_parallel_rank() * (NUM_EXPERTS // ep)
    with torch.no_grad():
        layer.router.weight.copy_(torch.randn(layer.router.weight.shape, generator=torch.Generator().manual_seed(7)))
        for i, expert in enumerate(layer.experts.local_experts):
            gen = torch.Generator().manual_seed(100 + first + i)
            for p in (expert.linear_fc1.weight, expert.linear_fc2.weight):
                p.copy_(0.2 * torch.randn(p.shape, generator=gen))
    return layer


def run(ep: int) -> dict[str, torch.Tensor]:
    """Outputs, input and router gradients, and every expert's gradient by global index."""
    parallel_state.destroy_model_parallel()
    init_model_parallel(Layout.of(world_size(), ep=ep), seed=1)
    layer = moe_layer(ep)
    x = torch.randn(16, 2, HIDDEN, generator=torch.Generator().manual_seed(0), requires_grad=True)
    out, _ = layer(x)
    (out**2).sum().backward()
    first = parallel_state.get_expert_model_parallel_rank() * (NUM_EXPERTS // ep)
    local = torch.stack(
        [
            torch.cat([e.linear_fc1.weight.grad.flatten(), e.linear_fc2.weight.grad.flatten()])
            for e in layer.experts.local_experts
        ]
    )
    experts = torch.zeros(NUM_EXPERTS, local.shape[1])
    experts[first : first + len(local)] = local
    # At EP = 2 each expert serves the tokens of both ranks; at EP = 1 each rank's copy serves its
    # own: summed over the ranks, both are the gradient over all tokens.
    torch.distributed.all_reduce(experts)
    return {"out": out.detach(), "x_grad": x.grad, "router_grad": layer.router.weight.grad, "expert_grads": experts}


def layer_parity() -> dict:
    ep2, ep1 = run(2), run(1)
    results = {key: float((ep2[key] - ep1[key]).abs().max()) for key in ep1}
    results["expert_grad_norm"] = float(ep1["expert_grads"].norm())
    results["every_expert_used"] = bool((ep1["expert_grads"].abs().sum(1) > 0).all())
    return results


def model_parity() -> dict:
    # layer_parity's bare backward left megatron's aux-loss scale a 0-d tensor, which the schedule's
    # [1]-shaped scale cannot be copied into: start from no scale, as a fresh training process does.
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    cfg = moe_config()
    weights, data = reference_weights(cfg), batches(cfg)
    ref_losses, ref_grads, _ = run_layout(cfg, weights, data, ep=1)
    losses, grads, _ = run_layout(cfg, weights, data, ep=2)
    records = batches(cfg, records=True)  # rows of supervised records, two packed in a row
    record_losses, record_grads, _ = run_layout(cfg, weights, records, ep=1)
    ep2_losses, ep2_grads, _ = run_layout(cfg, weights, records, ep=2)
    opt_data = batches(cfg, count=12, seed=1)
    plain = _merged([optimizer_params(cfg, weights, opt_data, use_distributed_optimizer=False)], cfg)
    distributed = _merged([optimizer_params(cfg, weights, opt_data, use_distributed_optimizer=True, ep=2)], cfg)
    return {
        "losses": ref_losses,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "records_loss_diff": max(abs(a - b) for a, b in zip(ep2_losses, record_losses)),
        "records_grad_diff": _max_diff(ep2_grads, record_grads),
        "grad_diff": _max_diff(grads, ref_grads),
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
        "router_grad_norm": sum(g.norm().item() for k, g in ref_grads.items() if k.endswith("mlp.gate.weight")),
        "param_diff": _max_diff(plain, distributed),
        "param_change": _max_diff(plain, weights),
    }


def split_parity() -> dict:
    """TP = 2 under sequence parallelism and CP = 2 against one rank, through the training path."""
    MoEAuxLossAutoScaler.main_loss_backward_scale = None
    cfg = moe_config()
    weights, data = reference_weights(cfg), batches(cfg)
    ref_losses, ref_grads, _ = run_layout(cfg, weights, data)
    results = {"grad_scale": max(g.abs().max().item() for g in ref_grads.values())}
    for name, layout in {"tp2_sp": dict(tp=2, sequence_parallel=True), "cp2": dict(cp=2)}.items():
        losses, grads, _ = run_layout(cfg, weights, data, **layout)
        results[name] = {
            "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "grad_diff": _max_diff(grads, ref_grads),
            "router_grad_diff": _max_diff(
                *({k: g[k] for k in g if k.endswith("mlp.gate.weight")} for g in (grads, ref_grads))
            ),
        }
    return results


def sampling(*, tp: int = 1, ep: int = 1) -> dict:
    """The sampler over the MoE megatron model at TP = 2 (experts split like the dense MLPs) or
    EP = 2 (both ranks decode the same prompts, experts exchanged by all-to-all) against the torch
    model: the tokens every rank decides must be the torch model's."""
    cfg = moe_config()
    weights = reference_weights(cfg)
    parallel_state.destroy_model_parallel()
    init_model_parallel(Layout.of(world_size(), tp=tp, ep=ep), seed=1)
    (chunk,) = build_model_chunks(cfg, transformer_config_from(cfg, tp=tp, ep=ep))
    chunk.load_state_dict(
        torch_to_megatron(
            weights,
            cfg,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=tp,
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            ep_size=ep,
        )
    )
    reference = SetDiffusionTransformer(cfg)
    reference.load_state_dict(weights)
    result = compare_sampling(chunk.eval(), reference.eval(), cfg)
    gathered: list = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, result)
    return {**result, "ranks_agree": all(g == gathered[0] for g in gathered)}


def tp2_ep2_parity() -> dict:
    """Four ranks: TP = 2 x EP = 2 (sequence parallel, as megatron-core asks of MoE under TP)
    against TP = 2 at EP = 1, through the training path."""
    init_model_parallel(Layout.of(world_size(), tp=2), seed=1)  # the process group, on the CPU layer
    cfg = moe_config()
    weights, data = reference_weights(cfg), batches(cfg)
    ref_losses, ref_grads, _ = run_layout(cfg, weights, data, tp=2, sequence_parallel=True)
    losses, grads, _ = run_layout(cfg, weights, data, tp=2, ep=2, sequence_parallel=True)
    return {
        "losses": ref_losses,
        "loss_diff": max(abs(a - b) for a, b in zip(losses, ref_losses)),
        "grad_diff": _max_diff(grads, ref_grads),
        "grad_scale": max(g.abs().max().item() for g in ref_grads.values()),
    }


def main(out: Path) -> None:
    if world_size() == 4:
        write_worker_results(out, {"tp2_ep2": tp2_ep2_parity()})
        return
    write_worker_results(
        out,
        {
            "layer": layer_parity(),
            "model": model_parity(),
            "split": split_parity(),
            "tp2_sampling": sampling(tp=2),
            "ep2_sampling": sampling(ep=2),
        },
    )


if __name__ == "__main__":
    main(Path(sys.argv[1]))
