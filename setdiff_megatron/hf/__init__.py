"""Hugging Face format: export, import, and the self-contained modeling file.

  export.py          `setdiff convert to-hf`: a checkpoint as a trust_remote_code directory
  import_hf.py       `setdiff convert from-hf`: Llama/Qwen2/Qwen3 (or an export) as a megatron checkpoint
  megatron_writer.py the TP x PP gloo processes that write that checkpoint
  sources.py         every source as (config, torch weights, tokenizer, recipe); ar_import.py for AR models
  init_from.py       the engine's `model.init_from`
  load.py            `load_hf_export`: an export back as (ModelConfig, torch weights, tokenizer)
  bundle.py          generates modeling_setdiff.py from the package's own modules
  hf_model.py        the PreTrainedModel wrapper bundled last; configuration_setdiff.py ships as is
  config_map.py      HF config / generation config <-> ModelConfig / DecodingConfig
  verify.py          the logit comparisons; weights_io.py safetensors shards and staged output
"""
