"""Sampling jobs: prompts from JSONL, models from checkpoints or Hugging Face exports, sharded
over processes, resumable, merged into one ordered output."""
