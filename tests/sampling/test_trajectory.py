"""A decoded trajectory's exact log-likelihood (sampling/trajectory.py): one teacher-forced forward of
its replayed commit order gives the log-probabilities the set sampler computed while decoding, to
1e-5 in float32, one token per step or several at a threshold, greedy or sampled."""

import pytest
import torch

from setdiff_megatron.core.loss import token_nll
from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.sampler import SetSampler
from setdiff_megatron.sampling.trajectory import replay_batch
from tests.conftest import debug_config, randomized


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    cfg = debug_config(max_seq_len=48, attention_impl="sdpa")
    m = SetDiffusionTransformer(cfg)
    weights = randomized(m.state_dict(), 3)
    weights["embed_tokens.weight"] *= 3
    weights["embed_tokens.weight"][cfg.mask_token_id] *= 0.05
    for name in weights:
        if name.endswith(("q_proj.weight", "k_proj.weight")):
            weights[name] *= 3
    m.load_state_dict(weights)
    return m.eval()


@pytest.mark.parametrize(
    "cfg",
    [
        DecodingConfig(window=1, max_new_tokens=10, temperature=1.0, seed=3),
        DecodingConfig(window=4, threshold=0.02, max_new_tokens=12, temperature=1.0, seed=4),
        DecodingConfig(window=4, threshold=0.05, max_new_tokens=12),
    ],
    ids=["w1-sampled", "w4-threshold-sampled", "w4-threshold-greedy"],
)
def test_the_replay_gives_the_samplers_log_probabilities(model, cfg):
    mask = model.config.mask_token_id
    prompts = [[5, 9, 11], [2, 4, 6, 8, 10, 12, 14], [7, mask, mask, 3, 1]]
    out = SetSampler(model, mask_token_id=mask, context_len=48).generate(prompts, cfg, trace=True)
    if cfg.threshold is not None:
        assert any(len(s.decoded) > 1 for r in out.rows for s in r.trace)
    batch = replay_batch(out.rows, mask)
    with torch.no_grad():
        logits = model(batch.clean_tokens, batch.query_tokens, batch.position_ids, batch.valid_len,
                       groups=batch.groups, group_within=batch.group_within)  # fmt: skip
    logp = -token_nll(logits, batch.targets, mask)
    for i, row in enumerate(out.rows):
        sampled = torch.tensor([lp for s in row.trace for lp in s.logprobs], dtype=torch.float32)
        replayed = logp[i][batch.loss_mask[i]]
        assert replayed.shape == sampled.shape and (replayed - sampled).abs().max() < 1e-5
