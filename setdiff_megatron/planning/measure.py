"""One rank's memory in one training step of the megatron engine, measured under `LiveBytes`.

The engine builds its chunks, DDP buffers and optimizer as in training, the optimizer's state is
filled, and the pipeline schedule runs the step's micro-batches forward and backward. On fake
tensors inside `fake_rank` this plans a rank that is not here; on real tensors it measures this
rank, counted the same way. Left out: the gradient reduction (in place: no memory) and the
optimizer's update; under fake tensors MoE routing is balanced (docs/scaling.md, "How each figure is made").
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
from collections.abc import Iterator
from dataclasses import dataclass
from unittest import mock

import torch

from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.planning.live_bytes import LiveBytes
from setdiff_megatron.recipes.schema import Recipe

__all__ = ["BALANCED_ROUTING", "RankMemory", "measure_megatron_rank", "synthetic_batch"]

BALANCED_ROUTING = {"moe_expert_capacity_factor": 1.0, "moe_pad_expert_input_to_capacity": True}
"""Under fake tensors, which cannot answer the dropless all-to-all's host-side token counts: capacity
factor 1 with padding to capacity, so every expert takes its even share."""


@dataclass(frozen=True)
class RankMemory:
    """Bytes on one rank: the model's parameters, its gradient buffers, the optimizer's (fp32
    main weights and moments, sharded under the distributed optimizer), the peak of the step, and
    the layers it holds."""

    params: int
    grads: int
    optimizer: int
    peak: int
    num_params: int
    layers: int
    micro_batches: int

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def activations(self) -> int:
        return self.peak - self.static


def synthetic_batch(recipe: Recipe, model_cfg: ModelConfig) -> object:
    """A micro-batch of full-length rows (no padding, no prompt: the most targets), drawn by the
    recipe's method as training draws them; valid_len is None, as every row is whole."""
    from setdiff_megatron.training.data_pipeline import model_batch

    mbs, length = recipe.parallel.micro_batch_size, recipe.data.seq_len
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, max(1, model_cfg.mask_token_id), (mbs, length), generator=generator)
    empty = torch.zeros(mbs, length, dtype=torch.bool)
    sample = {"tokens": tokens, "prompt_mask": empty, "pad_mask": empty}
    policy = None if recipe.method.masked_diffusion else recipe.method.order_policy()
    batch = model_batch(recipe, policy, sample, model_cfg.mask_token_id, None, generator, 0, mbs, torch.device("cpu"))
    return dataclasses.replace(batch, valid_len=None)


@contextlib.contextmanager
def _even_expert_rows() -> Iterator[None]:
    """Under padding to capacity each local expert gets the same number of rows; SequentialMLP
    reads the counts with `.tolist()`, which fake tensors cannot answer, so it is handed them."""
    from megatron.core.transformer.moe.experts import SequentialMLP

    forward = SequentialMLP.forward

    def even(self, hidden, tokens_per_expert, probs, *args, **kwargs):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():  # a real tensor: .tolist() answers
            counts = torch.full((self.num_local_experts,), hidden.shape[0] // self.num_local_experts)
        return forward(self, hidden, counts, probs, *args, **kwargs)

    with mock.patch.object(SequentialMLP, "forward", even):
        yield


def measure_megatron_rank(recipe: Recipe, model_cfg: ModelConfig, *, fake: bool) -> RankMemory:
    """This rank's footprint over one step (a process group of the recipe's world must be up:
    `fake_rank`'s, or a real one)."""
    # megatron-core makes a few tensors when some of its modules are first imported (class-level
    # scales): process-wide, not the rank's, so imported before counting.
    import megatron.core.transformer.multi_token_prediction  # noqa: F401

    from setdiff_megatron.training.engines.megatron_engine import MegatronEngine, fill_optimizer_state

    engine = MegatronEngine(recipe)
    batch = synthetic_batch(recipe, model_cfg)
    mbs = recipe.parallel.micro_batch_size
    num_micro = recipe.parallel.global_batch_size // (mbs * engine.dp_size)
    tracker = LiveBytes()
    if fake:
        mode, experts = torch._subclasses.fake_tensor.FakeTensorMode(allow_non_fake_inputs=True), _even_expert_rows()
    else:
        mode, experts = contextlib.nullcontext(), contextlib.nullcontext()
    with mode, experts, tracker:
        stand_ins = BALANCED_ROUTING if fake and model_cfg.num_experts else {}
        # The MoE routing statistics (a few hundred bytes of counters) are left out, real or fake.
        engine.build(model_cfg, total_steps=1, router_stats=False, **stand_ins)
        if fake:  # the gradient reduction reads the token count (data) and moves no memory
            for chunk in engine.chunks:
                chunk.module.config.finalize_model_grads_func = None
        fill_optimizer_state(engine.optimizer)
        gc.collect()  # garbage in reference cycles (a collective's pickled bytes) is not the rank's state
        static = tracker.current
        tracker.reset_peak()
        for chunk in engine.chunks:
            chunk.zero_grad_buffer()
        engine._schedule(
            forward_step_func=engine._forward_step,
            data_iterator=[iter([batch] * num_micro) for _ in engine.chunks],
            model=engine.chunks,
            num_microbatches=num_micro,
            seq_length=engine._seq_length,
            micro_batch_size=mbs,
            forward_only=False,
        )
        params = sum(p.numel() * p.element_size() for c in engine.chunks for p in c.module.parameters())
        grads = sum(b.grad_data.nbytes for c in engine.chunks for b in (*c.buffers, *c.expert_parallel_buffers))
        num_params = sum(p.numel() for c in engine.chunks for p in c.module.parameters())
        layers = sum(len(c.module.decoder.layers) for c in engine.chunks)
        peak = tracker.peak
    return RankMemory(params, grads, static - params - grads, peak, num_params, layers, num_micro)
