"""The CPU compatibility layer: device redirect, backward re-entry, RNG streams, recompute.

Enabling CPU mode patches torch for the rest of a process, so the behaviour is observed in a
worker (megatron_single_worker.py); only the refusal on GPU machines is checked here, with nothing enabled.
"""

import pytest
import torch

from setdiff_megatron.distributed import megatron_cpu


def test_the_installed_megatron_core_is_the_one_the_patches_were_written_for():
    """A new megatron-core release fails here with one line per renamed private, before a CPU run
    or a background save misbehaves."""
    problems = megatron_cpu.compatibility_problems()
    assert not problems, "; ".join(problems)


def test_a_release_outside_the_range_is_named(monkeypatch):
    monkeypatch.setattr(megatron_cpu.importlib.metadata, "version", lambda name: "0.18.0")
    monkeypatch.setitem(megatron_cpu.PRIVATE_NAMES, "megatron.core.tensor_parallel.mappings", ("_no_such_helper",))
    problems = megatron_cpu.compatibility_problems()
    assert problems[0].startswith(
        "megatron-core 0.18.0 is installed; the CPU layer and the engine's patches were written for 0.16.x"
    )
    assert problems[1:] == [
        "megatron-core 0.18.0: megatron.core.tensor_parallel.mappings._no_such_helper is gone, "
        "which megatron_cpu.py relies on"
    ]


def test_cuda_device_arguments_land_on_the_cpu(single_results):
    r = single_results["device_redirect"]
    assert single_results["auto_cpu_mode"] is True
    assert r["factory_device"] == r["ordinal_device"] == r["current_device_alloc"] == r["to_cuda"] == "cpu"
    assert r["cuda_is_identity"] is True
    assert r["to_cuda_dtype"] == "torch.float64"
    assert r["backend"] == "gloo"


def test_tensor_type_reports_cuda_names_for_megatron_type_checks(single_results):
    r = single_results["device_redirect"]
    assert (r["type_fp32"], r["type_bf16"]) == ("torch.cuda.FloatTensor", "torch.cuda.BFloat16Tensor")
    assert r["type_convert"] == "torch.float16"


def test_backward_and_autograd_grad_reenter_the_mode(single_results):
    r = single_results["backward_reentry"]
    assert r == {"backward": [2.0, 2.0], "autograd_grad": [2.0, 2.0]}


def test_rng_tracker_seeds_per_tp_rank_and_forks_cpu_state(single_results):
    r = single_results["rng_tracker"]
    assert r["tracker_class"] == "CpuRNGStatesTracker"
    assert r["names"] == ["data-parallel-rng", "expert-parallel-rng", "model-parallel-rng"]
    assert r["default_stream_untouched"] and r["fork_uses_tp_seed"] and r["cuda_state_is_cpu_state"]


@pytest.mark.parametrize("recompute", ["selective", "full"])
def test_activation_recompute_replays_dropout_exactly(single_results, recompute):
    r = single_results["recompute_with_dropout"]
    assert r[recompute] == {"loss_diff": 0.0, "grad_diff": 0.0}
    assert r["no_dropout"]["loss_diff"] > 1e-3, "dropout was not active, so the check proves nothing"


def test_cpu_mode_is_never_enabled_on_a_gpu_machine(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    current_device = torch.cuda.current_device
    assert megatron_cpu.auto_cpu_mode() is False
    assert megatron_cpu.dist_backend() == "nccl"
    with pytest.raises(RuntimeError, match="without a GPU"):
        megatron_cpu.enable_cpu_mode()
    assert torch.cuda.current_device is current_device
