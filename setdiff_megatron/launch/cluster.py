"""The cluster file: what differs between SLURM clusters, kept out of recipes.

A recipe says what to run (nodes, processes per node, a time limit); the cluster file says how
this cluster wants it asked for (partition, account, QOS, GPUs per node, set-up lines, NCCL
settings). It is found as `find_cluster_file` says. A setting the recipe gives wins; lists are the
cluster file's followed by the recipe's (slurm/README.md, "The cluster file"; docs/slurm.md).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, PositiveInt, ValidationError

from setdiff_megatron.errors import UserError

__all__ = ["ClusterFile", "load_cluster_file"]

ENV_VAR = "SETDIFF_CLUSTER_FILE"


class ClusterFile(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str | None = None
    """Time limit for recipes that set none (sbatch --time)."""
    gpus_per_node: NonNegativeInt | None = None
    """GPUs of one node: recipes asking for more per node are refused; 0 makes device 'auto' mean cpu."""
    max_nodes: PositiveInt | None = None
    """The most nodes a job may ask for here."""
    cpus_per_task: PositiveInt | None = None
    """CPU cores per training process (srun task), for recipes that set none."""
    gpu_request: Literal["gpus-per-node", "gres"] = "gpus-per-node"
    """How GPUs are requested: --gpus-per-node=N, or --gres=gpu:N on clusters that want gres."""
    setup: list[str] = Field(default_factory=list)
    """Shell lines run first in every job: `module load ...`, `source venv/bin/activate`."""
    env: dict[str, str] = Field(default_factory=dict)
    """Environment of every job, e.g. NCCL_SOCKET_IFNAME: ib0 (values are literal)."""
    sbatch_args: list[str] = Field(default_factory=list)
    srun_args: list[str] = Field(default_factory=list)


def _default_path() -> Path:
    config_home = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(config_home) / "setdiff" / "cluster.yaml"


def find_cluster_file(explicit: str | None) -> Path | None:
    """The cluster file to use: launch.slurm.cluster_file, else $SETDIFF_CLUSTER_FILE (either must
    exist), else ~/.config/setdiff/cluster.yaml; None when no file is named and that one is absent."""
    if explicit:
        if not Path(explicit).is_file():
            raise UserError(f"launch.slurm.cluster_file: {explicit} does not exist")
        return Path(explicit)
    named = os.environ.get(ENV_VAR)
    if named:
        if not Path(named).is_file():
            raise UserError(f"{ENV_VAR}={named}: no such file")
        return Path(named)
    default = _default_path()
    return default if default.is_file() else None


def load_cluster_file(explicit: str | None) -> tuple[ClusterFile, Path | None]:
    path = find_cluster_file(explicit)
    if path is None:
        return ClusterFile(), None
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        raise UserError(f"cluster file {path}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise UserError(f"cluster file {path}: must be a mapping of settings")
    try:
        return ClusterFile.model_validate(data), path
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join(str(p) for p in err["loc"])
        msg = "unknown key" if err["type"] == "extra_forbidden" else err["msg"]
        raise UserError(f"cluster file {path}: {key}: {msg}; allowed: {', '.join(ClusterFile.model_fields)}") from None
