"""RL rollouts: the batches of a GRPO step, made from the model's own decodes of supervised prompts.

Every `rl.epochs` optimizer steps each data-parallel rank decodes `rl.group_size` completions of
its share of the next prompts, scores them (training/rewards.py), normalises the rewards within
each group and replays the decodes (sampling/trajectory.py) into micro-batches that carry each
token's advantage and its log-probabilities under the sampling policy and the frozen reference.
The steps in between reuse them, as PPO's epochs do (docs/rl.md, "GRPO").
"""

from __future__ import annotations

import hashlib
from dataclasses import fields

import torch
import torch.distributed as dist

from setdiff_megatron.core.policy_gradient import PolicyBatch, group_advantages, one_step_batch
from setdiff_megatron.core.streams import TwoStreamBatch
from setdiff_megatron.recipes.decoding_settings import with_stops
from setdiff_megatron.recipes.schema import Recipe
from setdiff_megatron.sampling.sample_request import Request
from setdiff_megatron.sampling.samplers import sampler_for
from setdiff_megatron.sampling.trajectory import replay_batch
from setdiff_megatron.training.data_pipeline import TrainingData
from setdiff_megatron.training.engines.base import evaluating
from setdiff_megatron.training.rewards import reward_function

__all__ = ["Rollouts"]


def _seed(*parts: int) -> int:
    """A sampling seed of (train.seed, prompt index, completion): a resumed run draws what the
    uninterrupted one drew."""
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:7], "little")


class Rollouts:
    def __init__(self, recipe: Recipe, data: TrainingData, engine, *, dp_rank: int, dp_size: int, consumed: int = 0):
        self.recipe, self.data, self.engine = recipe, data, engine
        self.rl = recipe.rl
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.consumed = consumed
        """Prompts taken so far, over every rank (the progress a checkpoint records)."""
        self.reward = reward_function(self.rl.reward)
        self._batches: list[PolicyBatch] = []
        self._uses = 0
        self.metrics: dict[str, float] = {}

    @property
    def consumed_samples(self) -> int:
        return self.consumed

    def next_step(self) -> list[PolicyBatch]:
        """This rank's micro-batches for the next optimizer step: fresh rollouts every rl.epochs
        steps, the same ones in between, their old log-probabilities still the sampling policy's
        (where the policy has moved: `rl/clip_fraction`, the share of tokens whose ratio the clip
        holds)."""
        if self._uses % self.rl.epochs == 0:
            self._batches = self._rollout()
            self.metrics["rl/clip_fraction"] = 0.0  # the sampling policy itself: every ratio is 1
        else:
            self.metrics["rl/clip_fraction"] = self._clip_fraction()
        self._uses += 1
        return self._batches

    def _clip_fraction(self) -> float:
        now = self.engine.token_logprobs(self._batches)
        local = torch.zeros(2, dtype=torch.float64)
        for b, logp in zip(self._batches, now):
            outside = ((logp - b.old_logp).exp() - 1).abs() > self.rl.clip
            local += torch.tensor([float((outside & b.loss_mask).sum()), float(b.loss_mask.sum())], dtype=torch.float64)
        if dist.is_initialized():
            dist.all_reduce(local)
        return float(local[0] / max(local[1], 1))

    # ---- a rollout -----------------------------------------------------------------------

    def _records(self) -> list[tuple[int, list[int], dict]]:
        """(global index, prompt ids, record) of this rank's prompts of the next step."""
        per_rank = self.rl.prompts_per_step // self.dp_size
        first = self.consumed + self.dp_rank * per_rank
        tok, out = self.data.tokenizer, []
        for index in range(first, first + per_rank):
            sample = self.data.train[index % len(self.data.train)]
            tokens, prompt, pad = sample["tokens"], sample["prompt_mask"], sample["pad_mask"]
            prompt_ids = tokens[prompt].tolist()
            response = tokens[~prompt & ~pad].tolist()
            record = {"prompt": tok.decode(prompt_ids, skip_special_tokens=True),
                      "reference": tok.decode(response, skip_special_tokens=True)}  # fmt: skip
            out.append((index, prompt_ids, record))
        self.consumed += self.rl.prompts_per_step
        return out

    def _decode(self, records) -> list:
        """The group_size completions of each prompt, decoded by the model being trained."""
        rl, tok = self.rl, self.data.tokenizer
        model = self.engine.policy_model()
        cfg = with_stops(
            self.recipe.decoding_policy().with_settings(
                {"temperature": rl.temperature, "max_new_tokens": rl.max_new_tokens}
            ),
            tok,
        )
        sampler = sampler_for(
            self.recipe.method.family,
            model,
            mask_token_id=tok.mask_id,
            context_len=self.recipe.model.max_seq_len,
            max_rows=len(records) * rl.group_size,
            trace=True,
        )
        for index, prompt, _ in records:
            for g in range(rl.group_size):
                seed = _seed(self.recipe.train.seed, index, g)
                sampler.submit(
                    Request(key=(index, g), prompt=tuple(prompt), cfg=cfg.with_settings({"seed": seed}), seed=seed)
                )
        rows = {}
        with evaluating(model), self.engine.decoding():
            while not sampler.idle:
                rows.update(dict(sampler.step()))
        return [rows[(index, g)] for index, _, _ in records for g in range(rl.group_size)]

    def _rollout(self) -> list[PolicyBatch]:
        rl, tok = self.rl, self.data.tokenizer
        records = self._records()
        rows = self._decode(records)
        scores, rewards = [], []
        for (_, _, record), row in zip((r for r in records for _ in range(rl.group_size)), rows):
            score = float(self.reward(record, tok.decode(row.completion, skip_special_tokens=True)))
            scores.append(score)
            rewards.append(score + rl.step_reward * (row.tokens_per_step - 1))
        advantage = group_advantages(torch.tensor(rewards), rl.group_size)
        device = self.engine.device
        batches = []
        mbs = self.recipe.parallel.micro_batch_size
        for start in range(0, len(rows), mbs):
            batch = replay_batch(rows[start : start + mbs], tok.mask_id, device=device)
            if rl.likelihood == "one_step":
                batch = one_step_batch(batch)
            adv = advantage[start : start + mbs].to(device)[:, None].expand_as(batch.loss_mask)
            batches.append(_policy_batch(batch, torch.where(batch.loss_mask, adv, 0.0), rl.temperature))
        old = self.engine.token_logprobs(batches)
        ref = self.engine.token_logprobs(batches, reference=True)
        batches = [
            _policy_batch(b, b.advantage, rl.temperature, *(torch.where(b.loss_mask, x, 0.0) for x in (o, r)))
            for b, o, r in zip(batches, old, ref)
        ]
        self._measure(scores, rewards, rows, batches)
        return batches

    def _measure(self, scores, rewards, rows, batches: list[PolicyBatch]) -> None:
        """The step's metrics over every rank: reward mean and spread, accuracy (the reward
        function's score), tokens per step, and the KL to the reference of the sampling policy."""
        tokens = sum(int(b.loss_mask.sum()) for b in batches)
        kl = 0.0
        for b in batches:
            log_ratio = torch.where(b.loss_mask, b.ref_logp - b.old_logp, 0.0)
            kl += float(torch.where(b.loss_mask, torch.exp(log_ratio) - log_ratio - 1, 0.0).sum())
        local = torch.tensor(
            [sum(rewards), sum(r * r for r in rewards), sum(scores), len(rewards), sum(r.num_decoded for r in rows),
             sum(r.steps for r in rows), kl, tokens],
            dtype=torch.float64,
        )  # fmt: skip
        if dist.is_initialized():
            dist.all_reduce(local)
        total, squares, correct, n, decoded, steps, kl, tokens = local.tolist()
        mean = total / n
        self.metrics = {
            "rl/reward": mean,
            "rl/reward_std": max(squares / n - mean * mean, 0.0) ** 0.5,
            "rl/accuracy": correct / n,
            "rl/tokens_per_step": decoded / max(steps, 1),
            "rl/kl": kl / max(tokens, 1),
        }


def _policy_batch(batch: TwoStreamBatch, advantage, temperature: float, old=None, ref=None) -> PolicyBatch:
    values = {f.name: getattr(batch, f.name) for f in fields(TwoStreamBatch)}
    return PolicyBatch(**values, advantage=advantage, old_logp=old, ref_logp=ref, temperature=temperature)
