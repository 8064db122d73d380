"""Tiny Llama / Qwen2 / Qwen3 / Qwen3-MoE causal LMs and tokenizers, built locally with transformers
(no hub).

Weights are random everywhere (norms and biases included) so that a wrong mapping cannot hide
behind HF's ones/zeros initialisation. The tokenizers are small byte-level BPEs with the special
tokens of each family: Qwen's `<|fim_middle|>` (reused as MASK), Llama 3's begin/end of text
(MASK and PAD get added).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

TEXT = [
    "def add(a, b):\n    return a + b\n",
    "import os\nprint(os.getcwd())\n",
    "class A:\n    pass\n",
    "for i in range(10):\n    print(i * i)\n",
    "the quick brown fox jumps over the lazy dog\n",
] * 20
SPECIALS = {
    "qwen": ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>"],
    "llama": ["<|begin_of_text|>", "<|end_of_text|>"],
}
TOKENIZER_CONFIG = {
    "qwen": {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>", "bos_token": None},
    "llama": {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>"},
}
BODY = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=96,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
CLASSES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
}


def make_tokenizer(directory: Path, family: str, vocab_size: int = 300) -> int:
    """Write tokenizer.json + tokenizer_config.json; return the tokenizer's vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIALS[family], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(TEXT, trainer)
    directory.mkdir(parents=True, exist_ok=True)
    tok.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", **TOKENIZER_CONFIG[family]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return tok.get_vocab_size(with_added_tokens=True)


def make_ar_model(
    kind: str,
    directory: Path,
    *,
    tie: bool = False,
    extra_rows: int = 0,
    seed: int = 0,
    fused: bool = False,
    **overrides,
) -> Path:
    """A random `kind` (a key of CLASSES) model and tokenizer saved to `directory`; `fused`: its
    experts saved as transformers 5 holds them (mlp.experts.gate_up_proj, down_proj), not one tensor
    per expert as save_pretrained writes them."""
    import transformers
    from safetensors.torch import save_file

    family = "llama" if kind == "llama" else "qwen"
    vocab = make_tokenizer(directory, family) + extra_rows
    classes = CLASSES[kind]
    fields = {**BODY, "vocab_size": vocab, "tie_word_embeddings": tie, "rope_theta": 50000.0}
    if kind.startswith("qwen3"):
        fields["head_dim"] = 24  # not hidden / heads, as in the real Qwen3 models
    if kind == "qwen3_moe":
        fields |= MOE
    config = getattr(transformers, classes[0])(**{**fields, **overrides})
    torch.manual_seed(seed)
    model = getattr(transformers, classes[1])(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.05 if p.dim() > 1 else 0.1)
    model.save_pretrained(directory)
    if fused:
        state = {k: v.contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory
