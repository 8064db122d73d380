"""The corpora every machine can build with no download, by the names recipes give them.

`data.datasets: [{path: stdlib}]` trains on the Python standard library's sources (corpus.py),
`[{path: reasoning}]` on generated multi-step arithmetic (reasoning.py), `[{path:
reasoning-chains}]` on its + and - solutions without the expression line, the study's infilling
corpus (chains.py). Each is prepared on first use under the run's data cache in one layout:
`tokenizer/`, and the indexed datasets `train` and `valid`. The reasoning corpus also holds its problems as supervised records
(`format: supervised`): `train-supervised` and `valid-supervised`.
"""

from __future__ import annotations

from pathlib import Path

from setdiff_megatron.data.preprocess import TOKENIZER_SUBDIR

__all__ = ["builtin_corpus_dir", "prepare_builtin_corpus", "corpus_paths"]


def builtin_corpus_dir(name: str, cache: Path, vocab_size: int) -> Path:
    """Where corpus `name` lives under a data cache (the stdlib BPE depends on its vocabulary)."""
    return cache / (f"stdlib-bpe{vocab_size}" if name == "stdlib" else name)


def prepare_builtin_corpus(name: str, directory: Path, vocab_size: int, *, progress: bool = True) -> None:
    """Build corpus `name` (recipes.schema.BUILTIN_CORPORA) in `directory`; cheap when it is there."""
    if name == "stdlib":
        from setdiff_megatron.data.corpus import prepare_default_corpus

        prepare_default_corpus(directory, vocab_size, progress=progress)
    elif name == "reasoning-chains":
        from setdiff_megatron.data.chains import prepare_chains_corpus

        prepare_chains_corpus(directory, progress=progress)
    else:
        from setdiff_megatron.data.reasoning import prepare_reasoning_corpus

        prepare_reasoning_corpus(directory, progress=progress)


def corpus_paths(directory: Path, *, supervised: bool = False) -> tuple[Path, Path, Path]:
    """(tokenizer directory, train prefix, valid prefix) of a prepared built-in corpus."""
    suffix = "-supervised" if supervised else ""
    return directory / TOKENIZER_SUBDIR, directory / f"train{suffix}", directory / f"valid{suffix}"
