"""A preview of the main job: a short single-process run of the torch model on a built-in corpus.

It needs nothing but torch: the corpus is the Python standard library's own source, read as
bytes (vocabulary 256 + MASK), cut into windows of `seq_len`, split by file into train and
held-out parts. It trains with the staggered order policy and reports the held-out loss before
and after, then saves the weights and a JSON log. The megatron-core engine and YAML recipes
replace it as the main job once they land; until then this is what `setdiff train` runs.
"""

from __future__ import annotations

import json
import math
import sysconfig
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from setdiff_megatron.core.orders import Staggered
from setdiff_megatron.models.config import FLAVORS, ModelConfig
from setdiff_megatron.models.torch_model import SetDiffusionTransformer

BYTE_VOCAB = 256
MASK_ID = BYTE_VOCAB


@dataclass(kw_only=True)
class PreviewConfig:
    out_dir: str = "runs/preview"
    steps: int = 300
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 2e-3
    d: int = 4
    corpus_bytes: int = 2_000_000
    eval_batches: int = 8
    seed: int = 0


def stdlib_byte_windows(seq_len: int, max_bytes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train, held-out) windows [N, seq_len] of stdlib source bytes; every 20th file is held out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.glob("*.py") if p.is_file())
    if not files:
        raise FileNotFoundError(f"no Python standard library sources under {root}")
    parts: tuple[list[bytes], list[bytes]] = ([], [])
    total = 0
    for i, path in enumerate(files):
        data = path.read_bytes()
        parts[i % 20 == 0].append(data)
        total += len(data)
        if total >= max_bytes:
            break

    def windows(chunks: list[bytes]) -> torch.Tensor:
        flat = torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).long()
        n = len(flat) // seq_len
        return flat[: n * seq_len].view(n, seq_len)

    return windows(parts[0]), windows(parts[1])


@torch.no_grad()
def held_out_loss(model: SetDiffusionTransformer, data: torch.Tensor, cfg: PreviewConfig, policy) -> float:
    gen = torch.Generator().manual_seed(cfg.seed + 1)  # the same orders at every evaluation
    model.eval()
    total = count = 0.0
    for i in range(cfg.eval_batches):
        batch = data[i * cfg.batch_size:(i + 1) * cfg.batch_size]
        out = model.loss(batch, policy, generator=gen)
        total += out.nll_sum.sum().item()
        count += out.num_tokens.sum().item()
    model.train()
    return total / count


def run_preview(cfg: PreviewConfig) -> dict:
    torch.manual_seed(cfg.seed)
    train, valid = stdlib_byte_windows(cfg.seq_len, cfg.corpus_bytes)
    model_cfg = ModelConfig(vocab_size=BYTE_VOCAB + 1, mask_token_id=MASK_ID,
                            **{**FLAVORS["tiny"], "max_seq_len": cfg.seq_len})
    model = SetDiffusionTransformer(model_cfg)
    policy = Staggered(d=cfg.d)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / 20) * 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps))
    )
    gen = torch.Generator().manual_seed(cfg.seed)
    out_dir = Path(cfg.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    log = {"config": asdict(cfg), "model": asdict(model_cfg), "train_loss": []}
    log["valid_loss_before"] = held_out_loss(model, valid, cfg, policy)
    start = time.perf_counter()
    bar = tqdm(range(cfg.steps), desc="preview", unit="step")
    for step in bar:
        batch = train[torch.randint(0, len(train), (cfg.batch_size,), generator=gen)]
        loss = model.loss(batch, policy, generator=gen).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        log["train_loss"].append(round(loss.item(), 4))
        bar.set_postfix(loss=f"{loss.item():.3f}")
    elapsed = time.perf_counter() - start
    log["valid_loss_after"] = held_out_loss(model, valid, cfg, policy)
    log["tokens_per_s"] = cfg.steps * cfg.batch_size * cfg.seq_len / elapsed
    torch.save(model.state_dict(), out_dir / "model.pt")
    (out_dir / "log.json").write_text(json.dumps(log, indent=1))
    return log
