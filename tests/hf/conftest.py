"""Fixtures of the Hugging Face tests: tiny AR models, a tiny set diffusion export, a clean Python,
and (slow tests) a tiny-cpu run at TP=2. Nothing is downloaded."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from setdiff_megatron.core.loss import token_nll
from setdiff_megatron.data.tokenizers import load_tokenizer
from setdiff_megatron.hf.export import write_export
from setdiff_megatron.models.config import DIT_BODY, ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.sources.read import Source
from tests.cli_runs import setdiff
from tests.conftest import randomized
from tests.hf.tiny_models import make_ar_model, make_tokenizer

ROOT = Path(__file__).parents[2]
TINY_RECIPE = ROOT / "recipes" / "tiny-cpu.yaml"


def rank_nll(model: SetDiffusionTransformer, batch: list, perm: list, mask: int) -> torch.Tensor:
    """Per-rank NLL under a given order, as the reference's eval forward scores it: the clean
    stream x[perm], all-MASK queries, rotary ids perm."""
    perm = torch.tensor(perm)
    clean = torch.tensor(batch).gather(1, perm)
    with torch.no_grad():
        return token_nll(model(clean, torch.full_like(clean, mask), perm), clean, mask).double()


def greedy_trace(model: SetDiffusionTransformer, decode: dict, mask: int):
    """(row, its steps as the reference fixtures record them) of the set sampler's greedy decode
    of a fixture's prompt at its window and threshold."""
    cfg = DecodingConfig(
        window=decode["window"], threshold=decode["threshold"], max_new_tokens=decode["max_new_tokens"]
    )
    (row,) = SetSampler(model, mask_token_id=mask, context_len=32).generate([decode["prompt"]], cfg, trace=True).rows
    return row, [{"queried": s.queried, "decoded": [list(d) for d in s.decoded]} for s in row.trace]


def convert_from_hf(hf_dir: Path, out: Path, *args: str) -> subprocess.CompletedProcess:
    """`setdiff convert from-hf` in a process of its own, as a user runs it: the import joins a
    process group and switches megatron's CPU mode on for the rest of its process's life, which
    the test process must not inherit."""
    return setdiff("convert", "from-hf", hf_dir, out, *args, timeout=600, check=False)


@pytest.fixture(scope="session")
def ar_dirs(tmp_path_factory) -> dict[str, Path]:
    """Tiny random Llama (untied), Qwen2 (q/k/v biases, padded vocabulary), Qwen3 (q/k norm,
    tied, head_dim != hidden/heads, padded vocabulary) and Qwen3-MoE (4 experts, top-2, a dense
    middle layer) directories."""
    base = tmp_path_factory.mktemp("ar")
    return {
        "llama": make_ar_model("llama", base / "llama"),
        "qwen2": make_ar_model("qwen2", base / "qwen2", extra_rows=7, seed=1),
        "qwen3": make_ar_model("qwen3", base / "qwen3", tie=True, extra_rows=7, seed=2),
        "qwen3_moe": make_ar_model("qwen3_moe", base / "qwen3_moe", seed=3, num_hidden_layers=3, mlp_only_layers=[1]),
    }


MOE = dict(
    num_experts=4,
    moe_top_k=2,
    moe_intermediate_size=32,
    num_shared_experts=1,
    moe_layer_freq=[0, 1],
    moe_router_pre_softmax=True,
    moe_aux_loss_coeff=0.02,
    moe_z_loss_coeff=1e-3,
)
"""The mixture of experts of `moe_export_dir`: every MoE field away from its default."""


def random_setdiff_source(directory: Path, *, tie: bool = True, seed: int = 0, **fields) -> Source:
    """A random set diffusion model with a real tokenizer, as an export source; `fields`: more
    ModelConfig fields."""
    make_tokenizer(directory / "tok", "qwen")
    tokenizer = load_tokenizer(directory / "tok")
    cfg = ModelConfig(
        vocab_size=tokenizer.vocab_size,
        mask_token_id=tokenizer.mask_id,
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=96,
        max_seq_len=64,
        qk_norm=True,
        tie_embeddings=tie,
        **fields,
    )
    torch.manual_seed(seed)
    model = SetDiffusionTransformer(cfg)
    return Source("megatron", directory / "source", cfg, model.state_dict(), tokenizer)


def _export(base: Path, source: Source) -> tuple[Path, Source]:
    out = base / "hf"
    out.mkdir()
    write_export(source, out, torch.float32, max_shard_bytes=60_000)
    return out, source


@pytest.fixture(scope="session")
def export_dir(tmp_path_factory) -> tuple[Path, Source]:
    """A set diffusion export (fp32, untied, several shards) and its source."""
    base = tmp_path_factory.mktemp("export")
    return _export(base, random_setdiff_source(base, tie=False))


@pytest.fixture(scope="session")
def moe_export_dir(tmp_path_factory) -> tuple[Path, Source]:
    """An export of a mixture of experts (MOE; tied, fp32) and its source."""
    base = tmp_path_factory.mktemp("moe_export")
    return _export(base, random_setdiff_source(base, seed=1, **MOE))


@pytest.fixture(scope="session")
def dit_export_dir(tmp_path_factory) -> tuple[Path, Source]:
    """An export in the reference DiT's layout (LayerNorm, GELU MLP with biases, untied output
    layer with a bias) with its LM1B models' adaLN (norms, biases and modulations random; fp32),
    and its source."""
    base = tmp_path_factory.mktemp("dit_export")
    body = {k: v for k, v in DIT_BODY.items() if k != "tie_embeddings"}
    source = random_setdiff_source(base, tie=False, seed=2, adaln=True, adaln_cond_dim=16, **body)
    source.state_dict = randomized(source.state_dict)
    return _export(base, source)


@pytest.fixture(scope="session")
def trained_tp2(tmp_path_factory) -> Path:
    """A short tiny-cpu run at TP=2 (two gloo processes): a real megatron checkpoint."""
    run = tmp_path_factory.mktemp("tiny_tp2") / "run"
    setdiff(
        "train",
        TINY_RECIPE,
        f"checkpoint.dir={run}",
        "log.tensorboard=false",
        "parallel.tp=2",
        "parallel.global_batch_size=8",
        "parallel.micro_batch_size=4",
        "train.steps=6",
        "train.warmup_steps=2",
        "eval.interval=1000",
        "eval.batches=1",
        "checkpoint.interval=1000",
        "log.interval=1",
    )
    return run
