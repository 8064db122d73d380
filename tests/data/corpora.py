"""Small corpora the data tests write and tokenize."""

import json
from pathlib import Path

# Documents exercising what a round trip can get wrong: leading/trailing spaces, tabs, CRLF,
# unicode, special-token strings as plain text, long and one-character documents.
DOCUMENTS = [
    "The quick brown fox jumps over the lazy dog.",
    "  leading spaces and trailing spaces  ",
    "def f(x):\n\treturn x ** 2  # tab-indented\n",
    "line one\r\nline two with CRLF",
    "Unicode: naive cafe -> na\u00efve caf\u00e9, \u65e5\u672c\u8a9e, emoji \U0001f600.",
    "A literal <|endoftext|> and <|mask|> stay text.",
    "x",
    " ".join(f"word{i}" for i in range(400)),
]


def write_jsonl(path: Path, documents, field: str = "text") -> Path:
    with open(path, "w", encoding="utf-8") as stream:
        for doc in documents:
            stream.write(json.dumps({field: doc}) + "\n")
    return path


def training_texts() -> list[str]:
    return DOCUMENTS * 20 + [f"sample text number {i} with some words" for i in range(200)]


def write_synthetic_jsonl(path: Path, megabytes: float, seed: int = 0) -> Path:
    """About `megabytes` MB of JSONL prose made of random words (quick to write and tokenize)."""
    import random

    rng = random.Random(seed)
    letters = "abcdefghijklmnopqrstuvwxyz"
    words = ["".join(rng.choices(letters, k=rng.randint(1, 9))) for _ in range(3000)]
    sentences = [" ".join(rng.choices(words, k=rng.randint(5, 25))).capitalize() + "." for _ in range(4000)]
    target = int(megabytes * 1_000_000)
    written = 0
    with open(path, "w", encoding="utf-8") as stream:
        while written < target:
            text = " ".join(rng.choices(sentences, k=rng.randint(3, 30)))
            line = json.dumps({"id": written, "text": text}) + "\n"
            stream.write(line)
            written += len(line)
    return path
