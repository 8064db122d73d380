"""The parallel layout of a job: how its processes split into tensor, pipeline, context, expert
and data parallelism.

megatron-core's ordering: a world of `tp x pp x cp x dp` processes, TP fastest; expert
parallelism is carved out of the `dp x cp` ranks of one pipeline stage, so `ep` must divide
`dp x cp` and needs no processes of its own. A checkpoint records its layout with `as_record`,
so a resume on another layout can say what changed.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Layout"]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    """Virtual pipeline stages per rank (interleaved 1F1B); None: plain 1F1B."""
    cp: int = 1
    ep: int = 1
    dp: int = 1

    @classmethod
    def of(
        cls, world_size: int, *, tp: int = 1, pp: int = 1, vpp: int | None = None, cp: int = 1, ep: int = 1
    ) -> Layout:
        """The layout of `world_size` processes with these model-parallel sizes (dp is what is left)."""
        model = tp * pp * cp
        if world_size % model:
            raise ValueError(f"tp x pp x cp = {model} does not divide the {world_size} processes")
        layout = cls(tp=tp, pp=pp, vpp=vpp, cp=cp, ep=ep, dp=world_size // model)
        problems = layout.problems()
        if problems:
            raise ValueError(problems[0])
        return layout

    @property
    def world_size(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    def problems(self) -> list[str]:
        """Why this layout cannot run, one line each (empty when it can)."""
        out = [
            f"{name} must be >= 1, got {value}"
            for name, value in (("tp", self.tp), ("pp", self.pp), ("cp", self.cp), ("ep", self.ep), ("dp", self.dp))
            if value < 1
        ]
        if self.vpp is not None and (self.vpp < 1 or self.pp == 1):
            out.append("virtual pipeline stages (vpp) need pp > 1")
        if (self.dp * self.cp) % self.ep:
            out.append(
                f"ep ({self.ep}) must divide dp x cp ({self.dp} x {self.cp}): experts are spread over "
                "the data- and context-parallel ranks of a stage"
            )
        return out

    def as_record(self) -> dict:
        return {
            "tp": self.tp,
            "pp": self.pp,
            "vpp": self.vpp,
            "cp": self.cp,
            "ep": self.ep,
            "dp": self.dp,
            "world_size": self.world_size,
        }

    def describe(self) -> str:
        parts = [f"tp {self.tp}", f"pp {self.pp}", f"vpp {self.vpp or 1}"]
        parts += [f"{k} {v}" for k, v in (("cp", self.cp), ("ep", self.ep)) if v > 1]
        return " ".join(parts + [f"dp {self.dp}"])
