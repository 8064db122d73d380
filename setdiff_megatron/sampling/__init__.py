"""sampling layer of setdiff-megatron (docs/architecture.md, "Layers")."""
