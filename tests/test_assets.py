"""The pretrained AR base the main job adapts (assets/reasoning-ar-base, built by
tools/build_reasoning_ar_base.sh): shipped intact, and the model the main job's recipe expects."""

import hashlib
from pathlib import Path

from setdiff_megatron.recipes import load_recipe
from setdiff_megatron.sources.read import read_source

ROOT = Path(__file__).parents[1]
BASE = ROOT / "assets" / "reasoning-ar-base"


def test_every_shipped_file_matches_its_checksum():
    listed = dict(reversed(line.split()) for line in (BASE / "SHA256SUMS").read_text().splitlines())
    assert sorted(listed) == sorted(p.name for p in BASE.iterdir() if p.name != "SHA256SUMS")
    for name, digest in listed.items():
        assert hashlib.sha256((BASE / name).read_bytes()).hexdigest() == digest, name


def test_the_main_job_starts_from_it_at_its_size():
    recipe = load_recipe(ROOT / "recipes" / "tiny-reasoning.yaml")
    assert recipe.model.init_from == "assets/reasoning-ar-base"
    source = read_source(BASE)
    assert (source.config.num_layers, source.config.hidden_size) == (recipe.model.num_layers, recipe.model.hidden_size)
    assert source.config.max_seq_len == recipe.model.max_seq_len == 128
    text = "12+7=19\n#### 19"
    ids = source.tokenizer.encode(text)
    assert len(ids) == len(text) and source.tokenizer.decode(ids) == text  # the corpus's character tokens
