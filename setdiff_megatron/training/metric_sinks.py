"""Where training metrics go: metrics.jsonl, the console, TensorBoard and Weights & Biases.

The console shows a progress bar on a terminal; anywhere else (a SLURM log, CI, a pipe) it
prints one plain line every `log.interval` steps: step/total, loss, LR, grad norm, tokens/s,
elapsed time and ETA (progress.py). Rank 0 logs (the engines all-reduce the loss, so it holds
it); every other rank gets a logger that drops everything, so the loop never branches on the
rank. Also the arithmetic of throughput: tokens/s and a model-FLOPs-utilisation estimate.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.errors import require
from setdiff_megatron.log import say
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.progress import clock, interactive
from setdiff_megatron.recipes.schema import LogSection

__all__ = ["MetricsLogger", "training_flops_per_token", "peak_flops", "memory_gb", "step_metrics"]


def training_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Model FLOPs per sequence token of one training step (forward + backward = 3 x forward).

    An example of L tokens runs 2L tokens (clean + query stream) through every weight matmul;
    set-causal attention does about L^2 useful score entries per head over both streams
    (docs/method.md, "Fused kernels"), each costing 2 FLOPs in QK^T and 2 in PV per head
    dimension; the output layer runs on the query stream only.
    """
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    h = cfg.hidden_size
    attention_weights = h * q + 2 * h * kv + q * h
    # A token runs through the router, its top-k experts and the shared experts of an MoE layer.
    mlp_weights = sum(
        h * cfg.num_experts + 3 * h * cfg.moe_intermediate_size * (cfg.moe_top_k + cfg.num_shared_experts)
        if moe
        else 3 * h * cfg.intermediate_size
        for moe in cfg.moe_layers
    )
    per_example = (
        2 * seq_len * 2 * (cfg.num_layers * attention_weights + mlp_weights) + cfg.num_layers * 4 * seq_len**2 * q
    )
    per_example += seq_len * 2 * h * cfg.vocab_size
    return 3.0 * per_example / seq_len


# Dense BF16 peak FLOP/s by device name, for the MFU estimate; other devices report TFLOP/s only.
PEAK_BF16_FLOPS = {"H100": 989e12, "H200": 989e12, "A100": 312e12, "B200": 2250e12}


def peak_flops(device_name: str | None) -> float | None:
    if device_name is None:
        return None
    return next((v for k, v in PEAK_BF16_FLOPS.items() if k in device_name), None)


class MetricsLogger:
    def __init__(
        self,
        section: LogSection,
        out_dir: Path,
        *,
        total_steps: int,
        start_step: int,
        enabled: bool,
        run_name: str,
        config: dict[str, Any],
    ):
        self.enabled = enabled
        self.interval = section.interval
        self._bar = self._tb = self._wandb = None
        self._jsonl = None
        self._lines = False
        self.total_steps, self.start_step, self.start = total_steps, start_step, time.monotonic()
        if not enabled:
            return
        out_dir.mkdir(parents=True, exist_ok=True)
        self._jsonl = (out_dir / "metrics.jsonl").open("a")
        if section.console and interactive():
            from tqdm import tqdm

            self._bar = tqdm(total=total_steps, initial=start_step, desc=run_name, unit="step", dynamic_ncols=True)
        self._lines = section.console and self._bar is None
        if section.tensorboard:
            tensorboard = require("torch.utils.tensorboard", "tensorboard", "TensorBoard logging (log.tensorboard)")
            self._tb = tensorboard.SummaryWriter(log_dir=str(out_dir / "tensorboard"))
        if section.wandb is not None:
            wandb = require("wandb", "wandb", "Weights & Biases logging (log.wandb)")
            self._wandb = wandb.init(
                project=section.wandb.project,
                entity=section.wandb.entity,
                mode=section.wandb.mode,
                name=run_name,
                dir=str(out_dir),
                config=config,
            )

    def log(self, step: int, metrics: dict[str, float | list[float]]) -> None:
        if not self.enabled:
            return
        self._jsonl.write(json.dumps({"step": step, "time": time.time(), **metrics}) + "\n")
        self._jsonl.flush()
        if self._tb is not None:
            for key, value in metrics.items():
                if isinstance(value, list):  # per-expert token counts, per-rank compute times
                    self._tb.add_histogram(key, torch.tensor(value), step)
                else:
                    self._tb.add_scalar(key, value, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in metrics.items() if not isinstance(v, list)}, step=step)
        if self._bar is not None:
            shown = {k.split("/")[-1]: f"{v:.4g}" for k, v in metrics.items() if k in _BAR_KEYS}
            self._bar.set_postfix(shown, refresh=False)
        elif self._lines:
            say(self.line(step, metrics))

    def line(self, step: int, metrics: dict[str, float]) -> str:
        """The plain console line of a step's metrics."""
        parts = [f"step {step}/{self.total_steps}"]
        for key, label, spec in (
            ("train/loss", "loss", ".4f"),
            ("valid/loss", "valid loss", ".4f"),
            ("train/lr", "lr", ".3e"),
            ("train/grad_norm", "grad norm", ".3g"),
            ("moe/load_balancing_loss", "lb loss", ".4f"),
            ("moe/max_over_mean_load", "max/mean load", ".3f"),
            ("perf/tokens_per_s", "tokens/s", ",.0f"),
            ("checkpoint/step", "checkpoint of step", "d"),
            ("checkpoint/blocked_s", "blocked s", ".2f"),
            ("checkpoint/write_s", "written s", ".2f"),
        ):
            if key in metrics:
                parts.append(f"{label} {metrics[key]:{spec}}")
        elapsed, done = time.monotonic() - self.start, step - self.start_step
        parts.append(f"elapsed {clock(elapsed)}")
        if done > 0 and step < self.total_steps:
            parts.append(f"ETA {clock(elapsed / done * (self.total_steps - step))}")
        return " | ".join(parts)

    def advance(self, steps: int = 1) -> None:
        if self._bar is not None:
            self._bar.update(steps)

    def message(self, text: str) -> None:
        if self.enabled:
            say(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()
        if self._jsonl is not None:
            self._jsonl.close()


_BAR_KEYS = ("train/loss", "valid/loss", "train/lr", "perf/tokens_per_s")


def memory_gb() -> float:
    """Peak GPU memory of this process, or its resident host memory on a CPU."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    import psutil

    return psutil.Process().memory_info().rss / 2**30


def step_metrics(
    *,
    loss: float,
    lr: float,
    step_time_s: float,
    tokens: int,
    flops_per_token: float,
    world_size: int,
    peak: float | None,
) -> dict[str, float]:
    """What both engines log for an optimizer step: loss, LR, throughput, TFLOP/s and MFU per
    process, memory."""
    tps = tokens / step_time_s
    tflops = flops_per_token * tps / world_size
    metrics = {
        "train/loss": loss,
        "train/lr": lr,
        "perf/tokens_per_s": tps,
        "perf/step_time_s": step_time_s,
        "perf/tflops": tflops / 1e12,
        "perf/memory_gb": memory_gb(),
    }
    if peak:
        metrics["perf/mfu"] = tflops / peak
    return metrics
