"""The embedded default corpus: the standard library's sources, split, tokenized, preprocessed."""

import json
import time

import pytest

from setdiff_megatron.data.corpus import prepare_default_corpus, stdlib_documents, write_stdlib_corpus
from setdiff_megatron.data.indexed import open_indexed, read_manifest
from setdiff_megatron.data.preprocess_cli import preprocess_main
from setdiff_megatron.data.tokenizers import load_tokenizer


def test_stdlib_documents_are_sorted_sources_without_tests():
    documents = stdlib_documents(max_bytes=None)
    paths = [path for path, _ in documents]
    assert paths == sorted(paths) and len(paths) > 300
    assert "os.py" in paths and "json/decoder.py" in paths
    assert not any(
        set(p.split("/")[:-1]) & {"test", "tests", "idle_test", "site-packages"} or p.split("/")[-1].startswith("test_")
        for p in paths
    )
    capped = stdlib_documents(max_bytes=500_000)
    assert set(p for p, _ in capped) < set(paths)
    assert 300_000 < sum(len(t.encode()) for _, t in capped) < 800_000
    # evenly spread, not the first files alphabetically
    assert capped[-1][0][0] > "s"


def test_every_twentieth_document_is_held_out(tmp_path):
    train, valid = write_stdlib_corpus(tmp_path, max_bytes=400_000)
    documents = stdlib_documents(max_bytes=400_000)
    held_out = [json.loads(line)["path"] for line in valid.open()]
    assert held_out == [path for i, (path, _) in enumerate(documents) if i % 20 == 19]
    assert sum(1 for _ in train.open()) + len(held_out) == len(documents)


def test_prepare_default_corpus_round_trips_and_reruns_cheaply(tmp_path):
    corpus = prepare_default_corpus(tmp_path, vocab_size=512, max_bytes=1_000_000, workers=1, progress=False)
    tokenizer = load_tokenizer(corpus.tokenizer_dir)
    assert tokenizer.vocab_size == 512
    valid_docs = [json.loads(line)["text"] for line in (tmp_path / "raw" / "valid.jsonl").open()]
    dataset = open_indexed(corpus.valid_prefix)
    assert [tokenizer.decode(dataset[i][:-1]) for i in range(len(dataset))] == valid_docs
    assert read_manifest(corpus.train_prefix)["documents"] > 10 * len(valid_docs) > 0
    stamp = corpus.train_prefix.with_suffix(".bin").stat().st_mtime_ns
    again = prepare_default_corpus(tmp_path, vocab_size=512, max_bytes=1_000_000, workers=1, progress=False)
    assert load_tokenizer(again.tokenizer_dir).sha256 == tokenizer.sha256
    assert corpus.train_prefix.with_suffix(".bin").stat().st_mtime_ns == stamp


@pytest.mark.slow
def test_the_full_default_corpus_builds_both_splits(tmp_path, capsys):
    """`setdiff preprocess --default-corpus` at its full size (the capped standard library, 2
    workers): every non-empty document of each split is in its dataset. Its time is printed, not
    held to a bound (recipes/tiny-cpu.yaml trains on it; docs/data.md records what it took here)."""
    start = time.perf_counter()
    assert preprocess_main(["--default-corpus", "--output-dir", str(tmp_path), "--workers", "2"]) == 0
    seconds = time.perf_counter() - start
    counts = {}
    for split in ("train", "valid"):
        texts = [json.loads(line)["text"] for line in (tmp_path / "raw" / f"{split}.jsonl").open()]
        manifest = read_manifest(tmp_path / split)
        counts[split] = manifest["documents"]
        assert counts[split] == sum(1 for t in texts if t) and manifest["tokens"] > 100 * counts[split]
    assert counts["train"] > 15 * counts["valid"] > 0
    with capsys.disabled():
        print(f"\ndefault corpus: {counts['train']} train and {counts['valid']} valid documents, {seconds:.1f}s")
