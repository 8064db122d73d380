"""Token selection for the set sampler: pure functions over a batch whose rows each have their own policy.

A step offers each row its window of query positions, turns the query logits into one candidate token
and a confidence per query, and keeps the k most confident plus every query at or above the threshold
tau (docs/method.md, "Decoding"). Every function gives a row what it would give that row alone.
Nothing here knows about the model or the cache; `sampler.py` and `commit_rules.py` drive it.

Shapes: B rows, L canvas positions (plus one scratch column), Q query slots, V vocabulary,
S stop sequences, M longest stop sequence.
"""

from __future__ import annotations

import json
import numbers
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import torch

__all__ = [
    "Setting",
    "SETTINGS",
    "DecodingConfig",
    "DecodingRequest",
    "resolve_decoding",
    "decoding_request_record",
    "settings_off_default",
    "RowPolicy",
    "window_queries",
    "process_logits",
    "choose_tokens",
    "select_queries",
    "stop_ends",
]

_NO_TOKEN = -2
"""Fills windows outside the stop region; matches no token id and no wildcard."""
_ANY_TOKEN = -1
"""Left padding of shorter stop sequences: matches anything."""
_NEVER = -3
"""Fills a row's unused stop sequences: matches nothing, not even a wildcard position."""
_OFF = 2.0
"""A threshold or top_p that never triggers."""


@dataclass(frozen=True)
class Setting:
    """One decoding setting, declared once with its DecodingConfig field (which holds its
    default). Every entry point is made from these declarations: the command-line flags, the server's
    request fields, sweep specs, a recipe's `decoding` section, lm-eval's model_args and the keys
    of an export's generation_config.json; so are the checks."""

    name: str
    kind: type
    """int, float or bool."""
    help: str
    short: str | tuple[str, str]
    """Its part of a sweep point's name: a prefix for the value ('w' makes 'w4', 'toff'), or a
    bool's two words (true, false)."""
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    off: bool = False
    """None is a value, and means the setting is off."""
    note: str = ""
    """What a special value means, said after the range in errors, e.g. '0 = greedy'."""
    openai: str | None = None
    """The OpenAI request field that carries it to the server, when OpenAI has one."""

    def point_name(self, value: Any) -> str:
        """This setting's part of a sweep point's name for `value`: 'w4', 'toff', 'fill', 'span'."""
        if self.kind is bool:
            return self.short[0] if value else self.short[1]
        return f"{self.short}{'off' if value is None else format(value, 'g')}"

    def allowed(self) -> str:
        """The range in words: '>= 1', 'in (0, 1], or None for off', '> 0 (1 = off)'."""
        if self.gt is not None and self.le is not None:
            text = f"in ({self.gt:g}, {self.le:g}]"
        elif self.ge is not None:
            text = f">= {self.ge:g}"
        elif self.gt is not None:
            text = f"> {self.gt:g}"
        else:
            text = {bool: "true or false", int: "an integer", float: "a number"}[self.kind]
        text += ", or None for off" if self.off else ""
        return f"{text} ({self.note})" if self.note else text

    def accepts(self, value: Any) -> bool:
        if value is None:
            return self.off
        if self.kind is bool:
            return isinstance(value, bool)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or (self.kind is int and value != int(value)):
            return False
        return (
            (self.ge is None or value >= self.ge)
            and (self.gt is None or value > self.gt)
            and (self.le is None or value <= self.le)
        )


def _setting(default: Any, kind: type, help: str, **declared: Any) -> Any:
    return field(default=default, metadata={"setting": {"kind": kind, "help": help, **declared}})


@dataclass(frozen=True, kw_only=True)
class DecodingConfig:
    """How the sampler picks tokens. Every field is checked when the config is built.

    The settings compose: window W x {span, fill, blocks} x k x tau x {greedy, temperature, top-k,
    top-p} x repetition penalty. AR decoding is W = 1.

    A model carries its own policy (`Source.decoding`: its recipe's order, or what its export
    says); the defaults here are only what a caller gets who names neither."""

    window: int = _setting(
        16,
        int,
        "W: queries come from the masked positions in [leftmost masked, leftmost masked + W); 1 is "
        "autoregressive decoding",
        ge=1,
        short="w",
    )
    """W >= 1: queries are the masked positions in [leftmost masked, leftmost masked + W) (the
    reference's position span, which out-of-order decoding can shrink to one query)."""
    fill_window: bool = _setting(
        False, bool, "offer the W leftmost masked positions, so every step scores W queries", short=("fill", "span")
    )
    block_size: int | None = _setting(
        None,
        int,
        "block diffusion decoding: queries stay in the block of S positions holding the leftmost masked one",
        ge=1,
        off=True,
        short="b",
    )
    """Block diffusion (BD3-LM) decoding: queries never pass the end of the block (positions
    [j*S, (j+1)*S), counted from the canvas start) that holds the leftmost masked position, so a
    block is finished before the next one is queried, as a block-order model was trained. None: off."""
    cache_infill_input: bool = _setting(
        False,
        bool,
        "BD3-LM infilling as the reference's: cache the input's whole blocks (right context and MASKs too) and "
        "decode the span's blocks after them",
        short=("cache", "nocache"),
    )
    """BD3-LM only (sampling/masked_sampler.py): its blocks never see later ones, so the reference's
    infill caches the input's whole blocks of S (MASKs and right context included) as clean blocks
    and decodes the span's blocks at positions after them, where the right context lies behind
    them. Set diffusion and MDLM see both contexts anyway: a sample job records it off for them
    (inference/job.py), as it does for prompts with nothing to infill."""
    align_inputs_to_blocks: bool = _setting(
        True,
        bool,
        "MDLM and BD3-LM generation: start the first block at the prompt's end rounded down to a multiple of "
        "the block size (false: at the prompt's end, the whole prompt prefilled, as the paper's throughput runs)",
        short=("aligned", "unaligned"),
    )
    """MDLM and BD3-LM generation (sampling/masked_sampler.py), the reference's setting of that name:
    true starts the first block at floor(P / S) * S, so the prompt's tail shares it; false starts
    it at the prompt's end P, BD3-LM prefilling the whole prompt. Infilling prompts stay aligned,
    as the reference's infilling runs are; set diffusion ignores it (a sample job records it on)."""
    tokens_per_step: int = _setting(1, int, "k: decode the k most confident queries each step", ge=1, short="k")
    threshold: float | None = _setting(
        None, float, "tau: also decode every query at least this confident", gt=0, le=1, off=True, short="t"
    )
    """tau in (0, 1]: also decode every query whose confidence is >= tau. None: off (the
    reference's 1e6)."""
    temperature: float = _setting(
        0.0, float, "0: greedy; > 0 samples", ge=0, note="0 = greedy", openai="temperature", short="temp"
    )
    top_k: int | None = _setting(
        None, int, "keep only the k most probable tokens of each query", ge=1, off=True, short="topk"
    )
    top_p: float | None = _setting(
        None,
        float,
        "nucleus: keep the most probable tokens up to this mass",
        gt=0,
        le=1,
        off=True,
        openai="top_p",
        short="topp",
    )
    repetition_penalty: float = _setting(
        1.0,
        float,
        "divide positive logits of tokens already in the row by it (HF rule)",
        gt=0,
        note="1 = off",
        short="rep",
    )
    """> 0; HF rule: logits of tokens present in the row (prompt, right context and decoded
    tokens) are divided by it where positive and multiplied where negative. 1: off."""
    eos_token_ids: tuple[int, ...] = ()
    stop_sequences: tuple[tuple[int, ...], ...] = ()
    """Token-id sequences that end a completion (matched in the generated tail only)."""
    max_new_tokens: int = _setting(
        128, int, "generated tail per prompt (0: infill the prompt's masks only)", ge=0, openai="max_tokens", short="n"
    )
    seed: int = _setting(0, int, "seeds sampled decoding (greedy decoding draws nothing)", openai="seed", short="seed")

    def __post_init__(self) -> None:
        for setting in SETTINGS.values():
            value = getattr(self, setting.name)
            if not setting.accepts(value):
                raise ValueError(f"{setting.name} must be {setting.allowed()}; got {value!r}")
        checks = [
            ("eos_token_ids", self.eos_token_ids, all(t >= 0 for t in self.eos_token_ids), "token ids >= 0"),
            (
                "stop_sequences",
                self.stop_sequences,
                all(len(s) >= 1 and all(t >= 0 for t in s) for s in self.stop_sequences),
                "non-empty sequences of token ids >= 0",
            ),
        ]
        for name, value, ok, allowed in checks:
            if not ok:
                raise ValueError(f"{name} must be {allowed}; got {value!r}")

    def with_settings(self, changes: Mapping[str, Any]) -> DecodingConfig:
        """This policy with `changes` (settings by name) over it, checked."""
        unknown = sorted(set(changes) - {f.name for f in fields(self)})
        if unknown:
            raise ValueError(f"unknown decoding settings {unknown}; known: {', '.join(SETTINGS)}")
        return replace(self, **changes)


SETTINGS: dict[str, Setting] = {
    f.name: Setting(name=f.name, **f.metadata["setting"]) for f in fields(DecodingConfig) if "setting" in f.metadata
}
"""Every decoding setting a user may give, in declaration order."""

DecodingRequest = DecodingConfig | Mapping[str, Any]
"""What a job is asked to decode with: a whole config, or settings over the model's own policy."""


def resolve_decoding(request: DecodingRequest, policy: DecodingConfig) -> DecodingConfig:
    """A whole config as it is; settings over the model's policy otherwise."""
    return request if isinstance(request, DecodingConfig) else policy.with_settings(request)


def decoding_request_record(request: DecodingRequest) -> dict[str, Any]:
    """A request as JSON-ready data, for a job's record of what it was asked: a whole config's
    fields, or the settings given over the model's policy under `model_policy_with`."""
    if isinstance(request, DecodingConfig):
        return asdict(request)
    return {"model_policy_with": dict(request)}


def settings_off_default(record: Mapping[str, Any]) -> dict[str, Any]:
    """The entries of a DecodingConfig's JSON record that differ from the defaults: what tells two
    recorded decodings apart, so that a record written before a setting existed still matches
    one that holds it at its default."""
    defaults = json.loads(json.dumps(asdict(DecodingConfig())))
    return {k: v for k, v in record.items() if k not in defaults or v != defaults[k]}


@dataclass
class RowPolicy:
    """Each row's DecodingConfig as [B] tensors (and its stop sequences as [B, S, M]), plus the
    host-side facts a step needs: the widest window, and which options any row uses."""

    window: torch.Tensor
    fill: torch.Tensor
    block: torch.Tensor
    """0: no blocks."""
    k: torch.Tensor
    tau: torch.Tensor
    """_OFF (2.0) where the threshold is off."""
    temperature: torch.Tensor
    top_k: torch.Tensor
    """0: off."""
    top_p: torch.Tensor
    """_OFF where off."""
    repetition: torch.Tensor
    stops: torch.Tensor
    """[B, S, M] right-aligned, left-padded with a wildcard; unused rows of S are _NEVER."""
    configs: list[DecodingConfig]

    def __post_init__(self) -> None:
        # Host-side facts, computed once per batch composition: a step asks for them many times.
        self._used = frozenset(name for name, test in _OPTIONS.items() if any(test(c) for c in self.configs))
        self.max_window = max(c.window for c in self.configs)
        self.sampled_rows = [i for i, c in enumerate(self.configs) if c.temperature > 0]
        self.k_B1, self.tau_B1 = self.k[:, None], self.tau[:, None]  # as every step compares them

    @classmethod
    def from_configs(cls, configs: Sequence[DecodingConfig], device=None) -> RowPolicy:
        def col(get, dtype):
            return torch.tensor([get(c) for c in configs], dtype=dtype, device=device)

        seqs = [[(t,) for t in c.eos_token_ids] + list(c.stop_sequences) for c in configs]
        num, width = max(1, max(len(s) for s in seqs)), max(1, max((len(x) for s in seqs for x in s), default=1))
        table = [
            [(_ANY_TOKEN,) * (width - len(x)) + tuple(x) for x in s] + [(_NEVER,) * width] * (num - len(s))
            for s in seqs
        ]
        return cls(
            window=col(lambda c: c.window, torch.long),
            fill=col(lambda c: c.fill_window, torch.bool),
            block=col(lambda c: c.block_size or 0, torch.long),
            k=col(lambda c: c.tokens_per_step, torch.long),
            tau=col(lambda c: _OFF if c.threshold is None else c.threshold, torch.float32),
            temperature=col(lambda c: c.temperature, torch.float32),
            top_k=col(lambda c: c.top_k or 0, torch.long),
            top_p=col(lambda c: _OFF if c.top_p is None or c.top_p >= 1 else c.top_p, torch.float32),
            repetition=col(lambda c: c.repetition_penalty, torch.float32),
            stops=torch.tensor(table, dtype=torch.long, device=device),
            configs=list(configs),
        )

    def select(self, index: torch.Tensor, host_index: list[int]) -> RowPolicy:
        """The rows `index` (host copy `host_index`), in that order."""
        return RowPolicy(
            **{f.name: getattr(self, f.name)[index] for f in fields(self) if f.name != "configs"},
            configs=[self.configs[i] for i in host_index],
        )

    def cat(self, other: RowPolicy) -> RowPolicy:
        """These rows, then `other`'s (stop tables padded to a common shape)."""
        num, width = max(self.stops.shape[1], other.stops.shape[1]), max(self.stops.shape[2], other.stops.shape[2])
        parts = {}
        for f in fields(self):
            if f.name == "configs":
                continue
            a, b = getattr(self, f.name), getattr(other, f.name)
            if f.name == "stops":
                a, b = _pad_stops(a, num, width), _pad_stops(b, num, width)
            parts[f.name] = torch.cat([a, b])
        return RowPolicy(**parts, configs=self.configs + other.configs)

    def uses(self, option: str) -> bool:
        """Whether any row uses an option of _OPTIONS ('fill', 'block', 'top_k', ...)."""
        return option in self._used


_OPTIONS = {
    "fill": lambda c: c.fill_window,
    "block": lambda c: c.block_size is not None,
    "top_k": lambda c: c.top_k is not None,
    "top_p": lambda c: c.top_p is not None and c.top_p < 1,
    "repetition": lambda c: c.repetition_penalty != 1.0,
    "temperature": lambda c: c.temperature > 0,
    "stops": lambda c: bool(c.eos_token_ids or c.stop_sequences),
}
"""The options a step skips when no row of the batch uses them."""


def _pad_stops(stops: torch.Tensor, num: int, width: int) -> torch.Tensor:
    """[B, S, M] to [B, num, width]: wildcards on the left of each sequence, _NEVER rows below."""
    b, s, m = stops.shape
    if m < width:
        stops = torch.cat([stops.new_full((b, s, width - m), _ANY_TOKEN), stops], 2)
    if s < num:
        stops = torch.cat([stops, stops.new_full((b, num - s, width), _NEVER)], 1)
    return stops


def window_queries(todo_BL: torch.Tensor, policy: RowPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """Query positions [B, Q] in increasing order and their validity [B, Q], Q = min(max W, L).

    A row's queries: the masked positions in [leftmost masked, leftmost masked + W) (span), or
    its W leftmost masked positions (fill); with blocks, never past the end of the block holding
    the leftmost masked position. The last canvas column is scratch (never to do); empty slots
    point at it, so writing a dummy slot's token back to the canvas touches nothing real.
    """
    scratch = todo_BL.shape[1] - 1
    pos_L = torch.arange(todo_BL.shape[1], device=todo_BL.device)
    first_B = todo_BL.to(torch.uint8).argmax(1)  # the first maximum: the leftmost masked position
    end_B = first_B + policy.window
    if policy.uses("fill"):
        end_B = torch.where(policy.fill, scratch, end_B)
    if policy.uses("block"):
        block_end = (first_B // policy.block.clamp(min=1) + 1) * policy.block
        end_B = torch.where(policy.block > 0, torch.minimum(end_B, block_end), end_B)
    key_BL = torch.where(todo_BL & (pos_L < end_B[:, None]), pos_L, scratch)
    num = min(policy.max_window, todo_BL.shape[1])
    pos_BQ = key_BL.topk(num, dim=1, largest=False, sorted=True).values
    valid = pos_BQ < scratch
    if policy.uses("fill"):  # a fill row offers at most its own W
        valid &= torch.arange(num, device=todo_BL.device) < policy.window[:, None]
    return pos_BQ, valid


def process_logits(
    logits_BQV: torch.Tensor, canvas_BL: torch.Tensor, policy: RowPolicy, mask_token_id: int
) -> torch.Tensor:
    """The logits tokens are drawn from: MASK removed, repetition penalty, temperature, top-k/p."""
    logits = logits_BQV.to(torch.promote_types(logits_BQV.dtype, torch.float32), copy=True)
    logits.narrow(-1, mask_token_id, 1).fill_(float("-inf"))
    if policy.uses("repetition"):
        # The canvas holds MASK at undecoded positions; MASK's logit is -inf whatever it becomes.
        seen_BV = torch.zeros(logits.shape[0], logits.shape[2], dtype=torch.bool, device=logits.device)
        seen_BV.scatter_(1, canvas_BL, True)
        rep = policy.repetition[:, None, None]
        penalized = torch.where(logits > 0, logits / rep, logits * rep)
        logits = torch.where(seen_BV[:, None, :], penalized, logits)
    if policy.uses("temperature"):
        t = policy.temperature[:, None, None]
        logits = torch.where(t > 0, logits / t.clamp(min=1e-30), logits)
    if policy.uses("top_k"):
        top = policy.top_k[:, None, None]
        kmax = min(int(policy.top_k.max()), logits.shape[-1])
        kth = logits.topk(kmax, dim=-1).values.gather(-1, (top.clamp(1, kmax) - 1).expand(-1, logits.shape[1], 1))
        logits = logits.masked_fill((top > 0) & (logits < kth), float("-inf"))
    if policy.uses("top_p"):
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token once the mass before it reaches p: the most probable token always stays.
        drop = ((probs.cumsum(-1) - probs) >= policy.top_p[:, None, None]) & (policy.top_p[:, None, None] <= 1)
        logits = logits.scatter(-1, order, sorted_logits.masked_fill(drop, float("-inf")))
    return logits


def choose_tokens(
    logits_BQV: torch.Tensor,
    policy: RowPolicy,
    generators: Sequence[torch.Generator | None],
    num_queries: Sequence[int],
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per query [B, Q] and its confidence: its probability under the processed logits.
    Greedy rows take the argmax; a sampled row draws for its `num_queries` valid slots (a prefix
    of its Q; none in a step it does not decode) from its own generator, so its draws do not
    depend on the other rows of the batch."""
    probs = logits_BQV.softmax(-1)
    conf_BQ, tok_BQ = probs.max(-1)
    for i in policy.sampled_rows:
        n = num_queries[i]
        if n:
            tok_BQ[i, :n] = torch.multinomial(probs[i, :n], 1, generator=generators[i])[:, 0]
            conf_BQ[i, :n] = probs[i, :n].gather(-1, tok_BQ[i, :n, None])[:, 0]
    return tok_BQ, conf_BQ


def select_queries(conf_BQ: torch.Tensor, valid_BQ: torch.Tensor, policy: RowPolicy) -> torch.Tensor:
    """[B, Q] decode mask: each row's k most confident valid queries, plus every one at or above
    its tau.

    A stable sort breaks ties in confidence towards the leftmost slot, whatever the number of
    dummy slots, so the set is exactly k and does not depend on the batch.
    """
    conf = torch.where(valid_BQ, conf_BQ, -1.0)
    rank = conf.sort(dim=1, descending=True, stable=True).indices.argsort(1)  # the inverse permutation
    select = (rank < policy.k_B1) | (conf >= policy.tau_B1)
    return select & valid_BQ


def stop_ends(
    canvas_BL: torch.Tensor,
    stops_BSM: torch.Tensor,
    pos_BQ: torch.Tensor,
    new_BQ: torch.Tensor,
    region_start_B: torch.Tensor,
) -> torch.Tensor:
    """[B] leftmost end position of a stop sequence completed by this step's tokens (L if none).

    Only windows that contain a newly decoded position can hold a new match, so the check is
    O(B Q M^2 S) whatever the canvas length: a few small tensor ops a step, on token ids, with no
    detokenisation. A match must lie in [region_start, scratch); the MASK left at undecoded
    positions never matches (the sampler rejects stops containing MASK).
    """
    scratch, width = canvas_BL.shape[1] - 1, stops_BSM.shape[2]
    offsets_M = torch.arange(width, device=canvas_BL.device)
    ends_BQM = pos_BQ[..., None] + offsets_M
    window_BQMM = ends_BQM[..., None] - (width - 1) + offsets_M
    inside = (window_BQMM >= region_start_B[:, None, None, None]) & (window_BQMM < scratch)
    gathered = canvas_BL.gather(1, window_BQMM.clamp(0, scratch).flatten(1)).view_as(window_BQMM)
    tokens_BQMM = torch.where(inside, gathered, _NO_TOKEN)
    stops = stops_BSM[:, None, None]  # [B, 1, 1, S, M]
    match_BQMS = ((tokens_BQMM[..., None, :] == stops) | (stops == _ANY_TOKEN)).all(-1)
    hit_BQM = match_BQMS.any(-1) & new_BQ[..., None]
    return torch.where(hit_BQM, ends_BQM, scratch).flatten(1).amin(1)
