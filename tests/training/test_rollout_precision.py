"""RL's rollouts decode with FP8 off (training/engines/megatron_engine.py, `decoding`): megatron-core
runs any forward of a model whose config sets fp8 under an fp8 autocast, and Transformer
Engine's FP8 GEMMs refuse a decode step's token counts; the rollouts' scoring and training
forwards keep FP8, so the likelihoods GRPO compares come from one precision."""

from types import SimpleNamespace

import pytest

from setdiff_megatron.models.torch_model import SetDiffusionTransformer
from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.training.engines.megatron_engine import MegatronEngine
from setdiff_megatron.training.rollouts import Rollouts
from tests.conftest import debug_config


def _engine_with(config) -> MegatronEngine:
    engine = MegatronEngine.__new__(MegatronEngine)  # only what `decoding` reads
    engine.chunks = [SimpleNamespace(module=SimpleNamespace(config=config))]
    return engine


def test_the_megatron_engine_decodes_without_fp8_and_restores_it():
    config = SimpleNamespace(fp8="hybrid")
    engine = _engine_with(config)
    with engine.decoding():
        assert config.fp8 is None
    assert config.fp8 == "hybrid"
    with pytest.raises(RuntimeError), engine.decoding():
        raise RuntimeError("a failed rollout")
    assert config.fp8 == "hybrid"


def test_every_decode_forward_of_a_rollout_runs_inside_the_engines_decoding_context():
    model = SetDiffusionTransformer(debug_config()).eval()
    state = {"decoding": False, "forwards": 0, "outside": 0}

    class Decoding:
        def __enter__(self):
            state["decoding"] = True

        def __exit__(self, *exc):
            state["decoding"] = False

    step = model.step

    def counted(*args, **kwargs):
        state["forwards"] += 1
        state["outside"] += not state["decoding"]
        return step(*args, **kwargs)

    model.step = counted
    recipe = load_recipe("recipes/rl-reasoning.yaml", ["model.init_from=assets/reasoning-ar-base", "rl.group_size=2",
                                                       "rl.max_new_tokens=4"])  # fmt: skip
    tokenizer = SimpleNamespace(eos_id=1, mask_id=63)
    engine = SimpleNamespace(policy_model=lambda: model, decoding=Decoding)
    rollouts = Rollouts(recipe, SimpleNamespace(tokenizer=tokenizer), engine, dp_rank=0, dp_size=1)
    rows = rollouts._decode([(0, [2, 3, 4], {}), (1, [5, 6], {})])
    assert len(rows) == 4 and state["forwards"] > 0 and state["outside"] == 0
