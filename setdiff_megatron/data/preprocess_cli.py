"""`setdiff preprocess` / `tools/preprocess_data.py`: the command line of preprocess.py, and of
the built-in corpus (`--default-corpus`)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from setdiff_megatron.data.corpus import prepare_default_corpus
from setdiff_megatron.data.preprocess import PreprocessOptions, preprocess
from setdiff_megatron.data.supervised import RecordFields
from setdiff_megatron.data.tokenizers import load_tokenizer
from setdiff_megatron.errors import ArgumentParser, UserError
from setdiff_megatron.log import say

__all__ = ["build_parser", "preprocess_main"]


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(
        prog="setdiff preprocess",
        description="Tokenize corpora into megatron-core indexed datasets (.bin/.idx + manifest).",
    )
    parser.add_argument("--input", nargs="+", type=Path, help=".jsonl/.txt[.gz], .parquet or datasets dir")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--tokenizer", type=Path, help="tokenizer directory (GPT-2, Qwen3, Llama or ours)")
    parser.add_argument("--text-field", default="text", help="JSONL field or column holding the text")
    parser.add_argument(
        "--text-unit",
        choices=("paragraph", "line"),
        default="paragraph",
        help="what a document is in a plain text file",
    )
    parser.add_argument("--on-bad-line", choices=("stop", "skip"), default="stop")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--no-new-tokens", action="store_true", help="fail instead of adding a missing MASK/BOS/EOS/PAD token"
    )
    parser.add_argument("--quiet", action="store_true", help="no progress bar or summary")
    supervised = parser.add_argument_group("supervised records (recipes: format: supervised)")
    supervised.add_argument(
        "--supervised",
        action="store_true",
        help="write prompt/response records: the prompt pinned as context, the response the target",
    )
    supervised.add_argument("--prompt-field", default="prompt", help="field or column holding the prompt")
    supervised.add_argument("--response-field", default="response", help="field or column holding the response")
    supervised.add_argument(
        "--messages-field",
        default=None,
        help="a chat field instead (a list of {role, content}, the assistant's turn last), "
        "rendered with the tokenizer's chat template",
    )
    corpus = parser.add_argument_group("embedded default corpus (the Python standard library)")
    corpus.add_argument(
        "--default-corpus", action="store_true", help="train a byte-level BPE on the stdlib corpus and preprocess it"
    )
    corpus.add_argument("--vocab-size", type=int, default=4096)
    return parser


def preprocess_main(argv: list[str] | None = None) -> int:
    """`setdiff preprocess`: exit code 0, or 2 with one line on stderr for any UserError."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.default_corpus and (args.input or args.tokenizer):
        parser.error("--default-corpus takes no --input or --tokenizer")
    if not args.default_corpus and not (args.input and args.tokenizer):
        parser.error("--input and --tokenizer are required (or --default-corpus)")
    if args.messages_field and not args.supervised:
        parser.error("--messages-field needs --supervised")
    try:
        if args.default_corpus:
            prepare_default_corpus(
                args.output_dir, vocab_size=args.vocab_size, workers=args.workers, progress=not args.quiet
            )
        else:
            options = PreprocessOptions(
                text_field=args.text_field,
                text_unit=args.text_unit,
                on_bad_line=args.on_bad_line,
                workers=args.workers,
                progress=not args.quiet,
                supervised=RecordFields(args.prompt_field, args.response_field, args.messages_field)
                if args.supervised
                else None,
            )
            tokenizer = load_tokenizer(args.tokenizer, add_missing_tokens=not args.no_new_tokens)
            preprocess(args.input, args.output_dir, tokenizer, options)
    except UserError as exc:
        message = str(exc).replace("\n", " ")
        say(f"setdiff preprocess: error: {message}", file=sys.stderr, everywhere=True)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(preprocess_main())
