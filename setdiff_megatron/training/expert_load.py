"""Router statistics of a mixture of experts over one optimizer step, for metrics.jsonl and
TensorBoard: per MoE layer the tokens each expert computed, their max/mean (1.0 is perfect
balance), and the load-balancing and z losses without their coefficients.

Both engines feed it per micro-batch and layer (the torch body's RouterStats, megatron's routers'
routing); `metrics` sums over every rank, so each layer's counts cover the global batch whatever
the TP/PP/EP/DP layout, and the losses are means over ranks and micro-batches. The sums stay on
the training device: a step adds to them without waiting for the device, and `metrics`, every
log.interval steps, is the one reduction and host copy.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from setdiff_megatron.models.config import ModelConfig

__all__ = ["ExpertLoad"]


class ExpertLoad:
    def __init__(self, cfg: ModelConfig, device: torch.device | str = "cpu"):
        self.num_experts = cfg.num_experts
        self.layers = [i for i, moe in enumerate(cfg.moe_layers) if moe]
        self._sums = torch.zeros(cfg.num_layers, self.num_experts + 3, dtype=torch.float64, device=device)

    def reset(self) -> None:
        """Start a step afresh (validation forwards since the last read are dropped too)."""
        self._sums.zero_()

    def add(self, layer: int, tokens_per_expert: torch.Tensor, balance: torch.Tensor, z: torch.Tensor) -> None:
        row, n = self._sums[layer], self.num_experts
        row[:n] += tokens_per_expert.detach()
        row[n] += balance.detach()
        row[n + 1] += z.detach()
        row[n + 2] += 1

    def metrics(self) -> dict[str, float | list[float]]:
        """Collective (every rank, when distributed): the figures since the last reset."""
        sums = self._sums.clone()
        if dist.is_initialized():
            dist.all_reduce(sums)
        sums = sums.cpu()
        out: dict[str, float | list[float]] = {}
        balance, z, ratio = [], [], []
        for i in self.layers:
            tokens, (lb, zl, count) = sums[i, : self.num_experts], sums[i, self.num_experts :].tolist()
            if count == 0:
                continue
            load = float(tokens.max() / tokens.mean().clamp(min=1e-12))
            balance.append(lb / count)
            z.append(zl / count)
            ratio.append(load)
            out[f"moe/layer{i}/max_over_mean_load"] = load
            out[f"moe/layer{i}/load_balancing_loss"] = lb / count
            out[f"moe/layer{i}/tokens_per_expert"] = tokens.tolist()
        if ratio:
            out |= {
                "moe/load_balancing_loss": sum(balance) / len(balance),
                "moe/z_loss": sum(z) / len(z),
                "moe/max_over_mean_load": sum(ratio) / len(ratio),
            }
        return out
