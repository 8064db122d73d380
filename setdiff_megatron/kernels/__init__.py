"""GPU attention kernels behind core/merged_attention.py's set-causal decomposition.

  te_fused    Transformer Engine's low-level fused (cuDNN) attention, BF16 and FP8
  flash_attn  flash-attn 2's low-level forward/backward with the log-sum-exp
  dispatch    'auto' (best available per device and dtype, logged once) and the forced names

The merge math lives once, in core/merged_attention.py (core/step_attention.py for the sampling
step); each module here only adapts a kernel to its `PartialAttention` protocol. TE and
flash-attn are imported lazily, inside functions, and every failure to import them (TE raises
RuntimeError without cuDNN) counts as "not available".
Importing this package registers 'auto', 'te' and 'flash_attn' with core/attention.py and
core/step_attention.py. CPU tests run the adapters on tests/kernels/emulation.py.
"""

from setdiff_megatron.kernels.dispatch import Choice, choose_attention_impl

__all__ = ["Choice", "choose_attention_impl"]
