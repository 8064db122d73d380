"""GPU attention kernels behind core/merged_attention.py's set-causal decomposition.

te_fused (Transformer Engine's fused cuDNN attention, BF16 and FP8) and flash_attn (flash-attn 2's
low-level calls) adapt a kernel to core's `PartialAttention` protocol; dispatch picks 'auto' or a
forced name. The merge math stays in core/ (step_attention.py for sampling steps).
Importing this package registers 'auto', 'te' and 'flash_attn' with core/attention.py and
core/step_attention.py. CPU tests run the adapters on tests/kernels/emulation.py.
"""

from setdiff_megatron.kernels.dispatch import Choice, choose_attention_impl

__all__ = ["Choice", "choose_attention_impl"]
