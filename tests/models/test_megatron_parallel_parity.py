"""Parallel layouts against TP=1/PP=1 on the same weights and micro-batches, and the distributed
optimizer against the plain one: 2 ranks under torchrun, gloo, CPU (megatron_parallel_worker.py).

Every layout runs megatron DDP + get_forward_backward_func() over 4 micro-batches +
finalize_model_grads; gradients of all ranks are merged by the weight map before comparing.
"""

import pytest

from tests.models.megatron_cases import run_worker

pytestmark = pytest.mark.multiproc

LOSS_TOL = 1e-5
GRAD_TOL = 1e-6  # absolute, float32; the largest reference gradient entry is about 0.3
SCHEDULES = {
    "tp2": "forward_backward_no_pipelining",
    "tp2_sp": "forward_backward_no_pipelining",
    "tp2_sp_selective_recompute": "forward_backward_no_pipelining",
    "tp2_sp_full_recompute": "forward_backward_no_pipelining",
    "pp2": "forward_backward_pipelining_without_interleaving",  # 1F1B
    "pp2_vpp2": "forward_backward_pipelining_with_interleaving",
    "cp2": "forward_backward_no_pipelining",  # zigzag chunks, set-causal ring attention
}


@pytest.mark.parametrize("layout", sorted(SCHEDULES))
def test_layout_matches_single_rank(parallel_results, layout):
    r = parallel_results[layout]
    assert r["schedule"] == SCHEDULES[layout]
    assert r["num_losses"] == len(parallel_results["reference"]["losses"]) == 4
    assert r["loss_diff"] <= LOSS_TOL
    assert r["grad_diff"] <= GRAD_TOL
    assert parallel_results["reference"]["grad_scale"] > 1e-2


def test_document_masking_under_cp2_matches_single_rank(parallel_results):
    """Packed windows of three documents: CP=2 ring attention masks documents as one rank does."""
    r = parallel_results["cp2_documents"]
    assert r["num_losses"] == 4 and r["differs_from_unmasked"] > 1e-3, r  # the mask does change the loss
    assert r["loss_diff"] <= LOSS_TOL and r["grad_diff"] <= GRAD_TOL, r


@pytest.mark.parametrize("layout", ["tp2_records", "pp2_records", "pp2_vpp2_records", "cp2_records"])
def test_supervised_records_match_single_rank(parallel_results, layout):
    """Rows of supervised records, two packed in a row (per-record positions, document ids,
    pinned prompts): TP = 2 (SP), PP = 2 (also interleaved, 2 virtual stages) and CP = 2 equal
    one rank."""
    r = parallel_results[layout]
    assert r["num_losses"] == 4 and r["loss_diff"] <= LOSS_TOL and r["grad_diff"] <= GRAD_TOL, r


@pytest.mark.parametrize(
    "layout", ["bd3lm_tp2_sp", "bd3lm_pp2", "mdlm_tp2", "mdlm_pp2_vpp2", "bd3lm_records_tp2", "mdlm_records_pp2"]
)
def test_masked_diffusion_baselines_match_single_rank(parallel_results, layout):
    """BD3-LM's x0 (+) xt in blocks (TP = 2 with SP, PP = 2) and MDLM's query stream alone (TP = 2,
    PP = 2 interleaved) equal one rank, padded rows or packed supervised records (the groups and
    document ids through megatron's attention-mask slot)."""
    r = parallel_results[layout]
    assert r["num_losses"] == 4 and r["loss_diff"] <= LOSS_TOL and r["grad_diff"] <= GRAD_TOL, r


@pytest.mark.parametrize("layout", ["dit_tp2", "dit_tp2_sp", "dit_pp2", "dit_pp2_vpp2"])
def test_dit_layouts_match_single_rank(parallel_results, layout):
    """The reference DiT's layout (LayerNorm, GELU MLP with biases, output bias) with adaLN at
    TP = 2 (also with SP, whose norm weights, fc2 biases and adaLN parameters are reduced over TP)
    and PP = 2 (also interleaved: every chunk's copy of the time embedding takes the gradient of
    all layers) equals one rank."""
    r = parallel_results[layout]
    assert r["num_losses"] == 4 and r["loss_diff"] <= LOSS_TOL and r["grad_diff"] <= GRAD_TOL, r
    assert r["grad_scale"] > 1e-2


def test_distributed_optimizer_matches_plain_optimizer(parallel_results):
    r = parallel_results["distributed_optimizer"]
    assert r["param_change"] > 1e-2, "three Adam steps at lr 1e-2 must move the weights"
    assert r["param_diff"] <= 1e-6


def test_tp2_sampling_matches_torch_model(parallel_results):
    """Greedy decodes over the TP=2 megatron model (each rank caching its own heads) equal the
    torch model's token for token, on every rank."""
    r = parallel_results["tp2_sampling"]
    assert r["step_logits_diff"] <= 1e-5
    assert all(r["tokens_equal"]) and all(r["nfe_equal"]) and len(r["tokens_equal"]) == 4
    assert r["ranks_agree"]


@pytest.mark.slow
def test_context_parallelism_composes_with_tp_and_pp_on_four_ranks(tmp_path):
    results = run_worker("tests.models.megatron_parallel_worker", tmp_path / "four.json", nproc=4, timeout=600)
    for layout in ("cp2_tp2_sp", "cp2_pp2"):
        r = results[layout]
        assert r["num_losses"] == 4 and r["loss_diff"] <= LOSS_TOL and r["grad_diff"] <= GRAD_TOL, (layout, r)
