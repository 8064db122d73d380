"""Hugging Face format: export, import, and the self-contained modeling file.

  export.py          `setdiff convert to-hf`: a checkpoint as a trust_remote_code directory
  import_hf.py       `setdiff convert from-hf`: Llama/Qwen2/Qwen3 (or an export) as a megatron checkpoint
  megatron_writer.py that checkpoint, written in one process and published like a training one
  bundle.py          generates modeling_setdiff.py from the package's own modules
  hf_model.py        the PreTrainedModel wrapper bundled last; configuration_setdiff.py ships as is
  verify.py          the logit comparisons; weights_io.py safetensors shards and staged output

Reading every format (our exports, Llama/Qwen models, the HF config tables) is sources/'s:
`sources.read_source` is the one reader for every consumer.
"""
