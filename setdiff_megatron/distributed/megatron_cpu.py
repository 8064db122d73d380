"""CPU mode: lets megatron-core's CUDA-only calls run on the CPU (gloo) when no GPU is present.

It patches only the points megatron-core 0.16 needs (device arguments, `.cuda()`, pinned memory,
synchronisation, CUDA type names, RNG streams, the MoE dispatcher's streams and collectives;
docs/megatron-on-cpu.md, "What is patched, and why"). It is switched on once per process, before
megatron builds anything, and refuses on a GPU machine. CUDA graphs, NCCL, fused kernels and
stream overlap stay unavailable (docs/megatron-on-cpu.md, "GPU only").
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata
import sys
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode, redispatch_function

__all__ = ["auto_cpu_mode", "compatibility_problems", "dist_backend", "enable_cpu_mode", "model_parallel_seed"]

WRITTEN_FOR = ((0, 16), (0, 17))
"""The megatron-core releases this layer and the engine's private patches were written against
(at least the first, below the second), as setup.py pins them."""
PRIVATE_NAMES = {
    "megatron.core.tensor_parallel.random": (
        "_get_cuda_rng_state",
        "_set_cuda_rng_state",
        "_CUDA_RNG_STATE_TRACKER",
        "_CUDA_RNG_STATE_TRACKER_INITIALIZED",
        "CudaRNGStatesTracker",
        "_MODEL_PARALLEL_RNG_TRACKER_NAME",
        "_DATA_PARALLEL_RNG_TRACKER_NAME",
        "_EXPERT_PARALLEL_RNG_TRACKER_NAME",
        "model_parallel_cuda_manual_seed",
        "get_cuda_rng_tracker",
    ),
    "megatron.core.tensor_parallel.mappings": ("_gather_along_first_dim", "_reduce_scatter_along_first_dim"),
    "megatron.core.transformer.moe.token_dispatcher": ("maybe_move_tensor_to_cpu",),
    "megatron.core.dist_checkpointing.strategies.filesystem_async": (
        "_results_queue",
    ),  # training/engines/megatron_engine.py
}
"""Every megatron-core name this package replaces or reads that is not public API: a release
that renames one breaks the CPU mode (or the engine's save queue) silently, so they are checked."""

_CPU = torch.device("cpu")
_STATE: dict[str, Any] = {"mode": None}


def _is_cuda(device: Any) -> bool:
    """A CUDA device as megatron spells it: "cuda[:n]", torch.device("cuda"), or a bare ordinal."""
    if isinstance(device, bool):
        return False
    if isinstance(device, int):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    return isinstance(device, torch.device) and device.type == "cuda"


def _cpu_type_name(name: str) -> str:
    return name.replace("torch.cuda.", "torch.")


class _CudaToCpuMode(TorchFunctionMode):
    """Rewrites CUDA device arguments of every torch call to the CPU."""

    # A mode is switched off while its own handler runs; these calls run user code (backward
    # hooks, activation recompute) that must meet the mode again, so they re-enter it.
    _REENTRANT = frozenset({torch.Tensor.backward, torch.autograd.backward, torch.autograd.grad})
    # .cuda() and .pin_memory() have no CPU meaning: the tensor already lives where it will be used.
    _IDENTITY = frozenset({torch.Tensor.cuda, torch.Tensor.pin_memory})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func in self._REENTRANT:
            with self:
                return redispatch_function(func, types, args, kwargs)
        if func in self._IDENTITY:
            return args[0]
        if func is torch.Tensor.type:
            return self._tensor_type(args, kwargs)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = _CPU
        # Pinned host memory needs a CUDA context; on CPU it would only fail.
        if kwargs.get("pin_memory"):
            kwargs["pin_memory"] = False
        if func is torch.Tensor.to:
            args = tuple(_CPU if i > 0 and _is_cuda(a) else a for i, a in enumerate(args))
        return func(*args, **kwargs)

    @staticmethod
    def _tensor_type(args, kwargs):
        """`t.type()` reports the torch.cuda.* name megatron's optimizers and grad clipping
        check for; `t.type("torch.cuda.X")` converts to the CPU type of the same dtype."""
        tensor, rest = args[0], args[1:]
        if not rest and "dtype" not in kwargs:
            return torch.Tensor.type(tensor).replace("torch.", "torch.cuda.", 1)
        rest = tuple(_cpu_type_name(a) if isinstance(a, str) else a for a in rest)
        if isinstance(kwargs.get("dtype"), str):
            kwargs["dtype"] = _cpu_type_name(kwargs["dtype"])
        return torch.Tensor.type(tensor, *rest, **kwargs)


def _cpu_rng_state(device: Any = None, clone: bool = False, graph_safe: bool = False) -> torch.Tensor:
    """Replaces megatron's _get_cuda_rng_state: activation recompute saves "the CUDA state"."""
    return torch.get_rng_state()


def _set_cpu_rng_state(new_state: torch.Tensor, device: Any = -1, graph_safe: bool = False) -> None:
    """Replaces megatron's _set_cuda_rng_state: recompute restores it before re-running dropout."""
    torch.set_rng_state(new_state)


def _cpu_tracker_class():
    from megatron.core.tensor_parallel import random as mp_random

    class CpuRNGStatesTracker(mp_random.CudaRNGStatesTracker):
        """Megatron's named RNG streams (model-parallel, data-parallel, expert) kept as CPU
        generator states; `fork` swaps one in around dropout in tensor-parallel regions."""

        def add(self, name: str, seed: int) -> None:
            if seed in self.seeds_:
                raise ValueError(f"seed {seed} already exists")
            if name in self.states_:
                raise ValueError(f"rng state {name} already exists")
            self._is_initialized = True
            self.seeds_.add(seed)
            self.states_[name] = torch.Generator().manual_seed(seed).get_state()

        @contextlib.contextmanager
        def fork(self, name: str = mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME) -> Iterator[None]:
            if name not in self.states_:
                raise ValueError(f"rng state {name} is not added")
            outer = torch.get_rng_state()
            torch.set_rng_state(self.states_[name])
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                torch.set_rng_state(outer)

    return CpuRNGStatesTracker


class _Stream:
    """A CUDA stream or event as megatron's MoE token dispatcher uses them (a side stream for its
    device-to-host copies): CPU ops complete in program order, so waiting is a no-op and an event
    has always happened."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Stream)

    def __hash__(self) -> int:
        return 0

    def wait_stream(self, *args: Any) -> None:
        pass

    def wait_event(self, *args: Any) -> None:
        pass

    def record_event(self, *args: Any) -> _Stream:
        return self

    def record(self, *args: Any) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True


def _splits_to_host(tensor: Any, as_numpy: bool = False, record_stream: bool = False) -> Any:
    """megatron's `maybe_move_tensor_to_cpu` converts to numpy only what it copies off a GPU; the
    all-to-all's split sizes must be a sequence of ints on the CPU too."""
    return tensor.numpy() if as_numpy and torch.is_tensor(tensor) else tensor


def _uneven_gather(gather, reduce_scatter):
    """gloo gathers and reduce-scatters equal parts only; the MoE dispatcher under TP moves each
    rank's routed tokens, unequal in number. The uneven cases run as an equal gather of padded
    parts and as an all-reduce then this rank's part; the equal ones are megatron's own."""

    def gather_uneven(input_, group, output_split_sizes=None, use_global_buffer=False):
        if output_split_sizes is None or group.size() == 1:
            return gather(input_, group, output_split_sizes, use_global_buffer)
        longest = max(output_split_sizes)
        padded = input_.new_zeros((longest, *input_.shape[1:]))
        padded[: input_.shape[0]] = input_
        parts = [torch.empty_like(padded) for _ in output_split_sizes]
        torch.distributed.all_gather(parts, padded, group=group)
        return torch.cat([part[:n] for part, n in zip(parts, output_split_sizes)])

    def reduce_scatter_uneven(input_, group, input_split_sizes=None, use_global_buffer=False):
        if input_split_sizes is None or group.size() == 1:
            return reduce_scatter(input_, group, input_split_sizes, use_global_buffer)
        total = input_.contiguous().clone()
        torch.distributed.all_reduce(total, group=group)
        return total.split(list(input_split_sizes))[group.rank()].contiguous()

    return gather_uneven, reduce_scatter_uneven


def _enable_moe_shims() -> None:
    """The MoE layer's CUDA-only points: side streams and events, split sizes left as tensors, a
    name `moe_utils` only defines when Transformer Engine imports, and the uneven collectives of
    its dispatcher under tensor parallelism."""
    from megatron.core.tensor_parallel import mappings
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim = _uneven_gather(
        mappings._gather_along_first_dim, mappings._reduce_scatter_along_first_dim
    )

    torch.cuda.Stream = torch.cuda.Event = _Stream
    torch.cuda.current_stream = lambda device=None: _Stream()
    torch.cuda.stream = lambda stream=None: contextlib.nullcontext()
    token_dispatcher.maybe_move_tensor_to_cpu = _splits_to_host
    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def compatibility_problems() -> list[str]:
    """One line per way the installed megatron-core differs from the one the patches were
    written for: its version outside WRITTEN_FOR, or a private name gone."""
    version = importlib.metadata.version("megatron-core")
    release = tuple(int(part) for part in version.split(".")[:2] if part.isdigit())
    low, high = WRITTEN_FOR
    problems = (
        []
        if low <= release < high
        else [
            f"megatron-core {version} is installed; the CPU layer and the engine's patches were written for "
            f"{'.'.join(map(str, low))}.x (pip install 'megatron-core>={low[0]}.{low[1]},<{high[0]}.{high[1]}')"
        ]
    )
    for module_name, names in PRIVATE_NAMES.items():
        module = importlib.import_module(module_name)
        problems += [
            f"megatron-core {version}: {module_name}.{name} is gone, which megatron_cpu.py relies on"
            for name in names
            if not hasattr(module, name)
        ]
    return problems


def enable_cpu_mode() -> None:
    """Install every CPU shim; idempotent. Call before megatron builds a model or an optimizer."""
    if _STATE["mode"] is not None:
        return
    if torch.cuda.is_available():
        raise RuntimeError("CPU mode is for machines without a GPU; this one has CUDA devices")
    _import_uncompiled()
    for problem in compatibility_problems():
        warnings.warn(problem, stacklevel=2)
    from megatron.core.tensor_parallel import random as mp_random

    # Megatron allocates on torch.cuda.current_device(); the CPU device makes those calls work as is.
    torch.cuda.current_device = lambda: _CPU
    # p2p communication and checkpoint writers wait for kernels; CPU ops are already complete.
    torch.cuda.synchronize = lambda device=None: None
    mp_random._get_cuda_rng_state = _cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    # Megatron's tracker slot, marked initialised, so get_cuda_rng_tracker() never builds a CUDA one.
    mp_random._CUDA_RNG_STATE_TRACKER = _cpu_tracker_class()()
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    _enable_moe_shims()
    mode = _CudaToCpuMode()
    mode.__enter__()  # held for the life of the process: megatron calls CUDA APIs at any time
    _STATE["mode"] = mode


def auto_cpu_mode() -> bool:
    """Enable CPU mode when there is no GPU; return whether it is on. Never touches a GPU run."""
    if not torch.cuda.is_available():
        enable_cpu_mode()
    return cpu_mode_enabled()


def cpu_mode_enabled() -> bool:
    return _STATE["mode"] is not None


def prepare_megatron_import() -> None:
    """Call before anything imports megatron-core. Its import warns about optional GPU libraries
    (TE, Apex) a CPU run never has, and torch about deprecated collectives, ShardedTensor and
    non-leaf .grad reads inside megatron: none of them is something a user of this project can act
    on, so they are filtered. Without a GPU, megatron-core is imported here with its fusions
    uncompiled (`_import_uncompiled`)."""
    for pattern in (
        r".*Transformer Engine and Apex are not installed.*",
        r".*Apex is not installed.*",
        r".*is deprecated\. Please use `torch\.distributed.*",
        r".*full scope is deprecated.*",
        r".*\.grad attribute of a Tensor that is not a leaf.*",
        r".*CUDA_DEVICE_MAX_CONNECTIONS.*",
        r".*`load_state_dict` is deprecated.*",
        r".*deprecating ShardedTensor.*",
    ):
        warnings.filterwarnings("ignore", message=pattern)
    if not torch.cuda.is_available():
        _import_uncompiled()


def _uncompiled(model: Any = None, **_: Any) -> Any:
    return model if model is not None else (lambda fn: fn)


def _import_uncompiled() -> None:
    """megatron-core wraps its small fusions (bias-GeLU, SwiGLU, the router's and norms' helpers)
    in torch.compile as it is imported (megatron.core.jit), for GPU kernels. On a CPU that costs a
    process about 4 s at import (dynamo and inductor load) and an inductor compile at each fusion's
    first call, so it is imported with torch.compile standing in as the identity (megatron.core.jit
    is megatron-core's only caller of it) and its modules imported later get its own no-op fuser.
    A megatron-core imported before this keeps its compiled fusions."""
    if "megatron.core" not in sys.modules:
        compile_ = torch.compile
        torch.compile = _uncompiled
        try:
            importlib.import_module("megatron.core")
        finally:
            torch.compile = compile_
    from megatron.core import jit

    jit.disable_jit_fuser()


def dist_backend() -> str:
    """The torch.distributed backend for this machine: gloo in CPU mode, NCCL on GPUs."""
    return "gloo" if cpu_mode_enabled() else "nccl"


def model_parallel_seed(seed: int) -> None:
    """Seed the default generator and megatron's named RNG streams, per tensor-parallel rank.

    Mirrors megatron's `model_parallel_cuda_manual_seed`, which only seeds CUDA generators: the
    default (data-parallel) stream gets `seed`, the model-parallel stream `seed + 2718 + tp_rank`
    (different dropout masks on different TP shards), the expert stream
    `seed + 1024 + 100 * ep_rank + etp_rank`. Call after parallel_state is initialised.
    """
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel import random as mp_random

    torch.manual_seed(seed)
    if not auto_cpu_mode():
        mp_random.model_parallel_cuda_manual_seed(seed)
        return
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, seed)
    tracker.add(
        mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, seed + 2718 + parallel_state.get_tensor_model_parallel_rank()
    )
    tracker.add(
        mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME,
        seed
        + 1024
        + 100 * parallel_state.get_expert_model_parallel_rank()
        + parallel_state.get_expert_tensor_parallel_rank(),
    )
