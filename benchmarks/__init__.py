"""Reproducible performance measurements; each prints a ratio against a baseline run alongside."""
