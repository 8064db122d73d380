"""The Hugging Face face of the set diffusion transformer: a `PreTrainedModel` around
models/torch_model.py whose `generate` runs its family's sampler (sampling/samplers.py).

hf/bundle.py puts this module last in an export's modeling_setdiff.py, after every package
module it needs, so it may import only the standard library, torch, transformers and the package
(whose imports the bundler removes). Weight names are Llama/Qwen's: the body under `model.`, an
untied output layer beside it as `lm_head`. The calling conventions are not a causal LM's
(`SetDiffModel.forward`, `SetDiffModel.generate`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from transformers import PreTrainedModel
from transformers.utils import ModelOutput

from setdiff_megatron.hf.configuration_setdiff import SetDiffConfig
from setdiff_megatron.models.adaln import Modulation, TimestepEmbedding
from setdiff_megatron.models.torch_model import Rotary, SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sample_output import SampleOutput
from setdiff_megatron.sampling.samplers import sampler_for
from setdiff_megatron.sources.hf_config import (
    decoding_config_from_generation,
    model_config_from_hf_config,
    with_family_policy,
)

__all__ = ["SetDiffConfig", "SetDiffModel", "SetDiffOutput", "SetDiffPreTrainedModel"]


@dataclass
class SetDiffOutput(ModelOutput):
    logits: torch.Tensor | None = None
    """Query-stream logits [B, L, V]."""


class SetDiffPreTrainedModel(PreTrainedModel):
    config_class = SetDiffConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False

    @classmethod
    def can_generate(cls) -> bool:
        # generate() is the set sampler, not GenerationMixin's; True makes from_pretrained read
        # generation_config.json into model.generation_config.
        return True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        cfg = model_config_from_hf_config(self.config.to_dict())
        if isinstance(module, Rotary):  # a non-persistent buffer: recomputed, never loaded
            module.inv_freq.copy_(Rotary(cfg.head_dim, cfg.rope_theta).inv_freq)
        elif isinstance(module, (Modulation, TimestepEmbedding)):  # adaLN's own initialisation
            module.reset_parameters()
        elif isinstance(module, (nn.Linear, nn.Embedding)):
            module.weight.normal_(0.0, cfg.init_std)
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()
        elif isinstance(module, (nn.RMSNorm, nn.LayerNorm)):
            module.weight.fill_(1.0)


class SetDiffModel(SetDiffPreTrainedModel):
    """The set diffusion transformer (AutoModel and AutoModelForCausalLM of an export)."""

    def __init__(self, config: SetDiffConfig):
        super().__init__(config)
        self.model_config = model_config_from_hf_config(config.to_dict())
        self.model = SetDiffusionTransformer(self.model_config)
        # Llama/Qwen layout: an untied output layer is `lm_head`, beside the body; the body keeps
        # a plain (unregistered) reference, which its output_logits reads.
        head = self.model._modules.pop("lm_head", None)  # None (not a module) when tied
        if head is not None:
            object.__setattr__(self.model, "lm_head", head)
            self.lm_head = head
        self.post_init()

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear | None:
        return self.model.lm_head

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        query_ids: torch.Tensor | None = None,
        valid_len: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        return_dict: bool | None = None,
        **kwargs,
    ) -> SetDiffOutput | tuple:
        """Query-stream logits [B, L, V]: logits[:, r] predicts the token at position_ids[:, r]
        from the clean tokens of ranks < r. input_ids is the clean stream in rank order, query_ids
        the query stream (default all MASK), position_ids the original positions (default 0..L-1,
        i.e. left to right). Padding comes last: valid_len [B], or a right-padded attention_mask.
        For the paper's baselines (config.json `family`): an MDLM's input_ids is the noisy
        sequence, attended bidirectionally (query_ids unused); a BD3-LM's input_ids is x0 and
        query_ids xt, attended block by block (config.json `block_size`), position_ids 0..L-1."""
        unknown = sorted(k for k, v in kwargs.items() if v is not None and v is not False)
        if unknown:
            raise TypeError(f"SetDiffModel.forward() does not take {unknown}")
        if attention_mask is not None and valid_len is None:
            # Padding must come last in rank order, as the order policies put it.
            valid_len = attention_mask.sum(1)
            ranks = torch.arange(attention_mask.shape[1], device=attention_mask.device)
            if not torch.equal(attention_mask.bool(), ranks < valid_len[:, None]):
                raise ValueError("attention_mask must mark padding at the end of each row (right padding)")
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand_as(input_ids)
        family = getattr(self.config, "family", "set_diffusion")
        if family == "mdlm":
            groups = torch.zeros_like(input_ids)
            logits = self.model(None, input_ids, position_ids, valid_len, groups=groups)
        else:
            if query_ids is None:
                query_ids = torch.full_like(input_ids, self.model_config.mask_token_id)
            groups = position_ids // self.config.block_size if family == "bd3lm" else None
            logits = self.model(input_ids, query_ids, position_ids, valid_len, groups=groups)
        if return_dict is False:
            return (logits,)
        return SetDiffOutput(logits=logits)

    def decoding_config(self, generation_config=None, **kwargs) -> DecodingConfig:
        """The DecodingConfig `generate` uses: generation_config (default: the model's) + kwargs."""
        config = generation_config if generation_config is not None else getattr(self, "generation_config", None)
        values = config.to_dict() if hasattr(config, "to_dict") else dict(config or {})
        return decoding_config_from_generation(with_family_policy(values, self.config.to_dict()), **kwargs)

    @torch.inference_mode()
    def generate(
        self,
        input_ids: torch.Tensor | list[list[int]] | None = None,
        attention_mask: torch.Tensor | None = None,
        generation_config=None,
        *,
        batch_size: int | None = None,
        return_dict_in_generate: bool = False,
        **kwargs,
    ) -> torch.Tensor | SampleOutput:
        """Complete the prompts, the unpadded rows of input_ids (MASK tokens inside a prompt are
        infilled). The decoding policy comes from generation_config.json (window, tokens_per_step,
        threshold, do_sample/temperature, top_k, top_p, repetition_penalty, eos_token_id,
        stop_token_sequences, max_new_tokens, seed), or a generation_config argument, overridden by
        keyword arguments; a baseline's policy keys they lack come from its family
        (with_family_policy: MDLM's blocks of 32, BD3-LM's own blocks and cached infill), the
        others from the sampler's defaults. Returns prompt + completion rows padded with
        pad_token_id, or with return_dict_in_generate=True the sampler's SampleOutput (per-row
        tokens, steps, NFE)."""
        if input_ids is None:
            raise ValueError("generate() needs input_ids: a [batch, length] tensor or a list of token-id lists")
        decoding = self.decoding_config(generation_config, **kwargs)
        if isinstance(input_ids, torch.Tensor):
            keep = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
            prompts = [row[m].tolist() for row, m in zip(input_ids, keep)]
        else:
            prompts = [list(map(int, row)) for row in input_ids]
        sampler = sampler_for(
            getattr(self.config, "family", "set_diffusion"),
            self.model,
            mask_token_id=self.model_config.mask_token_id,
            context_len=getattr(self.config, "length", None) or self.model_config.max_seq_len,
        )
        out = sampler.generate(prompts, decoding, batch_size=batch_size)
        if return_dict_in_generate:
            return out
        pad = getattr(getattr(self, "generation_config", None), "pad_token_id", None)
        pad = pad if pad is not None else (decoding.eos_token_ids or (0,))[0]
        width = max(len(r.tokens) for r in out.rows)
        rows = [r.tokens + [pad] * (width - len(r.tokens)) for r in out.rows]
        return torch.tensor(rows, dtype=torch.long, device=self.model.embed_tokens.weight.device)
