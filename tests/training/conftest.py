"""Fixtures of the training tests."""

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def data_cache(tmp_path_factory) -> Path:
    """The built-in corpus, prepared once per session for every checkpoint test module."""
    return tmp_path_factory.getbasetemp() / "checkpoint-tests-data"
