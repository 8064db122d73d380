"""The run-directory format, as a public API for every engine and every reader.

A run directory holds recipe.yaml, logs/ and checkpoints/: published step_N/ directories (the
engine's files, train_state.json, recipe.yaml, tokenizer/, and manifest.json, written last) and
`latest`, moved last (docs/training.md, "Training and checkpoints", shows the layout). The engines
keep their own save and load and write through `publish`; reading a model out of a checkpoint, or
out of any other source, is `setdiff_megatron.sources`.
"""
