"""Evaluation jobs: likelihood, generation tasks, infilling, speed-quality sweeps, lm-eval.

Every job shards its examples over processes, writes per-shard results atomically, skips
finished work on a rerun and merges (inference/results.py)."""
