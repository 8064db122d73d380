"""Packed samples (megatron-core GPTDataset + blending) and resumable loading (supervised rows:
test_supervised.py)."""

import pytest
import torch

from setdiff_megatron.data.preprocess import PreprocessOptions, preprocess
from setdiff_megatron.data.samples import PretrainingBatchSampler, ResumableLoader, build_datasets
from setdiff_megatron.errors import UserError
from tests.data.corpora import write_jsonl

L = 32
QUIET = PreprocessOptions(workers=1, progress=False)


@pytest.fixture(scope="module")
def corpus(bpe_tokenizer, tmp_path_factory):
    """Three preprocessed datasets: "docs" (varied documents), "a" and "b" (one token each)."""
    root = tmp_path_factory.mktemp("samples")
    docs = [f"document {i}: " + " ".join(f"w{i}x{j}" for j in range(3 + (i * 7) % 40)) for i in range(300)]
    write_jsonl(root / "docs.jsonl", docs)
    write_jsonl(root / "a.jsonl", ["a" * (10 + i % 30) for i in range(400)])
    write_jsonl(root / "b.jsonl", ["b" * (10 + i % 30) for i in range(400)])
    preprocess([root / "docs.jsonl", root / "a.jsonl", root / "b.jsonl"], root / "out", bpe_tokenizer, QUIET)
    return root, docs


def build(corpus, tokenizer, cache, **kwargs):
    root, _ = corpus
    prefixes = kwargs.pop("prefixes", [root / "out" / "docs"])
    return build_datasets(prefixes, tokenizer, sequence_length=L, cache_dir=cache, **kwargs)


def test_packed_samples_have_length_L_and_keep_document_boundaries(corpus, bpe_tokenizer, tmp_path):
    _, docs = corpus
    splits = build(corpus, bpe_tokenizer, tmp_path, split="90,10,0")
    assert splits["test"] is None and len(splits["valid"]) > 0
    encoded = [tuple(bpe_tokenizer.encode(d)) for d in docs]
    whole = set(encoded)
    train = splits["train"]
    assert len(train) > 50
    for i in range(len(train)):
        sample = train[i]
        assert sample["tokens"].shape == (L,) and sample["tokens"].dtype == torch.int64
        assert sample["prompt_mask"].dtype == torch.bool and not sample["prompt_mask"].any()
        assert not sample["pad_mask"].any()
        # A window of EOS-terminated documents: inner pieces are whole documents, the first
        # piece ends one, the last begins one; without an EOS it lies inside one document.
        pieces = [tuple(p) for p in _split_at(sample["tokens"].tolist(), bpe_tokenizer.eos_id)]
        if len(pieces) == 1:
            assert any(_contains(d, pieces[0]) for d in encoded)
            continue
        assert all(p in whole for p in pieces[1:-1])
        assert any(d[len(d) - len(pieces[0]) :] == pieces[0] for d in encoded)
        assert any(d[: len(pieces[-1])] == pieces[-1] for d in encoded)


def _contains(document, piece):
    return any(document[i : i + len(piece)] == piece for i in range(len(document) - len(piece) + 1))


def _split_at(ids, eos):
    pieces, current = [], []
    for token in ids:
        if token == eos:
            pieces.append(current)
            current = []
        else:
            current.append(token)
    return pieces + [current]


def test_same_seed_same_samples_other_seed_other_order(corpus, bpe_tokenizer, tmp_path):
    first = build(corpus, bpe_tokenizer, tmp_path / "one", seed=7)["train"]
    again = build(corpus, bpe_tokenizer, tmp_path / "two", seed=7)["train"]
    cached = build(corpus, bpe_tokenizer, tmp_path / "one", seed=7)["train"]  # from the index cache
    other = build(corpus, bpe_tokenizer, tmp_path / "three", seed=8)["train"]
    tokens = [first[i]["tokens"] for i in range(40)]
    assert all(torch.equal(t, again[i]["tokens"]) for i, t in enumerate(tokens))
    assert all(torch.equal(t, cached[i]["tokens"]) for i, t in enumerate(tokens))
    assert not all(torch.equal(t, other[i]["tokens"]) for i, t in enumerate(tokens))
    assert any((tmp_path / "one").iterdir())  # megatron's indices are cached in the run dir


def test_resuming_at_sample_n_continues_exactly(corpus, bpe_tokenizer, tmp_path):
    train = build(corpus, bpe_tokenizer, tmp_path)["train"]
    loader = ResumableLoader(train, micro_batch_size=4, num_workers=1)  # prefetching worker
    batches = iter(loader)
    for _ in range(3):
        next(batches)
    state = loader.state_dict()
    assert state == {"consumed_samples": 12}
    resumed = ResumableLoader(train, micro_batch_size=4)
    resumed.load_state_dict(state)
    batch = next(iter(resumed))
    expected = torch.stack([train[i]["tokens"] for i in range(12, 16)])
    assert torch.equal(batch["tokens"], expected) and batch["prompt_mask"].shape == (4, L)
    assert torch.equal(next(batches)["tokens"], expected)
    start = ResumableLoader(train, micro_batch_size=1, consumed_samples=5)
    assert torch.equal(next(iter(start))["tokens"][0], train[5]["tokens"])


def test_data_parallel_ranks_take_megatron_order():
    rank0 = list(PretrainingBatchSampler(10, micro_batch_size=2, dp_rank=0, dp_size=2))
    rank1 = list(PretrainingBatchSampler(10, micro_batch_size=2, dp_rank=1, dp_size=2))
    assert rank0 == [[0, 1], [4, 5]] and rank1 == [[2, 3], [6, 7]]
    assert list(PretrainingBatchSampler(10, micro_batch_size=2, consumed_samples=4, dp_size=2)) == [[4, 5]]


def test_blend_weights_give_proportions_within_two_percent(corpus, bpe_tokenizer, tmp_path):
    root, _ = corpus
    a_token = bpe_tokenizer.encode("a" * 10)[0]
    splits = build(
        corpus,
        bpe_tokenizer,
        tmp_path,
        prefixes=[root / "out" / "a", root / "out" / "b"],
        weights=[0.7, 0.3],
        num_samples=(10_000, 100, 0),
        split="90,10,0",
    )
    train = splits["train"]
    assert len(train) == 10_000
    from_a = sum(bool((train[i]["tokens"] == a_token).any()) for i in range(10_000))
    assert abs(from_a / 10_000 - 0.7) < 0.02


def test_prepend_bos_keeps_position_zero_clean(corpus, bpe_tokenizer, tmp_path):
    plain = build(corpus, bpe_tokenizer, tmp_path / "plain")["train"]
    with_bos = build(corpus, bpe_tokenizer, tmp_path / "bos", prepend_bos=True)["train"]
    sample = with_bos[0]
    assert sample["tokens"].shape == (L,) and sample["tokens"][0] == bpe_tokenizer.bos_id
    assert sample["prompt_mask"].tolist() == [True] + [False] * (L - 1)
    assert bpe_tokenizer.bos_id not in plain[0]["tokens"].tolist()


def test_sample_building_refuses_bad_inputs(corpus, bpe_tokenizer, gpt2_dir, tmp_path):
    from setdiff_megatron.data.tokenizers import load_tokenizer

    root, _ = corpus
    with pytest.raises(UserError, match="different tokenizer"):
        build(corpus, load_tokenizer(gpt2_dir), tmp_path)
    with pytest.raises(UserError, match="not a finished"):
        build(corpus, bpe_tokenizer, tmp_path, prefixes=[root / "out" / "nothing"])
    with pytest.raises(UserError, match="weighted blend"):
        two = [root / "out" / "a", root / "out" / "b"]
        build(corpus, bpe_tokenizer, tmp_path, prefixes=two, weights=[1, 1])
