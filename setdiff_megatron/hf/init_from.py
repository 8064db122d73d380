"""`model.init_from`: start a megatron run from trained weights instead of a random init.

The source is anything hf/sources.py reads: a megatron checkpoint (any layout; e.g. one written
by `setdiff convert from-hf`), a Hugging Face Llama/Qwen2/Qwen3 directory (imported on the fly,
as `convert from-hf` does) or one of our exports. Every rank reads the source whole and loads
its own chunks, mapped by weight_maps.torch_to_megatron for its (tp, pp, vpp) position; the
engine then refreshes the optimizer's main params. Used only when no checkpoint is resumed.

The tokenizer must be the one the weights were trained with: data.tokenizer must resolve to the
same vocabulary and special tokens (compared by the tokenizer's sha256). Architecture fields
must match the recipe's model section; max_seq_len may differ (rotary positions carry no
weights), and so may vocab_size where only rows beyond the tokenizer's vocabulary differ: those
are dropped, or added with the mean embedding.
"""

from __future__ import annotations

from dataclasses import asdict

import torch

from setdiff_megatron.errors import UserError

__all__ = ["initialize_from", "fit_source"]

_FREE = ("vocab_size", "max_seq_len", "attention_impl", "init_std")


def fit_source(source, model_cfg, tokenizer, where: str = "model.init_from") -> dict[str, torch.Tensor]:
    """The source's torch weights fitted to `model_cfg`, or a UserError naming what differs."""
    if source.tokenizer.sha256 != tokenizer.sha256:
        theirs, ours = source.tokenizer, tokenizer
        raise UserError(
            f"{where} {source.path}: its tokenizer differs from data.tokenizer's (vocabulary {theirs.vocab_size} vs "
            f"{ours.vocab_size}, MASK id {theirs.mask_id} vs {ours.mask_id}); set data.tokenizer to the tokenizer "
            f"saved with it ({_tokenizer_hint(source)})")
    ours, theirs = asdict(model_cfg), asdict(source.config)
    diffs = [f"model.{k} is {ours[k]} in the recipe, {theirs[k]} there" for k in ours
             if k not in _FREE and ours[k] != theirs[k]]
    if diffs:
        raise UserError(f"{where} {source.path} is another model: {'; '.join(diffs)}")
    state = dict(source.state_dict)
    rows, want = source.config.vocab_size, model_cfg.vocab_size
    if rows != want:
        if min(rows, want) < tokenizer.vocab_size:
            raise UserError(f"{where} {source.path} has {rows} vocabulary rows and the recipe {want}; both must cover "
                            f"the tokenizer's {tokenizer.vocab_size} tokens")
        for name in ("embed_tokens.weight",) + (() if model_cfg.tie_embeddings else ("lm_head.weight",)):
            w = state[name]
            mean = w[: tokenizer.vocab_size].float().mean(0, keepdim=True).to(w.dtype)
            state[name] = w[:want] if rows > want else torch.cat([w, mean.expand(want - rows, -1)])
    return state


def _tokenizer_hint(source) -> str:
    if source.kind == "megatron":
        return f"{source.path}/tokenizer"
    if source.kind in ("setdiff", "llama", "qwen2", "qwen3"):
        return str(source.path)
    return "its tokenizer directory"


def initialize_from(path: str, chunks, model_cfg, tokenizer, recipe) -> None:
    """Load `path`'s weights into this rank's megatron chunks (DDP-wrapped, as the engine builds them)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from setdiff_megatron.hf.sources import read_source
    from setdiff_megatron.models.weight_maps import torch_to_megatron

    source = read_source(path)
    state = fit_source(source, model_cfg, tokenizer)
    tp_size, pp_size = recipe.parallel.tp, recipe.parallel.pp
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    for chunk in chunks:
        module = getattr(chunk, "module", chunk)
        mapped = torch_to_megatron(state, model_cfg, tp_rank=tp_rank, tp_size=tp_size, pp_rank=pp_rank,
                                   pp_size=pp_size, vp_size=recipe.parallel.vpp, vp_stage=module.vp_stage,
                                   backend=recipe.model.backend)
        with torch.no_grad():
            missing, unexpected = module.load_state_dict(mapped, strict=False)
        missing = [k for k in missing if not k.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"model.init_from: megatron chunk weights missing {missing}, unexpected {unexpected}")
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(f"setdiff: initialised from {source.describe()}", flush=True)
