"""Training: one loop (trainer.py) over the engines of engines/ (megatron-core, DeepSpeed), the
data pipeline from a recipe to two-stream micro-batches, the LR schedule and the metrics."""
