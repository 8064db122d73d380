"""Batch-1 decoding against the reference implementation (kuleshov-group/setdlms), side by side.

Both sides decode the same prompt with a random model of the same size and layout (the paper's
DiT: vocabulary 513, hidden 256, 4 layers, 4 heads by default), window 4 and threshold 0.9
(a random model's confidences are flat, so one token a step), greedy, on the same number of
threads. The reference runs its SetDLM `generate` in its own environment
(benchmarks/reference_side.py); this project runs its set sampler as `setdiff sample` does with
no flags (compile=auto), and, for the record, with every step compiled (compile=on). Each round
starts every side in a fresh process, in alternating order, and each process decodes once to
warm up, then 5 times timed (their median: one decode of 0.2 s moves by 10 % from run to run on
this VM); the table gives each side's median tokens/s over the rounds and the
ratios to the reference's. Target (issue 68): ours >= 1.5x the reference's with the defaults.

    python -m benchmarks.reference --setdlm DIR [--python PY] [--rounds 5] [--timed 5] [--new-tokens 128]

DIR is a checkout of the reference at 549f0bbe35d3653c0d70c7e20e52a29523dcf0a9 and PY a Python
that imports it (default: this one; benchmarks/PERFORMANCE.md, "Against the reference", says how
to make its environment from PyPI, with no download at run time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import machine_info, save_results
from setdiff_megatron.errors import ArgumentParser

ROOT = Path(__file__).resolve().parents[1]
SIZE = {"vocab_size": 513, "hidden_size": 256, "num_layers": 4, "num_heads": 4}
OURS = ("auto", "on")
"""Our compile modes: the default a user gets, and every step compiled."""


def spec(prompt_len: int = 32, new_tokens: int = 128, threads: int = 2, timed: int = 5) -> dict:
    """The decode both sides run (benchmarks/profile.py profiles ours at the defaults)."""
    prompt = [(7 * i + 3) % (SIZE["vocab_size"] - 4) for i in range(prompt_len)]
    return {
        "size": SIZE,
        "length": prompt_len + new_tokens,
        "prompt": prompt,
        "new_tokens": new_tokens,
        "window": 4,
        "threshold": 0.9,
        "threads": threads,
        "d": 4,
        "timed": timed,
    }


def our_decode(spec: dict, compile_mode: str):
    """This project's side: (its set sampler over a random model of the spec's size, the prompt,
    the decoding settings)."""
    import torch

    from setdiff_megatron.models.config import DIT_BODY, ModelConfig
    from setdiff_megatron.models.torch_model import SetDiffusionTransformer
    from setdiff_megatron.sampling.decoding import DecodingConfig
    from setdiff_megatron.sampling.sampler import SetSampler

    torch.set_num_threads(spec["threads"])
    size, vocab = spec["size"], spec["size"]["vocab_size"]
    cfg = ModelConfig(
        vocab_size=vocab,
        mask_token_id=vocab - 1,
        hidden_size=size["hidden_size"],
        num_layers=size["num_layers"],
        num_heads=size["num_heads"],
        max_seq_len=spec["length"],
        **DIT_BODY,
    )
    torch.manual_seed(0)
    model = SetDiffusionTransformer(cfg).eval()
    sampler = SetSampler(model, mask_token_id=vocab - 1, context_len=spec["length"], compile=compile_mode)
    decoding = DecodingConfig(window=spec["window"], threshold=spec["threshold"], max_new_tokens=spec["new_tokens"])
    return sampler, spec["prompt"], decoding


def ours(spec: dict, compile_mode: str) -> dict:
    """The same decode in this process, warmed up once, then timed `timed` times (their median)."""
    sampler, prompt, decoding = our_decode(spec, compile_mode)
    sampler.generate([prompt], decoding)
    runs = []
    for _ in range(spec["timed"]):
        start = time.perf_counter()
        row = sampler.generate([prompt], decoding).rows[0]
        runs.append(time.perf_counter() - start)
    return {"seconds": sorted(runs)[(len(runs) - 1) // 2], "new_tokens": row.num_decoded, "steps": row.steps}


def _run(argv: list[str]) -> dict:
    out = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv[:3])} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict | None:
    parser = ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setdlm", type=Path, help="a checkout of kuleshov-group/setdlms (at the commit above)")
    parser.add_argument("--python", default=sys.executable, help="a Python that imports the reference")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--timed", type=int, default=5, help="timed decodes per process, after one warm-up")
    parser.add_argument("--ours", choices=OURS, help=argparse.SUPPRESS)  # a round's process of this side
    parser.add_argument("--spec", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.ours:
        print(json.dumps(ours(json.loads(args.spec.read_text()), args.ours)))
        return None
    if args.setdlm is None or not (args.setdlm / "src" / "denoiser" / "setdlm.py").is_file():
        print(
            "benchmarks.reference needs --setdlm DIR, a checkout of kuleshov-group/setdlms, and --python, a "
            "Python that imports it (benchmarks/PERFORMANCE.md, 'Against the reference')"
        )
        return None
    settings = spec(args.prompt_len, args.new_tokens, args.threads, args.timed)
    with tempfile.TemporaryDirectory() as scratch:
        spec_file = Path(scratch) / "spec.json"
        spec_file.write_text(json.dumps(settings))
        sides = {
            "reference": [args.python, "-m", "benchmarks.reference_side", str(args.setdlm.resolve()), str(spec_file)],
            **{
                f"ours ({mode})": [
                    sys.executable,
                    "-m",
                    "benchmarks.reference",
                    "--ours",
                    mode,
                    "--spec",
                    str(spec_file),
                ]
                for mode in OURS
            },
        }
        runs: dict[str, list[dict]] = {name: [] for name in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                runs[name].append(_run(sides[name]))
    rates = {name: statistics.median(x["new_tokens"] / x["seconds"] for x in done) for name, done in runs.items()}
    print(
        f"batch 1, vocabulary {SIZE['vocab_size']}, hidden {SIZE['hidden_size']}, {SIZE['num_layers']} layers, "
        f"{SIZE['num_heads']} heads; prompt {args.prompt_len}, {args.new_tokens} new tokens, window 4, threshold 0.9, "
        f"{args.threads} threads; median of {args.rounds} fresh-process rounds"
    )
    print("| side | tokens/s | steps | x reference |\n|---|---|---|---|")
    for name, rate in rates.items():
        print(f"| {name} | {rate:.1f} | {runs[name][-1]['steps']} | {rate / rates['reference']:.2f} |")
    payload = {"settings": settings, "runs": runs, "tokens_per_s": rates}
    payload["ratio_to_reference"] = {name: rate / rates["reference"] for name, rate in rates.items()}
    save_results("reference", payload | {"machine": machine_info()})
    return payload


if __name__ == "__main__":
    main()
