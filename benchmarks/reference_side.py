"""The reference's side of benchmarks/reference.py, run by the reference's own Python (its checkout's
environment, not this project's: it imports nothing of setdiff_megatron), from this repository's
root (as a module: run as a file, its folder's profile.py would shadow the standard library's):

    PYTHON -m benchmarks.reference_side SETDLM_DIR SPEC_JSON

SPEC_JSON (written by benchmarks/reference.py) holds the model's size, the prompt, the number of
new tokens, the window, the threshold and the threads. The reference's SetDLM denoiser is built
over its DiT backbone at that size with tests/fixtures/make_reference_fixtures.py's helpers (the
reference's `src` importable, composer stood in for, its SetDLM config), at seed 0 (a random model: its confidences are flat, so the
policy alone sets the pace), and its batch-1 `generate` decodes the prompt once to warm up, then
the spec's `timed` times, with the generation settings of the paper's harness (its SetDLM fixtures' settings:
predict_and_noise, confidence-based noising, the set diffusion KV cache). Prints one JSON line:
the timed runs' median seconds, new tokens and decode steps.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
"""make_reference_fixtures.py, whose helpers build the reference's SetDLM the way the fixtures do."""


def _tokenizer(vocab_size: int, directory: Path):
    """A word-level tokenizer of vocab_size ids, its last four EOS, BOS, PAD and MASK."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<eos>", "<bos>", "<pad>", "<mask>"]
    words = vocab_size - len(specials)
    vocab = {f"w{i}": i for i in range(words)} | {token: words + i for i, token in enumerate(specials)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.add_special_tokens(specials)
    backend.save(str(directory / "tokenizer.json"))
    roles = dict(zip(("eos_token", "bos_token", "pad_token", "mask_token"), specials))
    return PreTrainedTokenizerFast(tokenizer_file=str(directory / "tokenizer.json"), **roles)


def build(spec: dict, scratch: Path):
    from make_reference_fixtures import denoiser_config
    from src.denoiser.setdlm import SetDLM

    size, length = spec["size"], spec["length"]
    vocab = size["vocab_size"]
    ids = {"vocab_size": vocab, "eos_token_id": vocab - 4, "bos_token_id": vocab - 3}
    ids |= {"pad_token_id": vocab - 2, "mask_token_id": vocab - 1}
    backbone = {
        "_target_": "src.backbone.dit.DIT",
        "length": length,
        "causal_attention": False,
        "adaln": False,
        "hidden_size": size["hidden_size"],
        "cond_dim": 128,
        "n_heads": size["num_heads"],
        "num_layers": size["num_layers"],
        "dropout": 0.0,
        "tie_word_embeddings": False,
        "vocab_size": vocab,
        "block_size": length,
        "attn_backend": "sdpa",
        "pretrained_model_name_or_path": None,
    }
    config = denoiser_config(backbone, length=length, d=spec["d"], **ids)
    import torch

    torch.manual_seed(0)
    return SetDLM(config, tokenizer=_tokenizer(vocab, scratch)).eval(), ids["mask_token_id"]


def main(checkout: Path, spec: dict) -> dict:
    sys.path.insert(0, str(FIXTURES))
    from make_reference_fixtures import import_reference

    import_reference(checkout)  # its src importable, composer stood in for
    import torch
    from src.denoiser.diffusion_config import SetDiffusionGenerationConfig

    torch.set_num_threads(spec["threads"])
    with tempfile.TemporaryDirectory() as scratch:
        model, mask = build(spec, Path(scratch))
    config = SetDiffusionGenerationConfig(
        max_window_size=spec["window"],
        first_hitting=False,
        sampling_strategy="predict_and_noise",
        noise_removal=False,
        confidence_based_noising=True,
        confidence_threshold=spec["threshold"],
        align_inputs_to_blocks=False,
        block_size=spec["length"],
        do_sample=False,
        use_cache=True,
        pad_token_id=mask,
    )
    prompt = torch.tensor([spec["prompt"]])
    runs = []
    with torch.no_grad():
        for _ in range(1 + spec.get("timed", 1)):  # a warm-up, then the timed runs
            start = time.perf_counter()
            out = model.generate(
                prompt,
                generation_config=config,
                max_new_tokens=spec["new_tokens"],
                return_dict_in_generate=True,
                disable_pbar=True,
            )
            runs.append(time.perf_counter() - start)
    new = int((out.sequences[0, len(spec["prompt"]) :] != mask).sum())
    return {
        "seconds": sorted(runs[1:])[(len(runs) - 2) // 2],
        "new_tokens": new,
        "steps": round(new / out.parallelism_factor),
    }


if __name__ == "__main__":
    print(json.dumps(main(Path(sys.argv[1]), json.loads(Path(sys.argv[2]).read_text()))))
