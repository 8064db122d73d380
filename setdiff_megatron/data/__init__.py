"""Data for set diffusion: tokenizers, preprocessing to indexed datasets, corpora, samples.

- `tokenizers`: a Hugging Face fast tokenizer with resolved MASK/BOS/EOS/PAD ids, saved with it.
- `sources`: input formats (JSONL, text, Parquet, saved `datasets`), streamed record by record.
- `indexed`: megatron-core `.bin/.idx` datasets plus the manifest that marks them finished.
- `preprocess`: `setdiff preprocess` / `tools/preprocess_data.py`, multi-process and resumable.
- `corpus`: the embedded default corpus (the Python standard library's own sources).
- `samples`: packed, blended, resumable training samples; prompt/response records.
- `packing`: the megatron-core dataset classes behind `samples` (imported only when needed).

Nothing here is imported eagerly: megatron-core takes seconds to import.
"""
