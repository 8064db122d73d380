"""The machine's cache of built-in corpora (data/builtin.py): a corpus is built once per machine,
later runs start from a copy that their builder checks, and a cache that cannot be written costs
nothing but the copy."""

from pathlib import Path

import pytest

from setdiff_megatron.data import builtin


@pytest.fixture
def builds(monkeypatch, tmp_path) -> list[Path]:
    """The directories the (stand-in) builder was asked to fill; it writes corpus.txt where none is."""
    monkeypatch.setenv("SETDIFF_CACHE_DIR", str(tmp_path / "machine"))
    seen: list[Path] = []

    def build(name: str, directory: Path, vocab_size: int, *, progress: bool) -> None:
        seen.append(directory)
        if not (directory / "corpus.txt").exists():
            directory.mkdir(parents=True, exist_ok=True)
            (directory / "corpus.txt").write_text(f"built in {directory}")

    monkeypatch.setattr(builtin, "_build", build)
    return seen


def test_a_corpus_is_built_once_and_copied_into_later_runs(builds, tmp_path):
    first, second = tmp_path / "a" / "reasoning", tmp_path / "b" / "reasoning"
    builtin.prepare_builtin_corpus("reasoning", first, 0, progress=False)
    builtin.prepare_builtin_corpus("reasoning", second, 0, progress=False)
    # the second run's builder found the first build's files in its own directory
    assert (second / "corpus.txt").read_text() == f"built in {first}" == (first / "corpus.txt").read_text()
    assert builds == [first, second]
    assert [p.name.split("-")[0] for p in (tmp_path / "machine" / "corpora").iterdir()] == ["reasoning"]


def test_other_data_code_does_not_reuse_a_cached_corpus(builds, tmp_path, monkeypatch):
    builtin.prepare_builtin_corpus("reasoning", tmp_path / "a" / "reasoning", 0, progress=False)
    monkeypatch.setattr(builtin, "_code_key", lambda: "other")
    builtin.prepare_builtin_corpus("reasoning", tmp_path / "b" / "reasoning", 0, progress=False)
    assert (tmp_path / "b" / "reasoning" / "corpus.txt").read_text() == f"built in {tmp_path / 'b' / 'reasoning'}"


def test_a_cache_that_cannot_be_written_costs_the_run_nothing(builds, tmp_path, monkeypatch):
    (tmp_path / "machine").write_text("a file, not a directory")
    run = tmp_path / "a" / "reasoning"
    builtin.prepare_builtin_corpus("reasoning", run, 0, progress=False)
    assert (run / "corpus.txt").exists() and builds == [run]
    assert not list(tmp_path.glob("**/*.partial"))
