"""Bytes of tensor storage alive at each moment, and the peak: what a device's caching allocator
would hold at least, counted the same way for real tensors (a run on this machine) and for fake
ones (the plan of a run on GPUs that are not here).

Every tensor an operator returns is looked at once: its storage, if new, is counted until it is
freed (meta tensors, shapes without memory, are not). Storages made before the tracker starts are
not counted; the planner builds everything under it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

__all__ = ["LiveBytes"]


class LiveBytes(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.current = 0
        self.peak = 0
        self._refs: dict[int, weakref.ref] = {}

    def reset_peak(self) -> None:
        self.peak = self.current

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":  # meta tensors hold no memory
                self._track(t)
        return out

    def _track(self, t: torch.Tensor) -> None:
        storage = t.untyped_storage()
        key = id(storage)
        if key in self._refs and self._refs[key]() is storage:
            return
        nbytes = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, key=key, nbytes=nbytes: self._free(key, nbytes))
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def _free(self, key: int, nbytes: int) -> None:
        self._refs.pop(key, None)
        self.current -= nbytes
