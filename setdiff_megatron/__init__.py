"""setdiff-megatron: set diffusion language models, from a laptop CPU to SLURM clusters."""

from setdiff_megatron.version import __version__

__all__ = ["__version__"]
