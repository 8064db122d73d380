"""Weight maps between the model's bodies and the checkpoint families it reads and writes, in one
package. Every map goes through the torch model's names, so a family is one module:

  torch_layout  the torch model's weight names and shapes, which every map checks against
  parallel      megatron's split of a model over ranks: layers per pipeline stage, TP shards,
                the padded vocabulary, experts per expert-parallel rank
  megatron_map  torch <-> megatron-core GPT (fused QKV and fc1, `local` and `te` backends, experts)
  hf            torch <-> Hugging Face Llama/Qwen
  dit           the reference's DiT -> torch, and back for release exports

Importing them needs torch only (checkpoint conversion runs without megatron).
"""
