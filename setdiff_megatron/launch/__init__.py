"""Launching on clusters: SLURM job scripts rendered from recipes, and their submission.

sbatch.py renders scripts (pure text), cluster.py reads the per-cluster settings file, and
slurm.py ties a recipe and a cluster file into a submitted job. The local launcher (torchrun on
this machine) stays in training/launch.py.
"""
