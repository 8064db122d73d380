"""`setdiff convert from-hf`: a Hugging Face model or the reference's DiT as a megatron checkpoint.

Sources: a Llama/Qwen2/Qwen3/Qwen3-MoE causal LM (to adapt into set diffusion), a set diffusion
export, or the reference's DiT (its Hub directory or a composer .pt; docs/dit.md). The result is a
run directory (`model.init_from: OUT`, `checkpoint.resume: OUT/checkpoints/...`) that loads at any
layout, written by hf/megatron_writer.py into a staging directory, read back with read_source and
compared with the source before it is renamed into place (docs/huggingface.md, "Hugging Face").
"""

from __future__ import annotations

from pathlib import Path

import torch

from setdiff_megatron.errors import UserError, require
from setdiff_megatron.hf import verify
from setdiff_megatron.hf.export import ConversionReport, target_dtype
from setdiff_megatron.hf.megatron_writer import write_megatron_checkpoint
from setdiff_megatron.hf.weights_io import staged_directory
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sources.hf_files import safetensors_dtype
from setdiff_megatron.sources.read import AR_KINDS, Source, read_hf_dir, read_source

__all__ = ["ar_comparison", "import_from_hf"]


def import_from_hf(
    hf_dir: str | Path,
    out: str | Path,
    *,
    dtype: str = "auto",
    overwrite: bool = False,
    check: bool = False,
    tolerance: float | None = None,
    base: str | Path | None = None,
) -> ConversionReport:
    """Convert, compare logits, and (with `check`) refuse a mismatch, leaving nothing at `out`;
    `base`: a Qwen3 SetDLM release's base model (sources/setdlm_release.py)."""
    hf_dir, out = Path(hf_dir), Path(out).absolute()
    if out.exists() and not overwrite:
        raise UserError(f"{out} already exists; pass --overwrite to replace it")
    if hf_dir.is_file() and hf_dir.suffix == ".pt":
        source = read_source(hf_dir)  # a composer checkpoint of the reference's DiT
    elif hf_dir.is_dir():
        source = read_hf_dir(hf_dir, base=base)
    else:
        raise UserError(f"{hf_dir} is neither a directory nor a composer .pt checkpoint")
    target = target_dtype(source, dtype)
    tolerance = tolerance or verify.DEFAULT_TOLERANCE
    with staged_directory(out, overwrite=overwrite) as stage:
        megatron_logits = write_megatron_checkpoint(source, stage, out, dtype=target)
        comparisons = _verify_import(source, stage, target, megatron_logits, tolerance)
        report = ConversionReport(out, comparisons)
        rows = source.config.vocab_size
        report.lines = [
            f"imported {source.describe()} into {out} (megatron, any layout, "
            f"{str(target).removeprefix('torch.')}); vocabulary {rows}, MASK "
            f"{source.tokenizer.special_tokens['mask']!r} id {source.tokenizer.mask_id}"
        ]
        if source.recipe is not None:
            m = source.recipe.method
            if m.family == "set_diffusion":
                method = f"staggered order d = {m.d}, m = {m.m}"
            else:
                method = m.family + (f" in blocks of {m.block_size}" if m.block_size else "")
            report.lines.append(
                f"evaluation settings recorded in its recipe: L = {source.recipe.data.seq_len}, "
                f"{method}, clean BOS {m.keep_clean_bos}"
            )
        report.lines += source.notes + [c.line() for c in comparisons]
        if check and not report.ok:
            worst = max(comparisons, key=lambda c: c.max_diff)
            raise UserError(
                f"--check: {worst.what} differs by {worst.max_diff:.3e} > {worst.tolerance:.1e}; "
                f"nothing written to {out}"
            )
    return report


def _verify_import(
    source: Source, stage: Path, dtype: torch.dtype, megatron_logits: torch.Tensor, tolerance: float
) -> list[verify.Comparison]:
    """The converted torch model against the source (an AR source: `ar_comparison`; otherwise the
    source's query logits), and the megatron model's query logits against the converted model's."""
    written = read_source(stage)
    if written.config != source.config:
        raise RuntimeError(f"the written checkpoint records {written.config}, the source is {source.config}")
    converted = verify.torch_model(written.config, written.state_dict)
    batch = verify.fixed_batch(written.config)
    if source.kind in AR_KINDS:
        source_check = ar_comparison(source, converted, dtype, tolerance)
    else:
        expected = verify.query_logits(verify.torch_model(source.config, source.state_dict, round_to=dtype), batch)
        source_check = verify.compare(
            "converted vs source query logits", verify.query_logits(converted, batch), expected, tolerance
        )
    megatron_check = verify.compare(
        "megatron model vs converted torch model (query logits)",
        megatron_logits,
        verify.query_logits(converted, batch),
        tolerance,
    )
    return [source_check, megatron_check]


def ar_comparison(
    source: Source, converted: SetDiffusionTransformer, dtype: torch.dtype, tolerance: float
) -> verify.Comparison:
    """The import check of an AR source: the converted model's clean stream under the left-to-right
    order against the source's own logits (transformers' AutoModelForCausalLM, float32), its
    weights rounded to `dtype` when the import changes precision."""
    transformers = require("transformers", "hf", "Checking an imported Hugging Face model")
    with verify.quiet_transformers(transformers):
        reference = transformers.AutoModelForCausalLM.from_pretrained(str(source.path), dtype=torch.float32)
    rows = reference.get_input_embeddings().weight.shape[0]
    tokens = verify.fixed_tokens(converted.config, max_token=min(rows, source.tokenizer.vocab_size))
    with torch.no_grad():
        expected = reference(tokens).logits.float()
    if dtype != safetensors_dtype(source.state_dict):
        expected = _rounded_ar_logits(reference, dtype, tokens)
    _, logits = verify.clean_stream(converted, tokens)
    return verify.compare(
        f"clean stream (left to right) vs {source.kind} source logits", logits[..., :rows], expected, tolerance
    )


@torch.no_grad()
def _rounded_ar_logits(reference, dtype: torch.dtype, tokens: torch.Tensor) -> torch.Tensor:
    """The AR source's logits with its weights rounded to the import precision (run in float32)."""
    for p in reference.parameters():
        p.copy_(p.to(dtype).float())
    return reference(tokens).logits.float()
