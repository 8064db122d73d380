"""`setdiff convert to-hf`: a trained checkpoint as a Hugging Face directory that loads with
`AutoModel.from_pretrained(dir, trust_remote_code=True)` and needs only torch and transformers.

The directory holds config.json (model_type setdiff, auto_map), configuration_setdiff.py,
modeling_setdiff.py (generated from the package's own modules by hf/bundle.py), sharded
safetensors with model.safetensors.index.json, generation_config.json (the sampler's decoding
policy), the tokenizer with its MASK token, and a README.md model card with the recipe. It is
written to a staging directory, loaded back through transformers, compared with the source on a
fixed batch, and only then renamed into place.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import dataclass, field
from pathlib import Path

import torch

from setdiff_megatron.errors import UserError, require
from setdiff_megatron.hf import verify
from setdiff_megatron.hf.bundle import modeling_source
from setdiff_megatron.hf.weights_io import parse_size, save_sharded, staged_directory
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.dtypes import dtype_named
from setdiff_megatron.models.weight_maps.hf import torch_to_hf
from setdiff_megatron.recipes.decoding_settings import with_stops
from setdiff_megatron.sources.hf_config import generation_config_from_decoding, hf_config_from_model_config
from setdiff_megatron.sources.hf_files import safetensors_dtype
from setdiff_megatron.sources.read import AR_KINDS, Source, read_source
from setdiff_megatron.version import __version__

__all__ = ["ConversionReport", "export_to_hf", "write_export", "target_dtype"]

_GPU_ONLY_IMPLS = ("te", "flash_attn")
_AUTO_MAP = {
    "AutoConfig": "configuration_setdiff.SetDiffConfig",
    "AutoModel": "modeling_setdiff.SetDiffModel",
    "AutoModelForCausalLM": "modeling_setdiff.SetDiffModel",
}


@dataclass
class ConversionReport:
    out: Path
    comparisons: list[verify.Comparison]
    lines: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.comparisons)


def _hf_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def target_dtype(source: Source, dtype: str) -> torch.dtype:
    """The weights' dtype of a conversion: `auto` keeps the source's."""
    if dtype == "auto":
        return safetensors_dtype(source.state_dict)
    return dtype_named(dtype, allowed=("auto", "bf16", "fp32"))


def _portable_impl(cfg):
    """The attention_impl an export records: GPU-only kernels become 'auto' (or 'fused')."""
    if cfg.attention_impl not in _GPU_ONLY_IMPLS:
        return cfg
    try:
        return cfg.replace(attention_impl="auto")
    except ValueError:
        return cfg.replace(attention_impl="fused")


def write_export(source: Source, out: Path, dtype: torch.dtype, max_shard_bytes: int) -> None:
    """Every file of a Hugging Face export of `source` into the existing directory `out`."""
    transformers = require("transformers", "hf", "Exporting to Hugging Face format")
    cfg, tok = _portable_impl(source.config), source.tokenizer
    weights = {k: v.to(dtype) for k, v in torch_to_hf(source.state_dict, cfg).items()}
    shards = save_sharded(weights, out, max_shard_bytes)
    config = {
        "architectures": ["SetDiffModel"],
        "model_type": "setdiff",
        "auto_map": _AUTO_MAP,
        **hf_config_from_model_config(cfg),
        "hidden_act": "silu" if cfg.mlp == "swiglu" else "gelu_pytorch_tanh",
        **_family_keys(source),
        "bos_token_id": tok.bos_id,
        "eos_token_id": tok.eos_id,
        "pad_token_id": tok.pad_id,
        "dtype": _hf_name(dtype),
        "torch_dtype": _hf_name(dtype),
        "transformers_version": transformers.__version__,
        "setdiff_megatron_version": __version__,
    }
    _write_json(out / "config.json", config)
    generation = generation_config_from_decoding(  # the model's own policy: its generate() decodes with it
        with_stops(source.decoding, tok), mask_token_id=tok.mask_id, pad_token_id=tok.pad_id
    )
    _write_json(
        out / "generation_config.json",
        {**generation, "bos_token_id": tok.bos_id, "transformers_version": transformers.__version__},
    )
    shutil.copyfile(Path(__file__).with_name("configuration_setdiff.py"), out / "configuration_setdiff.py")
    (out / "modeling_setdiff.py").write_text(modeling_source(__version__))
    tok.save(out)
    (out / "README.md").write_text(_model_card(source, cfg, dtype, len(shards)))


def _family_keys(source: Source) -> dict:
    """config.json's record of the model family (its forward and sampler): nothing for set
    diffusion; for the paper's baselines `family`, BD3-LM's `block_size` and the trained
    `length`, the window their decoders run over."""
    if source.family == "set_diffusion":
        return {}
    block = {"block_size": source.block_size} if source.family == "bd3lm" else {}
    return {"family": source.family, **block, "length": source.trained_length}


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2) + "\n")


def _model_card(source: Source, cfg, dtype: torch.dtype, num_shards: int) -> str:
    from setdiff_megatron.recipes import dump_recipe

    recipe = dump_recipe(source.recipe) if source.recipe is not None else "(no recipe: converted from another format)\n"
    name = source.recipe.name if source.recipe is not None else source.path.name
    moe = _moe_line(cfg)
    return f"""---
library_name: transformers
pipeline_tag: text-generation
tags:
- set-diffusion
- setdiff-megatron
---

# {name}

A set diffusion language model (SetDLM): a transformer trained to predict token sets in any
order, decoded several tokens per forward pass by a cached any-order set sampler. Exported by
setdiff-megatron {__version__} from the {source.describe()}.

- {cfg.num_layers} layers, hidden {cfg.hidden_size}, {cfg.num_heads} heads ({cfg.num_kv_heads} key/value heads),
  head dim {cfg.head_dim}, MLP {cfg.intermediate_size}, vocabulary {cfg.vocab_size}, MASK id {cfg.mask_token_id},
  trained length {cfg.max_seq_len}, rope theta {cfg.rope_theta:g}, q/k norm {cfg.qk_norm}, q/k/v bias {cfg.qkv_bias},
  {cfg.norm}, {cfg.mlp} MLP (bias {cfg.mlp_bias}), tied embeddings {cfg.tie_embeddings}, output bias {cfg.output_bias};
  {_hf_name(dtype)} weights in {num_shards} safetensors shard(s).{moe}

## Use

Needs torch and transformers only (the model code ships in `modeling_setdiff.py`).

```python
from transformers import AutoModel, AutoTokenizer

tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=True)
model = AutoModel.from_pretrained(path, trust_remote_code=True)
ids = tokenizer("def fibonacci(n):", return_tensors="pt").input_ids
out = model.generate(ids, max_new_tokens=64, window=16, threshold=0.9)   # prompt + completion
print(tokenizer.decode(out[0]))
```

`generate` runs the set sampler: each step scores the MASK queries of a window of `window`
positions and decodes the most confident one plus every one above `threshold` (or
`tokens_per_step` of them); `do_sample`/`temperature`, `top_k`, `top_p`, `repetition_penalty`,
`eos_token_id` and `stop_token_sequences` work as usual; defaults are in generation_config.json.
MASK tokens inside a prompt are infilled. `model(input_ids, position_ids, query_ids)` returns the
query-stream logits of two streams laid out in a generation order (see modeling_setdiff.py).

## Training recipe

```yaml
{recipe.rstrip()}
```
"""


def _moe_line(cfg: ModelConfig) -> str:
    """The model card's line on the mixture of experts (none for a dense model)."""
    if not cfg.num_experts:
        return ""
    layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
    routing = "softmax before the top-k" if cfg.moe_router_pre_softmax else "softmax over the chosen k"
    return (
        f"\n- Mixture of experts in layers {layers}: {cfg.num_experts} experts of width "
        f"{cfg.moe_intermediate_size}, top-{cfg.moe_top_k} ({routing}), {cfg.num_shared_experts} shared expert(s)."
    )


def export_to_hf(
    checkpoint: str | Path,
    out_dir: str | Path,
    *,
    dtype: str = "auto",
    shard_size: str = "5GB",
    overwrite: bool = False,
    check: bool = False,
    tolerance: float | None = None,
) -> ConversionReport:
    """Convert a megatron (or DeepSpeed) checkpoint or an export of ours; compare logits; with
    `check`, a mismatch is a UserError and nothing is left at out_dir."""
    max_shard_bytes = parse_size(shard_size)
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite:
        raise UserError(f"{out_dir} already exists; pass --overwrite to replace it")
    source = read_source(checkpoint)
    if source.kind in AR_KINDS:
        raise UserError(
            f"{checkpoint} is already a Hugging Face {source.kind} model; to adapt it, import it with "
            "`setdiff convert from-hf`"
        )
    target = target_dtype(source, dtype)
    with staged_directory(out_dir, overwrite=overwrite) as stage:
        write_export(source, stage, target, max_shard_bytes)
        report = ConversionReport(out_dir, _verify_export(source, stage, target, tolerance or verify.DEFAULT_TOLERANCE))
        report.lines = [f"exported {source.describe()} to {out_dir} ({_hf_name(target)})"]
        report.lines += [c.line() for c in report.comparisons]
        if check and not report.ok:
            worst = max(report.comparisons, key=lambda c: c.max_diff)
            raise UserError(
                f"--check: {worst.what} differs by {worst.max_diff:.3e} > {worst.tolerance:.1e}; "
                f"nothing written to {out_dir}"
            )
    return report


def _verify_export(source: Source, directory: Path, dtype: torch.dtype, tolerance: float) -> list[verify.Comparison]:
    """Logits of the exported directory, loaded through transformers' AutoModel, against the
    source model's, both computed as the model's family computes them."""
    transformers = require("transformers", "hf", "Checking a Hugging Face export")
    batch = verify.fixed_batch(source.config)
    family = (source.family, source.block_size)
    reference = verify.family_logits(
        verify.torch_model(source.config, source.state_dict, round_to=dtype), batch, *family
    )
    with verify.quiet_transformers(transformers):
        exported = transformers.AutoModel.from_pretrained(str(directory), trust_remote_code=True, dtype=torch.float32)
    with torch.no_grad():
        logits = exported(batch.clean_tokens, position_ids=batch.position_ids, query_ids=batch.query_tokens).logits
    out = [verify.compare("exported model (transformers AutoModel) vs source", logits, reference, tolerance)]
    if any(t.dtype != dtype for t in source.state_dict.values() if t.is_floating_point()):
        unrounded = verify.family_logits(verify.torch_model(source.config, source.state_dict), batch, *family)
        shift = verify.compare(f"rounding to {_hf_name(dtype)} (information)", reference, unrounded, float("inf"))
        out.append(shift)
    return out
