"""The reference implementation's released models, read as they are published: a SetDLM folder
written by its `save_pretrained_or_push_to_hub` (kuleshov-group/setdlms, src/utils.py), or by a
plain `save_pretrained`.

pytorch_model.bin is read with torch.load(weights_only=True) only; the python sources beside it
are never executed. A Qwen3 backbone's architecture numbers come from its base model's config.json
(`base`; there is no hub here) unless its config re-initialises the model and names them all. The evaluation settings (L, the
order law, a clean BOS) are those of the reference's loader (scripts/eval/model_loading.py) and
become the Source's recipe (docs/huggingface.md, "The reference's releases").
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from setdiff_megatron.core.orders import default_max_set_size
from setdiff_megatron.data.tokenizers import SetDiffTokenizer
from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.recipes.schema import DataSection, MethodSection, ModelSection, Recipe
from setdiff_megatron.sources.ar_import import ar_model_config, ar_state_dict
from setdiff_megatron.sources.base_model import BASE_ENV
from setdiff_megatron.sources.dit_import import dit_state_dict, is_dit_config
from setdiff_megatron.sources.hf_files import INDEX, SINGLE, load_safetensors_dir
from setdiff_megatron.sources.safe_pickle import load_pickle

__all__ = [
    "RELEASE_KIND",
    "QWEN3_TARGET",
    "DIT_TARGET",
    "STAGGERED_TARGET",
    "WEIGHTS",
    "QWEN3_ARCHITECTURE",
    "Release",
    "is_release_config",
    "read_release",
    "static_attention_mask",
]

RELEASE_KIND = "setdlm"
QWEN3_TARGET = "backbone_automodel.AutoModelFromPreTrained"
DIT_TARGET = "backbone_dit.DIT"
STAGGERED_TARGET = "noise_schedule_noise_schedules.StaggeredNoise"
WEIGHTS = "pytorch_model.bin"
MASK_BUFFERS = ("static_attention_mask", "encoder_static_attention_mask")
_AUTOMODEL_ARGS = frozenset(
    {
        "_target_",
        "automodel_cls",
        "pretrained_model_name_or_path",
        "revision",
        "trust_remote_code",
        "num_layers",
        "keep_top_layers",
        "reinit_model",
        "use_causal_mask",
        "attn_implementation",
    }
)
"""AutoModelFromPreTrained's own arguments; its other keys go to the base's config."""
QWEN3_ARCHITECTURE = (
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rope_theta",
    "rms_norm_eps",
    "vocab_size",
    "max_position_embeddings",
    "tie_word_embeddings",
)
"""The Qwen3 config keys a backbone_config that re-initialises its model (reinit_model) may set
over the base's; with all of them there, the base's config.json adds nothing."""
_IDS = ("mask_token_id", "bos_token_id", "eos_token_id", "pad_token_id")
_ROLE = {"mask_token_id": "mask_id", "bos_token_id": "bos_id", "eos_token_id": "eos_id", "pad_token_id": "pad_id"}


BASELINES = {"MDLM": "mdlm", "BD3LM": "bd3lm"}
"""The reference's baseline architectures and their families (method.family)."""
LINEAR_TARGET = "noise_schedule_noise_schedules.LinearNoise"


def is_release_config(config: Mapping[str, Any]) -> bool:
    return bool({"SetDLM", *BASELINES} & set(config.get("architectures") or ()))


def _unflattened(target: str) -> str:
    """The release's flattened `_target_` (backbone_dit.DIT) for a target also written as src.backbone.dit.DIT."""
    if target.startswith("src."):
        module, _, name = target.removeprefix("src.").rpartition(".")
        return f"{module.replace('.', '_')}.{name}"
    return target


def static_attention_mask(length: int) -> torch.Tensor:
    """The reference's set-causal mask over [clean ; queries] (2L x 2L, bool): a clean token sees
    the clean ones up to itself, a query its own slot and the clean tokens before it."""
    q, kv = torch.arange(2 * length)[:, None], torch.arange(2 * length)[None, :]
    q_query, kv_query = q >= length, kv >= length
    q, kv = q % length, kv % length
    return ((q == kv) & (q_query == kv_query)) | ((q > kv) & ~kv_query & q_query) | ((q >= kv) & ~kv_query & ~q_query)


class Release:
    """A release folder's config.json, read and checked; `load` maps its weights."""

    def __init__(self, directory: Path, config: Mapping[str, Any]):
        self.directory, self.config = directory, config
        self.where = directory / "config.json"
        backbone = config.get("backbone_config")
        noise = config.get("noise_config")
        if not isinstance(backbone, dict) or not isinstance(noise, dict):
            raise UserError(f"{self.where}: a SetDLM config needs backbone_config and noise_config")
        self.backbone, self.noise = backbone, noise
        self.target = _unflattened(str(backbone.get("_target_")))
        if self.target not in (QWEN3_TARGET, DIT_TARGET):
            raise UserError(
                f"{self.where}: backbone_config._target_ {backbone.get('_target_')!r} is not a released "
                f"backbone ({QWEN3_TARGET} on Qwen3, or {DIT_TARGET})"
            )
        self.architecture = next((a for a in BASELINES if a in config.get("architectures", ())), "SetDLM")
        self.family = BASELINES.get(self.architecture, "set_diffusion")
        noise_target = _unflattened(str(noise.get("_target_")))
        expected = STAGGERED_TARGET if self.family == "set_diffusion" else LINEAR_TARGET
        if noise_target != expected:
            raise UserError(
                f"{self.where}: noise_config._target_ {noise.get('_target_')!r} is not the {expected} "
                f"{'set diffusion' if self.family == 'set_diffusion' else self.family} trains with"
            )
        try:
            self.length = int(config.get("length") or noise["length"])
        except (KeyError, TypeError, ValueError):
            raise UserError(f"{self.where}: no sequence length (length)") from None
        self.notes: list[str] = []

    def method(self) -> MethodSection:
        """The order law (or baseline family) and BOS handling the reference's loader evaluates
        the release with."""
        if self.family != "set_diffusion":
            block = self.config.get("block_size") if self.family == "bd3lm" else None
            try:
                return MethodSection(
                    family=self.family, block_size=block, keep_clean_bos=bool(self.config.get("keep_clean_bos"))
                )
            except ValueError as exc:
                raise UserError(f"{self.where}: not a valid {self.family} release: {exc}") from None
        noise = self.noise
        block = int(noise.get("block_size") or self.length)
        if block != self.length:
            raise UserError(
                f"{self.where}: noise_config.block_size {block} differs from length {self.length}; "
                "block-wise set diffusion releases are not supported (nor by the reference's sampler)"
            )
        d = int(noise.get("desired_block_size") or block)
        m = noise.get("max_block_size")
        m = int(m) if m is not None and int(m) < block else min(default_max_set_size(d), block)
        if not self.config.get("keep_clean_bos", True):
            self.notes.append(
                "keep_clean_bos: false in config.json, but the reference's loader evaluates SetDLM "
                "releases with a clean BOS, and so does this reader"
            )
        shape = {k: float(noise[k]) for k in ("k", "b") if noise.get(k) is not None}
        try:
            return MethodSection(order="staggered", d=d, m=m, keep_clean_bos=True, **shape)
        except ValueError as exc:
            raise UserError(f"{self.where}: its noise_config is not a valid order law: {exc}") from None

    def recipe(self, model: ModelConfig) -> Recipe:
        return Recipe(
            name=f"release-{self.directory.name}",
            description=f"the reference's {self.architecture} release {self.directory}",
            model=ModelSection(**asdict(model)),
            method=self.method(),
            data=DataSection(tokenizer=str(self.directory), seq_len=self.length),
        )

    def check_ids(self, tokenizer: SetDiffTokenizer) -> None:
        """The config's four ids are the tokenizer's: the reference writes them from the very
        tokenizer it saves beside the weights (scripts/utils.py `_make_tokenization_config`), so a
        release that disagrees carries another model's tokenizer (its loader would silently take
        the tokenizer's ids: EOS ends completions, PAD is left out of what the model sees)."""
        ids = self.config.get("tokenization_config") or {}
        for key in _IDS:
            want = ids.get(key, self.config.get(key))
            have = getattr(tokenizer, _ROLE[key])
            if want is not None and int(want) != have:
                raise UserError(
                    f"{self.where}: {key} is {want}, but the tokenizer beside it has id {have}; put the "
                    "tokenizer the model was trained with beside its weights"
                )

    def weights(self) -> dict[str, torch.Tensor]:
        """The backbone's tensors under its own names; the mask buffer checked against L. From
        pytorch_model.bin (the release), else from safetensors (a plain save_pretrained)."""
        path = self.directory / WEIGHTS
        if path.is_file():
            state, notes = load_pickle(path, "the file is truncated or not a state dict; download it again")
            self.notes += notes
        elif any((self.directory / name).is_file() for name in (SINGLE, INDEX)):
            state = load_safetensors_dir(self.directory)
        else:
            raise UserError(
                f"{self.directory} has no {WEIGHTS} (a SetDLM release's weights) nor {SINGLE} or {INDEX} "
                "(a save_pretrained's)"
            )
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            raise UserError(f"{path} is not a state dict of tensors")
        mask = state.get(MASK_BUFFERS[0])
        if mask is not None and tuple(mask.shape) != (2 * self.length, 2 * self.length):
            raise UserError(
                f"{self.where}: length is {self.length}, but {WEIGHTS}'s static_attention_mask is "
                f"{tuple(mask.shape)}, not {(2 * self.length,) * 2}; the config and weights are of "
                "different models"
            )
        unknown = sorted(k for k in state if not k.startswith("backbone.") and k not in MASK_BUFFERS)
        if unknown:
            raise UserError(f"{path}: tensors outside the backbone that this reader does not know: {unknown[:5]}")
        return {k.removeprefix("backbone."): t for k, t in state.items() if k.startswith("backbone.")}


def _qwen3_config(release: Release, base: Path | None) -> dict[str, Any]:
    """The Qwen3 config.json the reference builds its backbone from: the base's, cut to
    num_layers, the backbone_config's architecture keys over it."""
    bb = release.backbone
    name = bb.get("pretrained_model_name_or_path")
    if bb.get("use_causal_mask"):
        raise UserError(f"{release.where}: use_causal_mask: true is an autoregressive backbone, not set diffusion")
    layers = int(bb.get("num_layers", -1))
    if bb.get("reinit_model") and layers > 0 and all(k in bb for k in QWEN3_ARCHITECTURE):
        return {
            "model_type": "qwen3",
            "architectures": ["Qwen3ForCausalLM"],
            "num_hidden_layers": layers,
            **{k: bb[k] for k in QWEN3_ARCHITECTURE},
        }
    if base is None and name and (Path(str(name)) / "config.json").is_file():
        base = Path(str(name))
    if base is None:
        raise UserError(
            f"{release.where}: its Qwen3 backbone is built from the base model {name!r}, which is not "
            f"here (no hub); pass --base DIR (or set {BASE_ENV}), a local copy of it: its config.json "
            "is enough"
        )
    path = Path(base) / "config.json"
    if not path.is_file():
        raise UserError(f"--base {base}: no config.json there (the base model {name!r} of {release.directory})")
    try:
        config = json.loads(path.read_text())
    except ValueError as exc:
        raise UserError(f"cannot read {path}: {exc}") from None
    if config.get("model_type") != "qwen3":
        raise UserError(
            f"--base {base} is a {config.get('model_type')!r} model; the release's backbone "
            "(CustomQwen3ForCausalLM) is built from a Qwen3 base"
        )
    config |= {k: v for k, v in bb.items() if k not in _AUTOMODEL_ARGS}
    if layers != -1:
        config["num_hidden_layers"] = layers
    return config


def read_release(
    directory: Path, config: Mapping[str, Any], tokenizer: SetDiffTokenizer, *, base: Path | None = None
) -> tuple[ModelConfig, dict[str, torch.Tensor], Release]:
    """(ModelConfig, torch weights, the checked Release) of a SetDLM release folder."""
    release = Release(directory, config)
    release.check_ids(tokenizer)
    weights = release.weights()
    if release.target == DIT_TARGET:
        backbone = dict(release.backbone)
        if not is_dit_config(backbone):
            raise UserError(
                f"{release.where}: its DIT backbone_config lacks the DiT's numbers (hidden_size, "
                "n_heads, num_layers, vocab_size, length, ...)"
            )
        cfg, state = dit_state_dict(weights, backbone, tokenizer, directory)
    else:
        hf = _qwen3_config(release, base)
        rows = (
            weights["model.model.embed_tokens.weight"].shape[0]
            if "model.model.embed_tokens.weight" in weights
            else int(hf.get("vocab_size", 0))
        )
        hf_weights = {k.removeprefix("model."): t for k, t in weights.items()}
        cfg = ar_model_config(
            hf, directory, vocab_size=max(rows, tokenizer.vocab_size), mask_token_id=tokenizer.mask_id
        )
        cfg, state = ar_state_dict(hf_weights, cfg, tokenizer, directory)
    if release.length > cfg.max_seq_len:
        cfg = cfg.replace(max_seq_len=release.length)
    release.notes += _ignored(release)
    return cfg, state, release


def _ignored(release: Release) -> list[str]:
    """One line for each thing of the folder that does not change what this reader computes."""
    notes = []
    if release.config.get("attn_backend"):
        notes.append(
            f"ignored attn_backend {release.config['attn_backend']!r}: attention is computed by this "
            "framework's kernels"
        )
    if release.config.get("setdlm_fht_cache_order"):
        notes.append("ignored setdlm_fht_cache_order: true: the sampler caches committed tokens in decode order")
    sources = sorted(p.name for p in release.directory.glob("*.py"))
    if sources:
        notes.append(
            f"ignored {len(sources)} python source files ({', '.join(sources[:3])}"
            f"{', ...' if len(sources) > 3 else ''}): never executed"
        )
    return notes
