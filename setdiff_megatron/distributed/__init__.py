"""One distributed runtime for training, sampling and conversion.

- `layout`: the parallel layout of a job (tp, pp, vpp, dp, and the ep and cp dimensions), typed
  and checked in one place.
- `runtime`: the process group (gloo on CPUs, NCCL on GPUs), megatron-core's model-parallel
  groups built from a layout, and where this process sits (`Ranks`).
- `megatron_cpu`: the compatibility layer that lets megatron-core run on a CPU over gloo.

megatron-core is imported here lazily, only by the functions that build its groups.
"""
