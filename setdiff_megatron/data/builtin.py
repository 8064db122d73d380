"""The corpora every machine can build with no download, by the names recipes give them.

`data.datasets: [{path: stdlib}]` trains on the Python standard library's sources (corpus.py),
`[{path: reasoning}]` on generated multi-step arithmetic (reasoning.py), `[{path:
reasoning-chains}]` on its + and - solutions without the expression line, the study's infilling
corpus (chains.py). Each is prepared on first use under the run's data cache in one layout:
`tokenizer/`, and the indexed datasets `train` and `valid`. The reasoning corpus also holds its problems as supervised records
(`format: supervised`): `train-supervised` and `valid-supervised`.

A corpus this machine has built before, with this package's data code on this Python, is copied
from the machine's cache (`corpora/` under $SETDIFF_CACHE_DIR, default ~/.cache/setdiff_megatron)
instead of being built again: 20 s for the reasoning corpus on a CPU core, a copy of 70 MB.
"""

from __future__ import annotations

import functools
import hashlib
import os
import shutil
import sys
from pathlib import Path

from setdiff_megatron.data.preprocess import TOKENIZER_SUBDIR
from setdiff_megatron.machine_cache import machine_cache_dir
from setdiff_megatron.version import __version__

__all__ = ["builtin_corpus_dir", "prepare_builtin_corpus", "corpus_paths"]


def builtin_corpus_dir(name: str, cache: Path, vocab_size: int) -> Path:
    """Where corpus `name` lives under a data cache (the stdlib BPE depends on its vocabulary)."""
    return cache / (f"stdlib-bpe{vocab_size}" if name == "stdlib" else name)


def prepare_builtin_corpus(name: str, directory: Path, vocab_size: int, *, progress: bool = True) -> None:
    """Build corpus `name` (recipes.schema.BUILTIN_CORPORA) in `directory`; cheap when it is there.

    A new `directory` starts as a copy of the machine's cached build, which the builder then
    checks as it checks its own (records, hashes); a build that was not cached is left there."""
    cached = machine_cache_dir() / "corpora" / f"{directory.name}-{_code_key()}"
    if not directory.exists() and cached.is_dir():
        _copy_whole(cached, directory)  # or, where it cannot, the builder builds here
    _build(name, directory, vocab_size, progress=progress)
    if not cached.exists():
        _copy_whole(directory, cached)  # the cache is a convenience: a run goes on without it


@functools.cache
def _code_key() -> str:
    """What a cached corpus must have been built by: this package's data code on this Python."""
    digest = hashlib.sha256(f"{__version__} {sys.version}".encode())
    for source in sorted(Path(__file__).parent.glob("*.py")):
        digest.update(source.read_bytes())
    return digest.hexdigest()[:16]


def _copy_whole(source: Path, target: Path) -> None:
    """Copy `source` to `target` under a name of its own, then rename it into place, both ways
    (cache to run, run to cache): a reader sees a whole copy or none, so a copy cut short (a full
    disk, a kill) never passes for a corpus whose record was copied but whose documents were not,
    and two runs that race both finish. Where it cannot copy, it leaves nothing behind."""
    partial = target.with_name(f"{target.name}.{os.getpid()}.partial")
    try:
        shutil.copytree(source, partial)
        partial.rename(target)
    except OSError:
        shutil.rmtree(partial, ignore_errors=True)


def _build(name: str, directory: Path, vocab_size: int, *, progress: bool) -> None:
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
