"""Tokenizers: a Hugging Face fast tokenizer plus the four token ids that set diffusion needs.

`load_tokenizer` resolves the MASK, BOS, EOS and PAD ids once (reusing a declared or well-known
token, adding a missing one) and `save()` writes the choice to `setdiff_tokenizer.json`, so every
stage reads the same ids. Text is encoded as text: special-token strings in a document stay
ordinary tokens (only `encode_markup`, for rendered chat templates, reads them as special).
`vocab_size` is the tokenizer's own, unpadded (docs/data.md, "Preprocessing").
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from setdiff_megatron.errors import UserError, require

SETDIFF_FILE = "setdiff_tokenizer.json"
ROLES = ("mask", "bos", "eos", "pad")

# When a directory declares no token for a role, the first of these found in its vocabulary is
# reused (`<|fim_middle|>` is the Qwen-family choice for MASK: never seen in ordinary text).
_KNOWN_TOKENS = {
    "mask": ("<|mask|>", "[MASK]", "<mask>", "<|fim_middle|>"),
    "bos": ("<|bos|>", "<s>", "<|begin_of_text|>", "<bos>"),
    "eos": ("<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"),
    "pad": ("<|pad|>", "<pad>", "[PAD]"),
}
# Added when nothing can be reused (and adding is allowed); also the trained BPE's specials.
_NEW_TOKENS = {"eos": "<|endoftext|>", "bos": "<|bos|>", "pad": "<|pad|>", "mask": "<|mask|>"}


def _tokenizers():
    return require("tokenizers", "data", "Tokenizing text")


class SetDiffTokenizer:
    """A `tokenizers.Tokenizer` with resolved MASK/BOS/EOS/PAD ids.

    Also satisfies what megatron-core's GPTDataset reads from a tokenizer: `eod`, `pad`,
    `vocab_size` and `unique_identifiers` (a JSON-able dict that keys its index cache).
    """

    def __init__(self, backend: Any, special_tokens: dict[str, str], *, hf_config: dict | None = None):
        """Wrap `backend` (a tokenizers.Tokenizer) whose vocabulary holds every role's token."""
        self._backend = backend
        self._hf_config = dict(hf_config or {})
        self.special_tokens = dict(special_tokens)
        ids = {}
        for role in ROLES:
            token_id = backend.token_to_id(special_tokens[role])
            if token_id is None:
                raise UserError(f"tokenizer has no token {special_tokens[role]!r} for {role}")
            ids[role] = token_id
        if ids["mask"] in (ids["bos"], ids["eos"], ids["pad"]):
            # A clean token and a query MASK must never look alike to the model.
            raise UserError("the MASK token must differ from the BOS, EOS and PAD tokens")
        self.mask_id, self.bos_id, self.eos_id, self.pad_id = (ids[r] for r in ROLES)
        # Documents are text: special-token strings inside them stay ordinary tokens.
        backend.encode_special_tokens = True
        self._markup_backend = None
        self.vocab_size = max(backend.get_vocab(with_added_tokens=True).values()) + 1
        digest = hashlib.sha256(backend.to_str().encode("utf-8"))
        digest.update(json.dumps(self.special_tokens, sort_keys=True).encode("utf-8"))
        self.sha256 = digest.hexdigest()

    # -- what megatron-core reads ------------------------------------------------------------
    @property
    def eod(self) -> int:
        """End-of-document id appended after every document (megatron's name for EOS)."""
        return self.eos_id

    @property
    def pad(self) -> int:
        return self.pad_id

    @property
    def unique_identifiers(self) -> dict[str, Any]:
        return {"class": type(self).__name__, "sha256": self.sha256}

    @property
    def chat_template(self) -> str | None:
        """The Jinja chat template its tokenizer_config.json declares (Qwen, Llama), if any."""
        template = self._hf_config.get("chat_template")
        return template if isinstance(template, str) else None

    def identity(self) -> dict[str, Any]:
        """What a preprocessing manifest records to tie its tokens to this tokenizer."""
        return {
            "sha256": self.sha256,
            "vocab_size": self.vocab_size,
            **{f"{role}_id": getattr(self, f"{role}_id") for role in ROLES},
        }

    # -- encoding ----------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        return self._backend.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [enc.ids for enc in self._backend.encode_batch_fast(list(texts), add_special_tokens=False)]

    def encode_markup(self, text: str) -> list[int]:
        """Ids of text whose special-token strings are the special tokens: a rendered chat
        template, whose `<|im_start|>`-style markup must reach the model as the tokens it was
        trained on (as transformers' apply_chat_template encodes it)."""
        if self._markup_backend is None:
            self._markup_backend = _tokenizers().Tokenizer.from_str(self._backend.to_str())
            self._markup_backend.encode_special_tokens = False
        return self._markup_backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int], *, skip_special_tokens: bool = False) -> str:
        return self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # -- persistence -------------------------------------------------------------------------
    def save(self, directory: str | Path) -> Path:
        """Write tokenizer.json, tokenizer_config.json (loadable by transformers) and our ids."""
        directory = Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        self._backend.save(str(directory / "tokenizer.json"))
        config = {k: v for k, v in self._hf_config.items() if k != "added_tokens_decoder"}
        config.setdefault("tokenizer_class", "PreTrainedTokenizerFast")
        config["clean_up_tokenization_spaces"] = False
        for role in ROLES:
            config[f"{role}_token"] = self.special_tokens[role]
        _write_json(directory / "tokenizer_config.json", config)
        ids = {r: {"token": self.special_tokens[r], "id": getattr(self, f"{r}_id")} for r in ROLES}
        _write_json(directory / SETDIFF_FILE, {"format": 1, "sha256": self.sha256, **ids})
        return directory

    def __getstate__(self) -> dict[str, Any]:
        # Spawned DataLoader workers pickle datasets and the tokenizer in their config; rebuilding
        # from JSON re-applies encode_special_tokens, which tokenizers does not serialize.
        return {
            "backend": self._backend.to_str(),
            "special_tokens": self.special_tokens,
            "hf_config": self._hf_config,
        }

    def __setstate__(self, state: dict[str, Any]) -> None:
        backend = _tokenizers().Tokenizer.from_str(state["backend"])
        self.__init__(backend, state["special_tokens"], hf_config=state["hf_config"])

    def __repr__(self) -> str:
        roles = ", ".join(f"{r}={getattr(self, r + '_id')}" for r in ROLES)
        return f"SetDiffTokenizer(vocab_size={self.vocab_size}, {roles})"


def load_tokenizer(directory: str | Path, *, add_missing_tokens: bool = True) -> SetDiffTokenizer:
    """Load a tokenizer directory: our own save, or a GPT-2 / Qwen3 / Llama style HF directory.

    Roles come from `setdiff_tokenizer.json` when present; otherwise from tokenizer_config.json /
    special_tokens_map.json, then well-known token strings. Missing tokens are added when
    `add_missing_tokens`; otherwise a missing MASK or EOS is an error and BOS/PAD fall back to EOS
    (the GPT-2 convention; padding is tracked by `pad_mask`, never by the pad id).
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise UserError(f"tokenizer directory not found: {directory}")
    tk = _tokenizers()
    backend = _load_backend(tk, directory)
    hf_config = _read_json(directory / "tokenizer_config.json")
    ours = directory / SETDIFF_FILE
    if ours.is_file():
        saved = _read_json(ours)
        return SetDiffTokenizer(backend, {r: saved[r]["token"] for r in ROLES}, hf_config=hf_config)
    declared = {**_read_json(directory / "special_tokens_map.json"), **hf_config}
    chosen: dict[str, str] = {}
    for role in ("eos", "mask", "bos", "pad"):
        token = _declared_token(declared.get(f"{role}_token"))
        candidates = ([token] if token else []) + list(_KNOWN_TOKENS[role])
        # A declared token may be any vocabulary entry; a merely well-known string only counts
        # when it is a registered special token (a BPE may have merged "<s>" from HTML text).
        added = {t.content for t in backend.get_added_tokens_decoder().values()}
        present = next(
            (c for c in candidates if c in added or (c == token and backend.token_to_id(c) is not None)),
            None,
        )
        if present is not None:
            chosen[role] = present
        elif add_missing_tokens:
            chosen[role] = token or _NEW_TOKENS[role]
            backend.add_special_tokens([tk.AddedToken(chosen[role], special=True, normalized=False)])
        elif role in ("bos", "pad"):
            chosen[role] = chosen["eos"]
        else:
            what = "MASK" if role == "mask" else "EOS"
            raise UserError(
                f"tokenizer in {directory} has no usable {what} token (tried "
                f"{', '.join(candidates)}) and adding tokens is not allowed"
            )
    return SetDiffTokenizer(backend, chosen, hf_config=hf_config)


def train_byte_level_bpe(
    texts: Iterable[str], vocab_size: int, *, min_frequency: int = 2, show_progress: bool = False
) -> SetDiffTokenizer:
    """Train a GPT-2 style byte-level BPE; EOS, BOS, PAD and MASK take ids 0..3.

    Byte-level BPE has no unknown token and decodes every string back exactly, which the
    preprocessing round trip relies on.
    """
    tk = _tokenizers()
    specials = [_NEW_TOKENS[r] for r in ("eos", "bos", "pad", "mask")]
    alphabet = tk.pre_tokenizers.ByteLevel.alphabet()
    if vocab_size < len(alphabet) + len(specials):
        raise UserError(f"vocab_size must be at least {len(alphabet) + len(specials)} for a byte-level BPE")
    backend = tk.Tokenizer(tk.models.BPE())
    backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = tk.decoders.ByteLevel()
    trainer = tk.trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=alphabet,
        show_progress=show_progress,
    )
    backend.train_from_iterator(texts, trainer)
    return SetDiffTokenizer(backend, dict(_NEW_TOKENS))


def _load_backend(tk: Any, directory: Path) -> Any:
    if (directory / "tokenizer.json").is_file():
        try:
            return tk.Tokenizer.from_file(str(directory / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - the Rust loader raises plain Exception
            raise UserError(f"cannot read {directory / 'tokenizer.json'}: {exc}") from exc
    vocab, merges = directory / "vocab.json", directory / "merges.txt"
    if vocab.is_file() and merges.is_file():
        # The classic GPT-2 files: byte-level BPE, as transformers' GPT2 converter builds it.
        backend = tk.Tokenizer(tk.models.BPE.from_file(str(vocab), str(merges)))
        backend.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        backend.decoder = tk.decoders.ByteLevel()
        if backend.token_to_id("<|endoftext|>") is not None:
            # GPT-2's one special token lives in vocab.json; register it as special as GPT-2 does.
            backend.add_special_tokens([tk.AddedToken("<|endoftext|>", special=True, normalized=False)])
        return backend
    if (directory / "tokenizer.model").is_file():
        raise UserError(
            f"{directory} has only a SentencePiece tokenizer.model; write tokenizer.json once with "
            "transformers: AutoTokenizer.from_pretrained(dir).save_pretrained(dir)"
        )
    raise UserError(f"no tokenizer.json or vocab.json + merges.txt in {directory}")


def _declared_token(value: Any) -> str | None:
    """A role as tokenizer_config.json spells it: a string, an AddedToken dict, or null."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from exc


def _write_json(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=True) + "\n", encoding="utf-8")
