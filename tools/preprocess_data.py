#!/usr/bin/env python
"""Megatron-LM style preprocessing script; the same as `setdiff preprocess`.

    python tools/preprocess_data.py --input corpus.jsonl --tokenizer TOKENIZER_DIR --output-dir data/

See setdiff_megatron/data/preprocess.py for formats, outputs and options.
"""

import sys
from pathlib import Path

# Runs from a checkout without installing the package, as Megatron-LM's tools do.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from setdiff_megatron.data.preprocess_cli import preprocess_main  # noqa: E402

if __name__ == "__main__":
    sys.exit(preprocess_main())
