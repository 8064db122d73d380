"""The run-directory format, as a public API for every engine and every reader.

    <checkpoint.dir>/
      recipe.yaml                 the resolved recipe of the latest launch
      logs/                       metrics.jsonl, tensorboard/
      checkpoints/
        step_00000300/            a published checkpoint
          (engine files)          megatron dist_checkpointing shards (any TP/PP/DP), or
                                  deepspeed/ (DeepSpeed's own format), and per-rank RNG states
          train_state.json        state.py: step, data position, scheduler, layout, model
                                  identity, tokenizer, the run that wrote it
          recipe.yaml  tokenizer/
          manifest.json           manifest.py: size and sha256 of every file, written last
        latest                    the newest published checkpoint's name, moved last

Modules: `names` (the names above), `state` (TrainState: one reader, one writer), `identity`
(the model identity rule), `manifest` (write, verify), `publish` (the publication protocol,
retention, the never-lose-a-checkpoint rules), `resolve` (what a resume or a reader picks;
`describe`), `megatron` (dist_checkpointing's collective save and load). Reading a model out
of a checkpoint, or out of any other source, is `setdiff_megatron.sources`.

The engines keep their own save and load (dist_checkpointing with the optimizer; DeepSpeed's
format) and write through `publish`.
"""
