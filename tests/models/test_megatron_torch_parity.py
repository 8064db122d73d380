"""Megatron model (TP=1) vs torch model on the same weights (through the weight map), batch and
order: query logits, loss and gradients. Measured in megatron_single_worker.py."""

import pytest

VARIANTS = [
    "tied_fused",
    "untied_qknorm_sdpa",
    "gqa1_dense",
    # mixtures of experts: router, experts, shared experts, z-loss, capacity dropping, top-1
    "moe_shared_zloss",
    "moe_capacity",
    "moe_top1_pre_softmax",
    # document masking: three documents per window; the second through full recompute
    "documents_fused",
    "documents_gqa1_sdpa_recompute",
    # the reference DiT's layout (LayerNorm, GELU MLP with biases, output bias); the second
    # with GQA, SDPA, full recompute and the LM1B models' adaLN
    "dit_fused",
    "dit_adaln_sdpa_recompute",
    # the masked-diffusion baselines' grouped attention: BD3-LM's x0 (+) xt in blocks of 4, MDLM's
    # query stream alone (GQA, through full recompute, which saves the groups in the mask slot)
    "bd3lm_tied",
    "mdlm_gqa1_recompute",
    # packed supervised records: BD3-LM's per-record blocks and document ids, through full recompute
    "bd3lm_records_recompute",
    # a decoded trajectory replayed (steps of 3 ranks that see one another by rank), full recompute
    "replay_steps_recompute",
]
# float32 runs the same kernels in the same order (logits agree bit for bit); the loss goes through
# megatron's vocab-parallel cross-entropy, which computes in float32 even for float64 logits.
TOLERANCES = {"float32": dict(logits=1e-6, loss=1e-6, grad=1e-6), "float64": dict(logits=1e-7, loss=1e-6, grad=1e-7)}


@pytest.mark.parametrize("dtype", sorted(TOLERANCES))
@pytest.mark.parametrize("variant", VARIANTS)
def test_megatron_matches_torch_model(single_results, variant, dtype):
    r = single_results["torch_parity"][f"{variant}_{dtype}"]
    tol = TOLERANCES[dtype]
    assert r["logits_shape"] == r["ref_shape"] == [2, 16, 64]
    assert r["logits_diff"] <= tol["logits"]
    assert r["loss_diff"] <= tol["loss"]
    assert r["grad_diff"] <= tol["grad"]


@pytest.mark.parametrize("case", ["sampling", "moe_sampling", "dit_sampling"])
def test_megatron_model_samples_like_torch_model(single_results, case):
    """The megatron body implements the sampler's StepModel: same step logits, same greedy decodes."""
    r = single_results[case]
    assert r["step_logits_diff"] <= 1e-6
    assert all(r["tokens_equal"]) and all(r["nfe_equal"]) and len(r["tokens_equal"]) == 4


@pytest.mark.parametrize("body", ["gqa", "dit"])
def test_lora_adapters_are_the_same_under_both_bodies(single_results, body):
    """One seed draws the same adapters on both bodies (megatron's fused QKV reads B in torch rows):
    same logits, same adapter gradients, and gradients for the adapters alone."""
    r = single_results["lora"][body]
    assert r["same_adapters"] and r["grads"]
    assert r["logits_diff"] <= 1e-6 and r["grad_diff"] <= 1e-6
