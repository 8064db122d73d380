"""models layer of setdiff-megatron (see DESIGN in README)."""
