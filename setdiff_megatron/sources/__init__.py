"""Every source a model can be read from, in one process: ONE `read_source(path)` for
sampling, export, serving, evaluation and `model.init_from`.

A source is a run directory or one of its checkpoints (either engine, any layout), a Hugging
Face export of ours, a Llama/Qwen2/Qwen3/Qwen3-MoE Hub folder (an AR model to adapt), one of the
reference's SetDLM releases, or a reference DiT checkpoint (Hub folder or composer `.pt`). `read`
picks the reader; `megatron_checkpoints` and `deepspeed_checkpoints` read the engines'
checkpoints whole; `hf_export`,
`hf_files` and `hf_config` read HF folders; `ar_import`, `dit_import` and `setdlm_release` map
other projects' weights onto our model, `safe_pickle` reads their pickles without running them. The run
directory they read is `setdiff_megatron.checkpoint`'s format, one layer below.
"""
