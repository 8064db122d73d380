"""SetDiffTokenizer: special-id resolution per layout, persistence, agreement with transformers."""

import json
import pickle

import pytest

from setdiff_megatron.data.tokenizers import SETDIFF_FILE, load_tokenizer, train_byte_level_bpe
from setdiff_megatron.errors import UserError
from tests.data.corpora import DOCUMENTS, training_texts


def test_trained_bpe_has_all_roles_and_round_trips(bpe_tokenizer):
    tok = bpe_tokenizer
    assert (tok.eos_id, tok.bos_id, tok.pad_id, tok.mask_id) == (0, 1, 2, 3)
    assert tok.eod == tok.eos_id and tok.pad == tok.pad_id and tok.vocab_size == 600
    for doc in DOCUMENTS:
        ids = tok.encode(doc)
        assert tok.decode(ids) == doc
        # special-token strings inside text stay text
        assert not {tok.eos_id, tok.mask_id, tok.bos_id, tok.pad_id} & set(ids)


def test_save_load_and_pickle_keep_identity(bpe_tokenizer, tmp_path):
    bpe_tokenizer.save(tmp_path / "tok")
    loaded = load_tokenizer(tmp_path / "tok", add_missing_tokens=False)
    assert loaded.sha256 == bpe_tokenizer.sha256
    assert loaded.unique_identifiers == bpe_tokenizer.unique_identifiers
    assert json.loads((tmp_path / "tok" / SETDIFF_FILE).read_text())["mask"]["id"] == 3
    clone = pickle.loads(pickle.dumps(bpe_tokenizer))
    assert clone.encode(DOCUMENTS[5]) == bpe_tokenizer.encode(DOCUMENTS[5])


def test_transformers_loads_the_saved_tokenizer(bpe_tokenizer, tmp_path):
    transformers = pytest.importorskip("transformers")
    bpe_tokenizer.save(tmp_path / "tok")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    assert (hf.mask_token_id, hf.bos_token_id, hf.eos_token_id, hf.pad_token_id) == (3, 1, 0, 2)
    assert hf.encode(DOCUMENTS[2], add_special_tokens=False) == bpe_tokenizer.encode(DOCUMENTS[2])


def test_gpt2_layouts_reuse_endoftext_and_add_mask(gpt2_dir, tmp_path):
    tok = load_tokenizer(gpt2_dir)
    assert tok.eos_id == 0  # <|endoftext|>
    assert tok.special_tokens["mask"] == "<|mask|>" and tok.mask_id >= 500
    assert len({tok.mask_id, tok.bos_id, tok.pad_id}) == 3
    # vocab.json + merges.txt only (the classic layout) gives the same tokens
    classic = tmp_path / "classic"
    classic.mkdir()
    for name in ("vocab.json", "merges.txt"):
        (classic / name).write_bytes((gpt2_dir / name).read_bytes())
    assert load_tokenizer(classic).encode(DOCUMENTS[4]) == tok.encode(DOCUMENTS[4])


def test_qwen_style_directory_reuses_fim_middle_as_mask(tmp_path):
    tok = train_byte_level_bpe(training_texts(), 400)
    qwen = tmp_path / "qwen"
    tok.save(qwen)
    (qwen / SETDIFF_FILE).unlink()
    spec = json.loads((qwen / "tokenizer.json").read_text())
    # Replace our specials by Qwen's: <|endoftext|> pad, <|im_end|> eos, FIM tokens, no BOS/MASK.
    spec["added_tokens"] = [
        {
            "id": i,
            "content": c,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_middle|>"])
    ]
    for i, c in enumerate(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|fim_middle|>"]):
        spec["model"]["vocab"] = {k: v for k, v in spec["model"]["vocab"].items() if v != i}
        spec["model"]["vocab"][c] = i
    (qwen / "tokenizer.json").write_text(json.dumps(spec))
    (qwen / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "tokenizer_class": "Qwen2Tokenizer",
            }
        )
    )
    loaded = load_tokenizer(qwen, add_missing_tokens=False)
    assert (loaded.mask_id, loaded.eos_id, loaded.pad_id) == (3, 2, 0)
    assert loaded.bos_id == loaded.eos_id  # no permission to add: BOS falls back to EOS
    added = load_tokenizer(qwen)
    assert added.special_tokens["bos"] == "<|bos|>" and added.bos_id == 400


def test_missing_mask_without_permission_is_a_user_error(gpt2_dir):
    with pytest.raises(UserError, match="no usable MASK token"):
        load_tokenizer(gpt2_dir, add_missing_tokens=False)


def test_bad_tokenizer_directories(tmp_path):
    with pytest.raises(UserError, match="not found"):
        load_tokenizer(tmp_path / "nope")
    with pytest.raises(UserError, match="no tokenizer.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"\0")
    with pytest.raises(UserError, match="SentencePiece"):
        load_tokenizer(tmp_path)
    with pytest.raises(UserError, match="vocab_size"):
        train_byte_level_bpe(["abc"], 100)
