"""Generation-order policies for set diffusion (docs/method.md, "Order policies").

A set diffusion model is trained on one sampled permutation per sequence: the order in which the
positions are revealed. Every policy here gives each position a "reveal score" (for the staggered
schedule: its first-hitting time T_i) and positions are revealed in DECREASING score order. Keeping
the policy a pure score function lets one vectorised routine, `sample_order`, handle prompts and
padding identically for every policy, and makes AR and the uniform and block orders (those MDLM's and
BD3-LM's masking imply; the models trained with them are still set diffusion) simple special cases.

Shape-suffix legend for tensor names: B = batch size, L = sequence length.
Example: `scores_BL` is a [B, L] tensor, `loc_L` a [L] tensor.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import MISSING, dataclass, fields
from typing import Any, ClassVar

import torch

__all__ = [
    "OrderError",
    "default_max_set_size",
    "PAPER_THRESHOLD",
    "PaperDecoding",
    "OrderPolicy",
    "Staggered",
    "LeftToRight",
    "Uniform",
    "Block",
    "make_order_policy",
    "sample_order",
    "sample_record_order",
]

Device = torch.device | str | None

UNIFORM_WINDOW = 16
"""The window a uniform-order model decodes with: any position may come next, so the window is
a speed knob, not the order's own set size."""
PAPER_THRESHOLD = 0.9
"""The confidence threshold the paper decodes its parallel models with (tau, docs/method.md)."""


@dataclass(frozen=True, kw_only=True)
class PaperDecoding:
    """The decoding settings (sampling/decoding.py) a model's paper default sets; the rest keep their defaults."""

    window: int
    threshold: float | None = None
    """None: off."""
    block_size: int | None = None
    cache_infill_input: bool = False
    align_inputs_to_blocks: bool = True

    def settings(self) -> dict[str, Any]:
        """The settings this sets, by name: the window and those off their defaults here."""
        return {
            f.name: getattr(self, f.name)
            for f in fields(self)
            if f.default is MISSING or getattr(self, f.name) != f.default
        }


class OrderError(ValueError):
    """An order law that cannot be: `field` names the knob at fault (d, m, k, b, size), so a recipe
    can report it as its own key."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


def default_max_set_size(d: int) -> int:
    """m when none is given: 2d, the reference config's default."""
    return 2 * d


def _check_length(length: int) -> None:
    if length < 1:
        raise ValueError(f"length must be >= 1, got {length}")


def _resolve_device(device: Device, generator: torch.Generator | None) -> torch.device:
    # Random numbers must be drawn where the generator lives, so default to its device.
    if device is not None:
        return torch.device(device)
    return generator.device if generator is not None else torch.device("cpu")


def _score_dtype(device: torch.device) -> torch.dtype:
    # float64 makes score ties (which the stable sort would break towards left-to-right) vanishingly
    # rare; with float32 uniforms, L=1024 positions collide in a few percent of rows. MPS has no
    # float64, so it falls back to float32 there.
    return torch.float32 if device.type == "mps" else torch.float64


def _uniform_BL(batch_size: int, length: int, generator: torch.Generator | None, device: Device) -> torch.Tensor:
    """Uniform[0, 1) draws of shape [B, L], made on `device` from `generator`."""
    dev = _resolve_device(device, generator)
    return torch.rand(batch_size, length, generator=generator, device=dev, dtype=_score_dtype(dev))


class OrderPolicy(ABC):
    """A distribution over generation orders, expressed as per-position reveal scores."""

    name: ClassVar[str]

    @abstractmethod
    def reveal_scores(
        self, batch_size: int, length: int, *, generator: torch.Generator | None, device: Device
    ) -> torch.Tensor:
        """[B, L] float scores; positions are revealed in DECREASING score order.

        For the staggered schedule the score is the first-hitting time T_i."""

    @abstractmethod
    def decoding_policy(self) -> PaperDecoding:
        """The paper's default decoding settings (sampling/decoding.py) for a model trained under
        this order: one token per step left to right, a window of d at the paper's threshold
        for the staggered schedule, its own blocks for a block order."""


@dataclass(frozen=True)
class Staggered(OrderPolicy):
    """The SetDLM staggered schedule (docs/method.md, "Order policies").

    Position i is masked inside its own window [loc_i, loc_i + b]; windows of m consecutive
    positions overlap, so the order is left-to-right with local shuffles of displacement < m.
    d is the "desired block size" the schedule is matched to; m defaults to 2 * d."""

    d: int
    m: int | None = None
    k: float | None = None
    b: float | None = None
    name: ClassVar[str] = "staggered"

    def __post_init__(self) -> None:
        if self.d < 1:
            raise OrderError("d", f"d must be >= 1, got d={self.d}")
        if self.m is None:  # resolved here so repr() shows it
            object.__setattr__(self, "m", default_max_set_size(self.d))
        if self.m < self.d:
            raise OrderError("d", f"d ({self.d}) must be <= m ({self.m})")
        if self.k is not None and self.b is not None:
            raise OrderError("k", "k and b are exclusive; set at most one")
        if self.k is not None and not 0 < self.k < math.inf:
            raise OrderError("k", f"k must be a finite number > 0, got k={self.k}")
        if self.b is not None and not 0 < self.b <= 1:
            raise OrderError("b", f"b must be in (d/(2*length), 1], got b={self.b}")

    def _is_exact_ar(self) -> bool:
        return self.d == 1 and self.k is None and self.b is None

    def schedule(
        self, length: int, *, device: Device = None, dtype: torch.dtype = torch.float64
    ) -> tuple[float, float, torch.Tensor]:
        """Return (k, b, loc_L): the Beta(1, k) shape, the window width and the window starts."""
        _check_length(length)
        d, m = self.d, self.m
        # With d == 1 (and no override) m plays no role: the windows tile [0, 1], so m > L is fine.
        if m > length and not self._is_exact_ar():
            raise OrderError(
                "m", f"m ({m}) must be <= the sequence length ({length}); for a uniform order set d = m = length"
            )
        desired_area = d / (2 * length)  # area of a BD3-LM block of size d under a linear schedule
        if self.k is not None:
            k = float(self.k)
            b = desired_area * (k + 1) / k
            if not b <= 1:
                raise OrderError(
                    "k",
                    f"k={k} gives window b={b} > 1; k must be >= {desired_area / (1 - desired_area)} for length={length}",
                )
        elif self.b is not None:
            b = float(self.b)
            if not desired_area < b <= 1:
                raise OrderError("b", f"b must be in (d/(2*length), 1] = ({desired_area}, 1], got b={b}")
            k = desired_area / (b - desired_area)
        elif d not in (1, m):
            b = m / (length + m - 1)  # spacing 1/(L+m-1): exactly m consecutive windows overlap
            k = desired_area / (b - desired_area)
        else:
            k, b = 1.0, d / length
        if length == 1:
            loc_L = torch.zeros(1, device=device, dtype=dtype)
        else:
            # Position 0 gets the latest window in forward time, so it is revealed first.
            i_L = torch.arange(length, device=device, dtype=dtype)
            loc_L = (1 - b) * (length - 1 - i_L) / (length - 1)
        return k, b, loc_L

    def reveal_scores(
        self, batch_size: int, length: int, *, generator: torch.Generator | None, device: Device
    ) -> torch.Tensor:
        """First-hitting times T_i = loc_i + b * U_i with U_i ~ Beta(1, k)."""
        dev = _resolve_device(device, generator)
        k, b, loc_L = self.schedule(length, device=dev, dtype=_score_dtype(dev))  # validates first
        if self._is_exact_ar():
            # d == 1: the windows [(L-1-i)/L, (L-i)/L] only touch, so T decreases strictly in i in
            # exact arithmetic; but loc_i + b*U_i is rounded, and at a shared window edge two draws
            # could tie or swap. Returning -position makes AR exactly left-to-right, with no draw.
            return -torch.arange(length, device=dev, dtype=loc_L.dtype).expand(batch_size, length)
        v_BL = _uniform_BL(batch_size, length, generator, dev)
        # U = 1 - V**(1/k), written as -expm1(log(V)/k) to keep precision when V is close to 1.
        return loc_L + b * -torch.expm1(torch.log(v_BL) / k)

    def decoding_policy(self) -> PaperDecoding:
        return PaperDecoding(window=1) if self.d == 1 else PaperDecoding(window=self.d, threshold=PAPER_THRESHOLD)


@dataclass(frozen=True)
class LeftToRight(OrderPolicy):
    """Autoregressive order: the identity permutation."""

    name: ClassVar[str] = "left_to_right"

    def reveal_scores(
        self, batch_size: int, length: int, *, generator: torch.Generator | None, device: Device
    ) -> torch.Tensor:
        _check_length(length)
        dev = _resolve_device(device, generator)
        return -torch.arange(length, device=dev, dtype=_score_dtype(dev)).expand(batch_size, length)

    def decoding_policy(self) -> PaperDecoding:
        return PaperDecoding(window=1)


@dataclass(frozen=True)
class Uniform(OrderPolicy):
    """A uniformly random permutation: set diffusion with a uniform order (any-order AR), the order
    MDLM's masking implies; the model stays set diffusion, not MDLM."""

    name: ClassVar[str] = "uniform"

    def reveal_scores(
        self, batch_size: int, length: int, *, generator: torch.Generator | None, device: Device
    ) -> torch.Tensor:
        _check_length(length)
        return _uniform_BL(batch_size, length, generator, device)

    def decoding_policy(self) -> PaperDecoding:
        return PaperDecoding(window=UNIFORM_WINDOW, threshold=PAPER_THRESHOLD)


@dataclass(frozen=True)
class Block(OrderPolicy):
    """Blocks of `size` positions left-to-right, uniform order inside a block: set diffusion with a
    block order, the order BD3-LM's block-wise masking implies; the model stays set diffusion."""

    size: int
    name: ClassVar[str] = "block"

    def __post_init__(self) -> None:
        if self.size < 1:
            raise OrderError("size", f"size (block size) must be >= 1, got size={self.size}")

    def reveal_scores(
        self, batch_size: int, length: int, *, generator: torch.Generator | None, device: Device
    ) -> torch.Tensor:
        _check_length(length)
        u_BL = _uniform_BL(batch_size, length, generator, device)
        num_blocks = -(-length // self.size)
        pos_L = torch.arange(length, device=u_BL.device, dtype=u_BL.dtype)
        block_L = torch.div(pos_L, self.size, rounding_mode="floor")
        # Block offsets are integers and U < 1, so blocks never interleave (a rounding tie at an
        # integer is broken by the stable sort towards the lower position, i.e. the earlier block).
        return (num_blocks - block_L) + u_BL

    def decoding_policy(self) -> PaperDecoding:
        return PaperDecoding(window=self.size, block_size=self.size, threshold=PAPER_THRESHOLD)


_POLICIES: dict[str, type[OrderPolicy]] = {c.name: c for c in (Staggered, LeftToRight, Uniform, Block)}


def make_order_policy(name: str, **kwargs) -> OrderPolicy:
    """Build a policy from a config name, e.g. make_order_policy("staggered", d=4, m=8)."""
    if name not in _POLICIES:
        raise ValueError(f"name must be one of {sorted(_POLICIES)}, got name={name!r}")
    return _POLICIES[name](**kwargs)


def _check_mask(mask: torch.Tensor | None, arg: str, shape: tuple[int, int]) -> None:
    if mask is None:
        return
    if tuple(mask.shape) != shape:
        raise ValueError(f"{arg} must have shape [B, L] = {list(shape)}, got {list(mask.shape)}")
    if mask.dtype != torch.bool:
        raise ValueError(f"{arg} must be a bool tensor, got dtype {mask.dtype}")


def sample_order(
    policy: OrderPolicy,
    batch_size: int | None = None,
    length: int | None = None,
    *,
    prompt_mask: torch.Tensor | None = None,
    pad_mask: torch.Tensor | None = None,
    keep_clean_bos: bool = False,
    generator: torch.Generator | None = None,
    device: Device = None,
) -> torch.Tensor:
    """Sample perm [B, L] (int64): perm[b, j] is the original position revealed at rank j.

    Per row, prompt positions come first and padding last, each in position order; targets sit in
    between in decreasing policy score. Pinning is per position (+inf / -inf scores and a stable
    descending sort), so rows with different prompt lengths, padding, or non-contiguous prompt or
    pad positions are all handled in one vectorised call. With keep_clean_bos, position 0 is pinned
    like a prompt token unless it is padding (padding wins: a fully padded row stays the identity).
    batch_size and length default to the masks' shape; device to the masks' or generator's.
    """
    ref = prompt_mask if prompt_mask is not None else pad_mask
    if (batch_size is None or length is None) and (ref is None or ref.dim() != 2):
        raise ValueError("batch_size and length must be given unless a [B, L] mask is")
    batch_size = ref.shape[0] if batch_size is None else batch_size
    length = ref.shape[1] if length is None else length
    if batch_size < 0:
        raise ValueError(f"batch_size must be >= 0, got {batch_size}")
    _check_length(length)
    _check_mask(prompt_mask, "prompt_mask", (batch_size, length))
    _check_mask(pad_mask, "pad_mask", (batch_size, length))
    dev = _resolve_device(ref.device if device is None and ref is not None else device, generator)

    first_BL = torch.zeros(batch_size, length, dtype=torch.bool, device=dev)
    last_BL = torch.zeros_like(first_BL)
    if prompt_mask is not None:
        first_BL |= prompt_mask.to(dev)
    if pad_mask is not None:
        last_BL |= pad_mask.to(dev)
    # Only checked when both masks are given: the .any() is a host sync on accelerators.
    if prompt_mask is not None and pad_mask is not None and bool((first_BL & last_BL).any()):
        raise ValueError("prompt_mask and pad_mask must be disjoint: a position cannot be both prompt and padding")
    scores_BL = policy.reveal_scores(batch_size, length, generator=generator, device=dev)
    if tuple(scores_BL.shape) != (batch_size, length):
        raise ValueError(
            f"policy {policy!r} returned scores of shape {list(scores_BL.shape)}, "
            f"expected [B, L] = {[batch_size, length]}"
        )
    if keep_clean_bos:
        first_BL[:, 0] |= ~last_BL[:, 0]
    scores_BL = scores_BL.masked_fill(first_BL, math.inf).masked_fill(last_BL, -math.inf)
    # Stable sort: equal scores (all pinned prompt / pad positions) keep their position order.
    return torch.sort(scores_BL, dim=-1, descending=True, stable=True).indices


def sample_record_order(
    policy: OrderPolicy,
    document_ids: torch.Tensor,
    position_ids: torch.Tensor,
    *,
    prompt_mask: torch.Tensor,
    pad_mask: torch.Tensor,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """perm [B, L] for rows that pack several records, each record ordered as if it were alone.

    `document_ids` numbers the records of a row from 0 and `position_ids` counts positions from
    0 within each record. Every (row, record) gets an order from `sample_order` on a virtual row
    of length L holding just that record (its prompt pinned, the rest padding), drawn in row-major
    (row, record) order: a row packing records r1, r2 draws exactly the orders that a padded
    batch [r1, r2] draws from the same generator. The records' orders are then interleaved by
    their within-record ranks, and the row's padding goes last. Attention that stays within
    records (document ids) sees only each record's own relative order, so a packed record's loss
    equals its padded loss.
    """
    batch, length = document_ids.shape
    for name, m in (("position_ids", position_ids), ("prompt_mask", prompt_mask), ("pad_mask", pad_mask)):
        if m.shape != document_ids.shape:
            raise ValueError(f"{name} must have shape [B, L] = {[batch, length]}, got {list(m.shape)}")
    real = ~pad_mask
    docs = torch.where(real, document_ids.long(), 0)
    per_row = int(docs.max()) + 1 if docs.numel() else 1
    group = (torch.arange(batch, device=docs.device)[:, None] * per_row + docs)[real]
    local = position_ids.long()[real]
    virtual_prompt = torch.zeros(batch * per_row, length, dtype=torch.bool, device=docs.device)
    virtual_pad = torch.ones_like(virtual_prompt)
    virtual_pad[group, local] = False
    virtual_prompt[group, local] = prompt_mask[real]
    virtual_perm = sample_order(policy, prompt_mask=virtual_prompt, pad_mask=virtual_pad, generator=generator)
    rank_of = torch.empty_like(virtual_perm)
    rank_of.scatter_(1, virtual_perm, torch.arange(length, device=docs.device).expand_as(virtual_perm))
    key = torch.full((batch, length), batch * length * per_row, dtype=torch.long, device=docs.device)
    key = key + torch.arange(length, device=docs.device)  # padding: after every real rank, in position order
    key[real] = rank_of[group, local] * per_row + docs[real]
    return torch.sort(key, dim=-1, stable=True).indices
