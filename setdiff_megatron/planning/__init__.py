"""`setdiff plan`: what a recipe needs on GPUs that are not here, measured on the real model under
fake tensors and a fake process group of the full world size (docs/scaling.md)."""
