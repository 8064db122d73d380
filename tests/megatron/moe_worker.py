"""Two-rank worker (torchrun, gloo, CPU): megatron-core's MoE layer (top-2 router with the
load-balancing loss, all-to-all token dispatcher, SequentialMLP experts) at expert parallelism 2
against the same layer at EP = 1. Expert e's weights come from seed 100 + e in both layouts, and
both ranks see the same tokens, so every output and gradient must agree (the experts' summed over
the ranks). Rank 0 writes the
differences as JSON for test_moe_cpu.py."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import torch
from megatron.core import parallel_state
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import build_module
from megatron.core.transformer.transformer_config import TransformerConfig

from setdiff_megatron.distributed.layout import Layout
from setdiff_megatron.distributed.runtime import init_model_parallel, world_size
from tests.megatron.cases import write_worker_results

warnings.filterwarnings("ignore")

NUM_EXPERTS, HIDDEN = 4, 32


def moe_layer(ep: int) -> torch.nn.Module:
    cfg = TransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=4, ffn_hidden_size=64,
                            num_moe_experts=NUM_EXPERTS, moe_router_topk=2, moe_ffn_hidden_size=48,
                            moe_aux_loss_coeff=1e-2, moe_router_load_balancing_type="aux_loss",
                            moe_token_dispatcher_type="alltoall", expert_model_parallel_size=ep,
                            use_cpu_initialization=True, params_dtype=torch.float32, add_bias_linear=False,
                            gated_linear_unit=True)
    layer = build_module(get_gpt_layer_local_spec(num_experts=NUM_EXPERTS, moe_grouped_gemm=False).submodules.mlp,
                         config=cfg)
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
    (out ** 2).sum().backward()
    first = parallel_state.get_expert_model_parallel_rank() * (NUM_EXPERTS // ep)
    local = torch.stack([torch.cat([e.linear_fc1.weight.grad.flatten(), e.linear_fc2.weight.grad.flatten()])
                         for e in layer.experts.local_experts])
    experts = torch.zeros(NUM_EXPERTS, local.shape[1])
    experts[first:first + len(local)] = local
    # At EP = 2 each expert serves the tokens of both ranks; at EP = 1 each rank's copy serves its
    # own: summed over the ranks, both are the gradient over all tokens.
    torch.distributed.all_reduce(experts)
    return {"out": out.detach(), "x_grad": x.grad, "router_grad": layer.router.weight.grad, "expert_grads": experts}


def main(out: Path) -> None:
    ep2, ep1 = run(2), run(1)
    results = {key: float((ep2[key] - ep1[key]).abs().max()) for key in ep1}
    results["expert_grad_norm"] = float(ep1["expert_grads"].norm())
    results["every_expert_used"] = bool((ep1["expert_grads"].abs().sum(1) > 0).all())
    write_worker_results(out, results)


if __name__ == "__main__":
    main(Path(sys.argv[1]))
