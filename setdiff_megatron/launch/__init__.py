"""Launching: torchrun on this machine (local.py), and SLURM job scripts rendered from recipes.

sbatch.py renders scripts (pure text), cluster.py reads the per-cluster settings file, and
slurm.py ties a recipe and a cluster file into a submitted job.
"""
