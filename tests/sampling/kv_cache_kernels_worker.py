"""One-rank megatron worker for test_kv_cache_kernels.py: the megatron body (TP=1, fp32) whose
KV cache runs the emulated 'te' / 'flash_attn' kernel step, against the torch model's masked
SDPA cache, through tests/models/megatron_cases.py's `compare_sampling`. A separate process because
megatron's CPU mode patches torch for the life of the process."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from setdiff_megatron.core import step_attention
from setdiff_megatron.distributed import megatron_cpu
from setdiff_megatron.kernels import flash_attn, te_fused
from setdiff_megatron.models.megatron_forward import (
    build_model_chunks,
    transformer_config_from,
)
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.models.weight_maps.megatron_map import torch_to_megatron
from tests.models.megatron_cases import compare_sampling, parallel_config, reference_weights
from tests.sampling.test_kv_cache_kernels import KERNELS, emulated_step

warnings.filterwarnings("ignore")
CALLS: list[str] = []


def emulate_kernels() -> None:
    """'te' and 'flash_attn' usable here, their steps on the emulated kernels (calls noted)."""
    te_fused.te_status = lambda: (True, "emulation")
    flash_attn.flash_status = lambda: (True, "emulation")
    for name in KERNELS:
        step_attention.register_step_impl(name, emulated_step(name, CALLS))


def check(impl: str) -> dict:
    cfg = parallel_config()
    reference = SetDiffusionTransformer(cfg)  # attention_impl 'fused': the SDPA cache path
    reference.load_state_dict(reference_weights(cfg))
    kernel_cfg = cfg.replace(attention_impl=impl)
    (model,) = build_model_chunks(kernel_cfg, transformer_config_from(kernel_cfg, params_dtype=torch.float32))
    model.load_state_dict(torch_to_megatron(reference.state_dict(), kernel_cfg))
    CALLS.clear()
    result = compare_sampling(model.eval(), reference.eval(), cfg)
    return {
        **result,
        "cache_impl": model.new_cache(1, 4).attention_impl,
        "kernel_calls": CALLS.count(impl),
        "other_calls": len(CALLS) - CALLS.count(impl),
    }


def main(out: Path) -> None:
    megatron_cpu.enable_cpu_mode()
    store = dist.FileStore(str(out.with_suffix(".store")), 1)
    dist.init_process_group(megatron_cpu.dist_backend(), store=store, rank=0, world_size=1)
    parallel_state.initialize_model_parallel(1, 1)
    megatron_cpu.model_parallel_seed(0)
    emulate_kernels()
    out.write_text(json.dumps({impl: check(impl) for impl in ("te", "flash_attn")}, indent=1))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
