"""The accelerators a plan is made for: memory, dense peak FLOP/s and link bandwidths.

Peaks are the vendors' dense (not sparse) figures for the SXM parts; bandwidths are one direction
per GPU: NVLink within a node, the node's InfiniBand share across nodes (one 400 Gb/s NIC per
GPU on H100/H200/B200 systems, 200 Gb/s on A100 ones).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from setdiff_megatron.errors import UserError

__all__ = ["DEVICES", "Device", "device"]


@dataclass(frozen=True)
class Device:
    name: str
    memory_gib: float
    bf16_tflops: float
    fp8_tflops: float | None
    intra_node_gbps: float
    """GB/s one way per GPU within a node."""
    inter_node_gbps: float
    """GB/s one way per GPU across nodes."""


DEVICES = {
    "h100-80gb": Device("H100 SXM 80GB", 80, 989, 1979, 450, 50),
    "h200-141gb": Device("H200 SXM 141GB", 141, 989, 1979, 450, 50),
    "b200-180gb": Device("B200 180GB", 180, 2250, 4500, 900, 50),
    "a100-80gb": Device("A100 SXM 80GB", 80, 312, None, 300, 25),
    "a100-40gb": Device("A100 SXM 40GB", 40, 312, None, 300, 25),
    "l40s-48gb": Device("L40S 48GB", 48, 362, 733, 32, 25),
}


def device(name: str, *, memory_gib: float | None = None, tflops: float | None = None) -> Device:
    """A listed device, or with `memory_gib` and `tflops` one that is not (bandwidths then the
    H100's); either figure overrides a listed device's."""
    if name in DEVICES:
        found = DEVICES[name]
    elif memory_gib is not None and tflops is not None:
        found = replace(DEVICES["h100-80gb"], name=name, fp8_tflops=None)
    else:
        raise UserError(
            f"--gpu {name!r} is not a listed device ({', '.join(DEVICES)}); "
            "give --gpu-memory and --gpu-tflops for another one"
        )
    if memory_gib is not None:
        found = replace(found, memory_gib=memory_gib)
    if tflops is not None:
        found = replace(found, bf16_tflops=tflops)
    return found
