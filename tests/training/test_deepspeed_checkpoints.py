"""DeepSpeed-engine checkpoints that cannot be used, refused with a reason (no processes started;
the round trips are in test_deepspeed_engine.py)."""

import json
from pathlib import Path

import pytest

from setdiff_megatron.errors import UserError
from setdiff_megatron.sources.deepspeed_checkpoints import consolidated_state_dict
from setdiff_megatron.training.engines.deepspeed_engine import layout_refusal

HERE = {"engine": "deepspeed", "zero_stage": 2, "dp": 2, "optimizer": "DeepSpeedZeroOptimizer"}


@pytest.mark.parametrize(
    "saved,fragment",
    [
        ({"tp": 1, "pp": 1, "dp": 2}, "was written by the megatron engine"),
        (
            {**HERE, "zero_stage": 3, "optimizer": "DeepSpeedZeroOptimizer_Stage3"},
            "zero_stage 3 there, 2 here; optimizer DeepSpeedZeroOptimizer_Stage3 there, DeepSpeedZeroOptimizer here",
        ),
        ({**HERE, "dp": 4}, "dp 4 there, 2 here"),
    ],
)
def test_resume_on_another_layout_is_refused(saved, fragment):
    assert fragment in layout_refusal(Path("ckpt"), saved, HERE)


def test_resume_on_the_same_layout_is_allowed():
    assert (
        layout_refusal(Path("ckpt"), {**HERE, "offload_optimizer": True}, {**HERE, "offload_optimizer": False}) is None
    )


def test_consolidation_refuses_what_it_cannot_read(tmp_path):
    with pytest.raises(UserError, match="is not a directory"):
        consolidated_state_dict(tmp_path / "absent")
    (tmp_path / "manifest.json").write_text(json.dumps({"files": {}}))  # complete, but not DeepSpeed's
    with pytest.raises(UserError, match=r"not a checkpoint of the deepspeed engine \(no deepspeed/ folder"):
        consolidated_state_dict(tmp_path)
