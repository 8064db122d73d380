"""Shared fixtures of the megatron tests and their worker processes: one config, one set of batches.

Workers are separate processes (megatron's CPU mode patches torch for the life of a process, and
parallel layouts need several ranks), so they rebuild these from fixed seeds rather than receive
them; every rank builds the same weights and batches.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from setdiff_megatron.core.masked_diffusion import masked_two_stream_batch, sample_masked_batch
from setdiff_megatron.core.orders import Staggered
from setdiff_megatron.core.streams import TwoStreamBatch, sample_two_stream_batch
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from tests.cli_runs import torchrun
from tests.conftest import debug_config, dit_config, randomized

ROOT = Path(__file__).parents[2]
LENGTH = 16
MICRO_BATCH = 2
NUM_MICROBATCHES = 4


def parallel_config(**changes) -> ModelConfig:
    """4 layers so that PP=2 with 2 virtual stages has a layer per chunk; q/k norm and GQA on."""
    return debug_config(num_layers=4, qk_norm=True, **changes)


def moe_config(**changes) -> ModelConfig:
    """parallel_config with 4 experts (top-2, a shared expert, z-loss) in layers 0, 2 and 3:
    a dense layer between MoE ones, and the last layer's query-rows-only MoE."""
    return parallel_config(
        num_experts=4,
        moe_top_k=2,
        moe_intermediate_size=48,
        num_shared_experts=1,
        moe_layer_freq=[1, 0, 1, 1],
        moe_z_loss_coeff=1e-3,
        **changes,
    )


def dit_parallel_config(**changes) -> ModelConfig:
    """parallel_config's shape in the reference DiT's layout (LayerNorm, GELU MLP with biases,
    output bias, multi-head attention) with its LM1B models' adaLN."""
    return dit_config(num_layers=4, adaln=True, adaln_cond_dim=16, **changes)


def reference_weights(cfg: ModelConfig, seed: int = 0) -> dict[str, torch.Tensor]:
    """A random model's weights, its norm weights and biases random too (`randomized`)."""
    torch.manual_seed(seed)
    return randomized(SetDiffusionTransformer(cfg).state_dict(), seed)


EOD = 0
"""The end-of-document token of `batches(documents=True)`."""


RECORDS = ((7, 2), (6, 3))
"""(length, prompt length) of the two supervised records the first row of `batches(records=True)`
packs; the second row holds one record of 12 tokens with a prompt of 4."""


def _record_rows() -> dict[str, torch.Tensor]:
    docs, pos = torch.zeros(MICRO_BATCH, LENGTH, dtype=torch.long), torch.zeros(MICRO_BATCH, LENGTH, dtype=torch.long)
    prompt, pad = torch.zeros(MICRO_BATCH, LENGTH, dtype=torch.bool), torch.ones(MICRO_BATCH, LENGTH, dtype=torch.bool)
    for row, records in enumerate((RECORDS, ((12, 4),))):
        offset = 0
        for doc, (n, p) in enumerate(records):
            docs[row, offset : offset + n], pos[row, offset : offset + n] = doc, torch.arange(n)
            pad[row, offset : offset + n], prompt[row, offset : offset + p] = False, True
            offset += n
    return {"records": (docs, pos), "prompt_mask": prompt, "pad_mask": pad}


def batches(
    cfg: ModelConfig,
    count: int = NUM_MICROBATCHES,
    seed: int = 0,
    *,
    documents: bool = False,
    records: bool = False,
    family: str = "set_diffusion",
) -> list[TwoStreamBatch]:
    """Micro-batches in sampled orders; the second row of each is padded at its last 4 ranks.
    With `documents` each window packs three documents (EOD at positions 4 and 9) and the
    batches carry their ids; with `records` the rows are supervised records (prompts pinned,
    padding last), two packed in the first row, each ordered and positioned as if alone. A
    `family` 'mdlm' or 'bd3lm' (blocks of 4) gives that baseline's batches instead: noised rows
    with a prompt of 3 and the same padding, or with `records` those supervised records."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    if family != "set_diffusion":
        block = 4 if family == "bd3lm" else None
        for _ in range(count):
            tokens = torch.randint(0, cfg.mask_token_id, (MICRO_BATCH, LENGTH), generator=gen)
            if records:
                rows = _record_rows()
            else:
                prompt, pad = torch.zeros_like(tokens, dtype=torch.bool), torch.zeros_like(tokens, dtype=torch.bool)
                prompt[:, :3], pad[1, -4:] = True, True
                rows = {"prompt_mask": prompt, "pad_mask": pad}
            batch = sample_masked_batch(
                tokens, mask_token_id=cfg.mask_token_id, block_size=block, generator=gen, **rows
            )
            out.append(masked_two_stream_batch(batch, block))
        return out
    if records:
        for _ in range(count):
            tokens = torch.randint(0, cfg.mask_token_id, (MICRO_BATCH, LENGTH), generator=gen)
            out.append(
                sample_two_stream_batch(
                    tokens, Staggered(d=4), mask_token_id=cfg.mask_token_id, generator=gen, **_record_rows()
                )
            )
        return out
    for _ in range(count):
        tokens = torch.randint(int(documents), cfg.mask_token_id, (MICRO_BATCH, LENGTH), generator=gen)
        if documents:
            tokens[:, [4, 9]] = EOD
        pad = torch.zeros_like(tokens, dtype=torch.bool)
        pad[1, -4:] = True
        out.append(
            sample_two_stream_batch(
                tokens,
                Staggered(d=4),
                mask_token_id=cfg.mask_token_id,
                pad_mask=pad,
                generator=gen,
                eod_id=EOD if documents else None,
            )
        )
    return out


def run_worker(module: str, out: Path, *args: str, nproc: int = 1, timeout: float = 240) -> dict:
    """Run `python -m module out ARGS` (under torchrun when nproc > 1) and return the JSON it wrote."""
    launcher = torchrun(nproc) if nproc > 1 else [sys.executable]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    proc = subprocess.run(
        [*launcher, "-m", module, str(out), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )
    if proc.returncode != 0 or not out.exists():
        raise AssertionError(f"{module} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}")
    return json.loads(out.read_text())


def write_worker_results(out: Path, results: dict) -> None:
    """The worker's side of run_worker: rank 0 writes the JSON, then every rank closes the group."""
    if dist.get_rank() == 0:
        out.write_text(json.dumps(results, indent=1))
    dist.barrier()
    dist.destroy_process_group()


def sampling_prompts(cfg: ModelConfig) -> list[list[int]]:
    """Prompts of mixed lengths; the last one has a span to infill between visible tokens."""
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, cfg.mask_token_id, (n,), generator=gen).tolist() for n in (3, 7, 1)]
    return prompts + [prompts[1][:4] + [cfg.mask_token_id] * 3 + prompts[1][4:]]


def compare_sampling(model, reference: SetDiffusionTransformer, cfg: ModelConfig) -> dict:
    """A model body against the torch model through the sampler: one prefill + step's query
    logits, and greedy decodes of `sampling_prompts` (window 4, threshold 0.2, 6 new tokens)."""
    from setdiff_megatron.sampling.decoding import DecodingConfig
    from setdiff_megatron.sampling.sampler import SetSampler

    gen = torch.Generator().manual_seed(4)
    tokens = torch.randint(0, cfg.mask_token_id, (2, 6), generator=gen)
    positions = torch.arange(6).expand(2, 6)
    query = torch.full((2, 3), cfg.mask_token_id)
    logits = []
    with torch.inference_mode():
        for body in (model, reference):
            cache = body.new_cache(2, 16)
            body.step(tokens, positions, cache, num_commit=6)
            logits.append(body.step(query, torch.tensor([[6, 8, 9], [7, 10, 11]]), cache, num_commit=0))
    decoding = DecodingConfig(window=4, threshold=0.2, max_new_tokens=6)
    outputs = [
        SetSampler(body, mask_token_id=cfg.mask_token_id, context_len=cfg.max_seq_len)
        .generate(sampling_prompts(cfg), decoding, batch_size=2)
        .rows
        for body in (model, reference)
    ]
    return {
        "step_logits_diff": (logits[0] - logits[1]).abs().max().item(),
        "tokens_equal": [a.tokens == b.tokens for a, b in zip(*outputs)],
        "nfe_equal": [a.nfe == b.nfe for a, b in zip(*outputs)],
    }
