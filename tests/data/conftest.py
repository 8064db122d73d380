"""Fixtures for the data tests: tokenizers trained here (no hub), tiny corpora, the slow marker.

Slow tests (`@pytest.mark.slow`: the 200 MB preprocessing run, the full default corpus) run with
`--runslow`, SETDIFF_RUN_SLOW=1, or the repository's `-m slow`; otherwise they are skipped.
"""

import os
import shutil
from pathlib import Path

import pytest

from setdiff_megatron.data.tokenizers import SetDiffTokenizer, train_byte_level_bpe
from tests.data.corpora import training_texts


def pytest_addoption(parser):
    try:
        parser.addoption("--runslow", action="store_true", default=False, help="run tests marked slow")
    except ValueError:  # another conftest already registered it
        pass


def _run_slow(config) -> bool:
    markexpr = config.getoption("markexpr", default="") or ""
    selected = "slow" in markexpr and "not slow" not in markexpr
    asked = config.getoption("--runslow", default=False) or os.environ.get("SETDIFF_RUN_SLOW") == "1"
    return selected or asked


def pytest_configure(config):
    config.addinivalue_line("markers", "slow: long-running; needs --runslow, SETDIFF_RUN_SLOW=1 or -m slow")
    if _run_slow(config) and (config.getoption("markexpr", default="") or "").strip() == "not slow":
        # pytest.ini's addopts deselects slow tests; --runslow and the variable lift that.
        config.option.markexpr = ""


def pytest_collection_modifyitems(config, items):
    if _run_slow(config):
        return
    skip = pytest.mark.skip(reason="slow: use --runslow, SETDIFF_RUN_SLOW=1 or -m slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def bpe_tokenizer() -> SetDiffTokenizer:
    return train_byte_level_bpe(training_texts(), 600)


@pytest.fixture(scope="session")
def gpt2_dir(tmp_path_factory) -> Path:
    """A GPT-2 style directory made locally: vocab.json + merges.txt from a BPE trained here,
    loaded by transformers' GPT2 tokenizer and saved, as the hub's gpt2 repo holds them."""
    transformers = pytest.importorskip("transformers")
    tokenizers = pytest.importorskip("tokenizers")
    root = tmp_path_factory.mktemp("gpt2")
    backend = tokenizers.Tokenizer(tokenizers.models.BPE())
    backend.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = tokenizers.trainers.BpeTrainer(
        vocab_size=500,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(training_texts(), trainer)
    raw = root / "raw"
    raw.mkdir()
    backend.model.save(str(raw))
    hf = transformers.GPT2TokenizerFast(vocab=str(raw / "vocab.json"), merges=str(raw / "merges.txt"))
    directory = root / "gpt2"
    hf.save_pretrained(str(directory))
    for name in ("vocab.json", "merges.txt"):
        shutil.copy(raw / name, directory / name)
    return directory
