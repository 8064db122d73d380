"""One-rank worker (gloo, world size 1): the CPU compatibility layer, and the megatron model
against the torch model through the weight map. CPU mode patches torch for the life of a process,
so these checks run here rather than in the pytest process. The JSON it writes holds observations;
test_cpu_compat.py and test_torch_parity.py hold the expectations.
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.tensor_parallel import get_cuda_rng_tracker
from megatron.core.tensor_parallel import random as mp_random

from setdiff_megatron.core.loss import loss_weights, set_diffusion_loss
from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.distributed import megatron_cpu
from setdiff_megatron.models.config import DIT_BODY
from setdiff_megatron.models.lora import TARGETS, LoraSpec, adapt_torch_model, adapter_state
from setdiff_megatron.models.megatron_forward import build_model_chunks, loss_func, transformer_config_from
from setdiff_megatron.models.megatron_model import adapt_megatron_model
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.models.weight_maps.megatron_map import megatron_to_torch, torch_to_megatron
from tests.conftest import debug_config, randomized
from tests.models.megatron_cases import (
    batches,
    compare_sampling,
    dit_parallel_config,
    moe_config,
    parallel_config,
    reference_weights,
)

warnings.filterwarnings("ignore")


class _AllocatesInBackward(torch.autograd.Function):
    """Backward allocates on "cuda", as megatron's recomputed forward does during backward."""

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * torch.full((1,), 2.0, device="cuda")


def device_redirect() -> dict:
    x = torch.ones(3)
    y = torch.zeros(2, device=torch.cuda.current_device(), pin_memory=True)
    torch.cuda.synchronize()
    return {
        "factory_device": str(torch.zeros(2, device="cuda").device),
        "ordinal_device": str(torch.tensor([1.0], device=0).device),
        "current_device_alloc": str(y.device),
        "cuda_is_identity": x.cuda() is x and x.pin_memory() is x,
        "to_cuda": str(x.to("cuda:0").device),
        "to_cuda_dtype": str(x.to("cuda", torch.float64).dtype),
        "type_fp32": x.type(),
        "type_bf16": x.bfloat16().type(),
        "type_convert": str(x.type("torch.cuda.HalfTensor").dtype),
        "backend": megatron_cpu.dist_backend(),
    }


def backward_reentry() -> dict:
    x = torch.ones(2, requires_grad=True)
    _AllocatesInBackward.apply(x).sum().backward()
    (g,) = torch.autograd.grad(_AllocatesInBackward.apply(x).sum(), x)
    return {"backward": x.grad.tolist(), "autograd_grad": g.tolist()}


def rng_tracker(seed: int = 7) -> dict:

    megatron_cpu.model_parallel_seed(seed)
    tracker = get_cuda_rng_tracker()
    default_expected = torch.Generator().manual_seed(seed)
    tp_expected = torch.Generator().manual_seed(seed + 2718)
    before = torch.rand(3)
    with tracker.fork():
        in_fork = torch.rand(3)
    after = torch.rand(3)
    with tracker.fork():
        in_second_fork = torch.rand(3)
    default_ref = torch.rand(6, generator=default_expected)
    tp_ref = torch.rand(6, generator=tp_expected)
    return {
        "tracker_class": type(tracker).__name__,
        "names": sorted(tracker.get_states()),
        "default_stream_untouched": torch.equal(torch.cat([before, after]), default_ref),
        "fork_uses_tp_seed": torch.equal(torch.cat([in_fork, in_second_fork]), tp_ref),
        "cuda_state_is_cpu_state": torch.equal(mp_random._get_cuda_rng_state(), torch.get_rng_state()),
    }


def _megatron_model(cfg, dtype=torch.float32, **config_changes):
    (model,) = build_model_chunks(cfg, transformer_config_from(cfg, params_dtype=dtype, **config_changes))
    return model


def recompute_with_dropout() -> dict:
    """Full and selective recompute replay dropout exactly: the RNG shims restore CPU states."""
    cfg = debug_config()
    weights, (batch,) = reference_weights(cfg), batches(cfg, count=1)
    variants = {
        "none": dict(hidden_dropout=0.2),
        "selective": dict(hidden_dropout=0.2, recompute="selective"),
        "full": dict(hidden_dropout=0.2, recompute="full"),
        "no_dropout": {},
    }
    runs = {}
    for name, changes in variants.items():
        megatron_cpu.model_parallel_seed(5)
        model = _megatron_model(cfg, **changes)
        model.load_state_dict(torch_to_megatron(weights, cfg))
        nll = model(
            batch.clean_tokens, batch.query_tokens, batch.position_ids, valid_len=batch.valid_len, targets=batch.targets
        )
        nll_sum, num_tokens, _ = loss_func(loss_weights(batch.loss_mask, "per_token"), nll)
        (nll_sum / num_tokens).backward()
        runs[name] = (nll_sum.item() / num_tokens.item(), {n: p.grad for n, p in model.named_parameters()})
    ref_loss, ref_grads = runs.pop("none")
    return {
        name: {
            "loss_diff": abs(loss - ref_loss),
            "grad_diff": max((g - ref_grads[k]).abs().max().item() for k, g in grads.items()),
        }
        for name, (loss, grads) in runs.items()
    }


def _with_documents(batch: TwoStreamBatch) -> TwoStreamBatch:
    """The batch with three documents per window (positions 0-4, 5-10, 11-15), ids in rank order."""
    positions = torch.arange(batch.position_ids.shape[1])
    doc_of_position = ((positions >= 5).long() + (positions >= 11).long()).expand_as(batch.position_ids)
    return replace(batch, document_ids=doc_of_position.gather(1, batch.position_ids))


def torch_parity() -> dict:
    """Query logits, loss and gradients of both bodies on the same weights, batch and order.

    Gradients are taken as the engine takes them: megatron back-propagates the NLL sum (its router
    losses attached per routed token) and the gradients are divided by the target tokens after.
    The document variants carry document ids, one of them through full recompute (which saves
    megatron's attention-mask slot with save_for_backward).
    """
    moe = dict(num_experts=4, moe_intermediate_size=48, moe_layer_freq=[1, 1])
    variants = {
        "tied_fused": {},
        "untied_qknorm_sdpa": dict(tie_embeddings=False, qk_norm=True, attention_impl="sdpa"),
        "gqa1_dense": dict(num_kv_heads=1, attention_impl="dense"),
        "moe_shared_zloss": moe | dict(num_shared_experts=1, moe_z_loss_coeff=1e-3),
        "moe_capacity": moe | dict(moe_capacity_factor=1.0, moe_layer_freq=[0, 1]),
        "moe_top1_pre_softmax": moe | dict(moe_top_k=1, moe_router_pre_softmax=True),
        "documents_fused": {},
        "documents_gqa1_sdpa_recompute": dict(num_kv_heads=1, attention_impl="sdpa"),
        "dit_fused": DIT_BODY | dict(num_kv_heads=None),
        "dit_adaln_sdpa_recompute": DIT_BODY | dict(attention_impl="sdpa", adaln=True, adaln_cond_dim=16),
        "bd3lm_tied": {},
        "mdlm_gqa1_recompute": dict(num_kv_heads=1),
        "bd3lm_records_recompute": {},
        "replay_steps_recompute": {},
    }
    recompute = {
        "documents_gqa1_sdpa_recompute": dict(recompute="full"),
        "dit_adaln_sdpa_recompute": dict(recompute="full"),
        "mdlm_gqa1_recompute": dict(recompute="full"),
        "bd3lm_records_recompute": dict(recompute="full"),
        "replay_steps_recompute": dict(recompute="full"),
    }
    out = {}
    for dtype in (torch.float32, torch.float64):
        for name, changes in variants.items():
            cfg = debug_config(**changes)
            torch.manual_seed(0)
            ref = SetDiffusionTransformer(cfg)
            ref.load_state_dict(randomized(ref.state_dict()))
            ref = ref.to(dtype)
            model = _megatron_model(cfg, dtype, **recompute.get(name, {}))
            model.load_state_dict(torch_to_megatron(ref.state_dict(), cfg))
            family = name.split("_")[0] if name.startswith(("bd3lm", "mdlm")) else "set_diffusion"
            batch = batches(cfg, count=1, family=family, records="records" in name)[0]
            if name.startswith("documents"):
                batch = _with_documents(batch)
            if name.startswith("replay"):  # a decoded trajectory's steps of 3 ranks (sampling/trajectory.py)
                steps = torch.arange(batch.position_ids.shape[1]).expand_as(batch.position_ids) // 3
                batch = replace(batch, groups=steps, group_within="rank")
            args = (batch.clean_tokens, batch.query_tokens, batch.position_ids)
            ref_logits = ref(*args, batch.valid_len, batch.document_ids, batch.groups, batch.group_within)
            ref_out = set_diffusion_loss(ref_logits, batch.targets, batch.loss_mask, mask_token_id=cfg.mask_token_id)
            ref_loss = ref_out.nll_sum.sum() / ref_out.num_tokens.sum()
            ref_out.with_router_loss(ref.router_loss()).loss.backward()
            kwargs = dict(
                valid_len=batch.valid_len,
                document_ids=batch.document_ids,
                groups=batch.groups,
                group_within=batch.group_within,
            )
            logits = model(*args, **kwargs)
            nll_sum, num_tokens, _ = loss_func(
                loss_weights(batch.loss_mask, "per_token"), model(*args, targets=batch.targets, **kwargs)
            )
            loss = nll_sum / num_tokens
            nll_sum.backward()
            grads = megatron_to_torch({n: p.grad / num_tokens for n, p in model.named_parameters()}, cfg)
            # An expert no token reached has no gradient in the torch body, zeros in megatron's.
            ref_grads = {n: torch.zeros_like(p) if p.grad is None else p.grad for n, p in ref.named_parameters()}
            out[f"{name}_{str(dtype).removeprefix('torch.')}"] = {
                "logits_shape": list(logits.shape),
                "ref_shape": list(ref_logits.shape),
                "logits_diff": (logits - ref_logits).abs().max().item(),
                "loss_diff": abs(loss.item() - ref_loss.item()),
                "grad_diff": max((grads[k] - g).abs().max().item() for k, g in ref_grads.items()),
            }
    return out


def lora() -> dict:
    """LoRA adapters on both bodies (models/lora.py), drawn from one seed, B made non-zero alike:
    the same adapter tensors under the same names (less megatron's `decoder.` prefix), the same
    logits, and the same adapter gradients; no base weight takes a gradient."""
    spec = LoraSpec(rank=4, alpha=8.0, targets=TARGETS)
    out = {}
    for name, cfg in {"gqa": debug_config(num_kv_heads=2), "dit": debug_config(**DIT_BODY, num_kv_heads=None)}.items():
        ref = SetDiffusionTransformer(cfg)
        ref.load_state_dict(randomized(ref.state_dict()))
        model = _megatron_model(cfg)
        model.load_state_dict(torch_to_megatron(ref.state_dict(), cfg))
        adapt_torch_model(ref, spec, seed=11)
        adapt_megatron_model(model, spec, seed=11)
        drawn = adapter_state(ref)
        gen = torch.Generator().manual_seed(1)
        b = {k: 0.1 * torch.randn(v.shape, generator=gen) for k, v in drawn.items() if k.endswith(".B")}
        ref.load_state_dict(b, strict=False)
        model.load_state_dict({"decoder." + k: v for k, v in b.items()}, strict=False)
        (batch,) = batches(cfg, count=1)
        args = (batch.clean_tokens, batch.query_tokens, batch.position_ids)
        ref_logits = ref(*args, batch.valid_len)
        logits = model(*args, valid_len=batch.valid_len)
        ref_logits.square().mean().backward()
        logits.square().mean().backward()
        grads = {n.removeprefix("decoder."): p.grad for n, p in model.named_parameters() if p.grad is not None}
        ref_grads = {n: p.grad for n, p in ref.named_parameters() if p.grad is not None}
        out[name] = {
            "same_adapters": all(
                torch.equal(v, adapter_state(model)["decoder." + k]) for k, v in drawn.items() if k.endswith(".A")
            ),
            "logits_diff": (logits - ref_logits).abs().max().item(),
            "grads": sorted(grads) == sorted(ref_grads) == sorted(drawn),
            "grad_diff": max((grads[k] - g).abs().max().item() for k, g in ref_grads.items()),
        }
    return out


def sampling(cfg=None) -> dict:
    """The megatron model as the sampler's StepModel (TP=1) against the torch model."""
    cfg = cfg or parallel_config()
    reference = SetDiffusionTransformer(cfg)
    reference.load_state_dict(reference_weights(cfg))
    model = _megatron_model(cfg, torch.float32)
    model.load_state_dict(torch_to_megatron(reference.state_dict(), cfg))
    return compare_sampling(model.eval(), reference.eval(), cfg)


def main(out: Path) -> None:
    megatron_cpu.enable_cpu_mode()
    megatron_cpu.enable_cpu_mode()  # idempotent
    store = dist.FileStore(str(out.with_suffix(".store")), 1)  # no port to pick for one rank
    dist.init_process_group(megatron_cpu.dist_backend(), store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    results = {"auto_cpu_mode": megatron_cpu.auto_cpu_mode()}
    for check in (device_redirect, backward_reentry, rng_tracker, recompute_with_dropout, torch_parity, sampling, lora):
        results[check.__name__] = check()
    results["moe_sampling"] = sampling(moe_config())
    results["dit_sampling"] = sampling(dit_parallel_config())
    out.write_text(json.dumps(results, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
