"""What a recipe needs on N GPUs of a kind: each pipeline stage's most loaded rank measured under
fake tensors (planning/measure.py), the step's FLOPs, a step-time lower bound, and the sampler's
KV cache. docs/scaling.md says how each figure is made and how close it came to real runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from setdiff_megatron.errors import UserError
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.planning.devices import Device
from setdiff_megatron.planning.measure import RankMemory
from setdiff_megatron.recipes.schema import Recipe

__all__ = ["Plan", "make_plan", "nearest_fitting", "plan_recipe", "search_layouts"]

GIB = 2**30
ACTIVATION_BYTES = 2
"""bf16 activations and weights on the wire."""


@dataclass(frozen=True)
class Plan:
    recipe: Recipe
    model_cfg: ModelConfig
    gpus: int
    gpus_per_node: int
    device: Device
    margin: float
    stages: list[RankMemory]

    # ---- memory --------------------------------------------------------------------------
    @property
    def peak(self) -> int:
        return max(s.peak for s in self.stages)

    @property
    def budget(self) -> float:
        return self.device.memory_gib * GIB * (1 - self.margin)

    @property
    def fits(self) -> bool:
        return self.peak <= self.budget

    # ---- time ----------------------------------------------------------------------------
    @property
    def step_flops(self) -> float:
        from setdiff_megatron.training.metric_sinks import training_flops_per_token

        r = self.recipe
        return training_flops_per_token(self.model_cfg, r.data.seq_len) * r.data.seq_len * r.parallel.global_batch_size

    @property
    def peak_flops(self) -> float:
        fp8 = self.recipe.train.fp8 is not None and self.device.fp8_tflops
        return (self.device.fp8_tflops if fp8 else self.device.bf16_tflops) * 1e12

    @property
    def compute_seconds(self) -> float:
        """The step's FLOPs at the devices' peak (with full recompute a second forward: 4/3 of
        them), stretched by the pipeline bubble of 1F1B."""
        p = self.recipe.parallel
        bubble = (p.pp - 1) / (self.stages[0].micro_batches * (p.vpp or 1))
        executed = self.step_flops * (4 / 3 if self.recipe.train.recompute == "full" else 1)
        return executed / (self.gpus * self.peak_flops) * (1 + bubble)

    @property
    def communication_seconds(self) -> float:
        """Tensor parallelism's collectives in every layer (under sequence parallelism two
        all-gathers and two reduce-scatters of the layer input forward, twice that backward) over
        NVLink, and the data-parallel gradient reduce-scatter (fp32) and parameter all-gather
        after the backward, over InfiniBand once the data-parallel group leaves the node (ZeRO-3
        gathers the bf16 weights again forward and backward). Not overlapped with compute: the
        megatron engine reduces gradients after the backward (DeepSpeed overlaps some: a bound
        all the same)."""
        r, p = self.recipe, self.recipe.parallel
        streams = 1 if r.method.family == "mdlm" else 2
        layer_input = streams * r.data.seq_len * p.micro_batch_size * self.model_cfg.hidden_size * ACTIVATION_BYTES
        per_layer = 12 * layer_input * (p.tp - 1) / p.tp
        layers = max(s.layers for s in self.stages)
        tp_seconds = per_layer * layers * self.stages[0].micro_batches / (self.device.intra_node_gbps * 1e9)
        dp = self.gpus // (p.tp * p.pp * p.cp)
        model_parallel = p.tp * p.pp * p.cp
        bandwidth = (
            self.device.intra_node_gbps if model_parallel * dp <= self.gpus_per_node else self.device.inter_node_gbps
        )
        local_params = max(s.num_params for s in self.stages)
        dp_bytes = local_params * (4 + ACTIVATION_BYTES) * (dp - 1) / dp
        if r.engine == "deepspeed" and p.zero_stage == 3:  # the weights gathered again forward and backward
            dp_bytes += 2 * local_params * ACTIVATION_BYTES * (dp - 1) / dp
        return tp_seconds + dp_bytes / (bandwidth * 1e9)

    @property
    def step_seconds(self) -> float:
        return self.compute_seconds + self.communication_seconds

    @property
    def tokens_per_second(self) -> float:
        r = self.recipe
        return r.data.seq_len * r.parallel.global_batch_size / self.step_seconds

    @property
    def mfu_bound(self) -> float:
        return self.step_flops / (self.step_seconds * self.gpus * self.peak_flops)

    # ---- sampling ------------------------------------------------------------------------
    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in every layer, bf16, on one TP rank."""
        c = self.model_cfg
        return 2 * c.num_layers * c.num_kv_heads * c.head_dim * ACTIVATION_BYTES // self.recipe.parallel.tp

    @property
    def sampling_batch(self) -> int:
        """Sequences of max_seq_len tokens whose cache fits beside the bf16 weights (TP ranks)."""
        c, tp = self.model_cfg, self.recipe.parallel.tp
        room = self.budget - c.num_params() * ACTIVATION_BYTES / tp
        return max(0, int(room // (self.kv_bytes_per_token * c.max_seq_len)))

    # ---- reports -------------------------------------------------------------------------
    @property
    def layout(self) -> str:
        p = self.recipe.parallel
        dp = self.gpus // (p.tp * p.pp * p.cp)
        parts = [f"TP{p.tp}" if p.tp > 1 else "", f"PP{p.pp}" if p.pp > 1 else "", f"VPP{p.vpp}" if p.vpp else ""]
        parts += [f"CP{p.cp}" if p.cp > 1 else "", f"EP{p.ep}" if p.ep > 1 else "", f"DP{dp}"]
        if self.recipe.engine == "deepspeed":
            parts.append(f"ZeRO-{p.zero_stage}")
        return " x ".join(x for x in parts if x)

    def summary(self) -> str:
        verdict = "fits" if self.fits else "does NOT fit"
        return (
            f"plan: {self.gpus} x {self.device.name}, {self.layout}: peak {self.peak / GIB:.1f} GiB of "
            f"{self.device.memory_gib:g} ({verdict} with a {self.margin:.0%} margin); at most "
            f"{self.tokens_per_second:,.0f} tokens/s (MFU <= {self.mfu_bound:.0%})"
        )

    def report(self) -> str:
        r, c = self.recipe, self.model_cfg
        lines = [
            f"recipe {r.name}: {c.num_params() / 1e9:.2f} B parameters, vocabulary {c.vocab_size}, "
            f"seq_len {r.data.seq_len} ({'one stream' if r.method.family == 'mdlm' else 'two streams'}), "
            f"micro-batch {r.parallel.micro_batch_size}, global batch {r.parallel.global_batch_size}, "
            f"{r.train.precision}, recompute {r.train.recompute}",
            f"{self.gpus} x {self.device.name} ({self.gpus_per_node} per node), {self.layout}",
            "",
            "stage  layers  params  grads  optimizer  activations  peak (GiB, the stage's most loaded rank)",
        ]
        for i, s in enumerate(self.stages):
            lines.append(
                f"{i:>5}  {s.layers:>6}  {s.params / GIB:6.2f}  {s.grads / GIB:5.2f}  {s.optimizer / GIB:9.2f}  "
                f"{s.activations / GIB:11.2f}  {s.peak / GIB:5.2f}"
            )
        lines += [
            "",
            f"memory: peak {self.peak / GIB:.2f} GiB of {self.device.memory_gib:g} GiB: "
            + ("fits" if self.fits else "does NOT fit")
            + f" with a {self.margin:.0%} margin ({self.budget / GIB:.1f} GiB usable); "
            f"{self.stages[0].micro_batches} micro-batches per step per data-parallel rank",
            f"compute: {self.step_flops / 1e15:.2f} PFLOP per step; at {self.peak_flops / 1e12:g} TFLOP/s per GPU "
            f"{self.compute_seconds:.3f} s with the pipeline bubble, + {self.communication_seconds:.3f} s of "
            "TP and DP communication",
            f"step time >= {self.step_seconds:.3f} s: at most {self.tokens_per_second:,.0f} tokens/s, "
            f"MFU <= {self.mfu_bound:.0%}",
            f"sampling at TP{r.parallel.tp}: KV cache {self.kv_bytes_per_token / 1024:.1f} KiB per token per GPU; "
            f"{self.sampling_batch} sequences of {c.max_seq_len} tokens fit beside the weights",
        ]
        return "\n".join(lines)


def _for_plan(recipe: Recipe, gpus: int) -> Recipe:
    """The recipe as the fake rank builds it: `gpus` processes, megatron's local layers (TE's need
    a GPU; the parameters are the same), no weights read."""
    return updated(
        recipe,
        launch={"nnodes": 1, "nproc_per_node": gpus, "device": "cpu"},
        model={"backend": "local", "init_from": None},
    )


def updated(recipe: Recipe, **sections: dict) -> Recipe:
    """`recipe` with these fields of its sections changed, validated again."""
    data = recipe.model_dump()
    for name, fields in sections.items():
        data[name] = {**data[name], **fields}
    return Recipe.model_validate(data)


def make_plan(
    recipe: Recipe, model_cfg: ModelConfig, gpus: int, device: Device, *, gpus_per_node: int = 8, margin: float = 0.1
) -> Plan:
    """Measure each pipeline stage's first rank (megatron orders ranks TP, CP, DP, then PP: the
    stage's ranks hold the same shapes; under DeepSpeed rank 0, whose ZeRO partition is the
    largest) and assemble the plan."""
    from setdiff_megatron.planning.attention_footprint import kernel_footprint
    from setdiff_megatron.planning.fake_world import fake_rank
    from setdiff_megatron.planning.measure import measure_megatron_rank
    from setdiff_megatron.planning.measure_deepspeed import measure_deepspeed_rank
    from setdiff_megatron.recipes.validation import validate_recipe

    errors = validate_recipe(recipe, world_size=gpus, has_gpu=True, check_paths=False, model_config=model_cfg)
    if errors:
        raise UserError(f"{recipe.name} on {gpus} GPUs: {errors[0]}")
    planned = _for_plan(recipe, gpus)
    measure = measure_deepspeed_rank if recipe.engine == "deepspeed" else measure_megatron_rank
    pp = recipe.parallel.pp
    stages = []
    for stage in range(pp):
        with fake_rank(gpus, stage * (gpus // pp)), kernel_footprint():
            stages.append(measure(planned, model_cfg, fake=True))
    return Plan(recipe, model_cfg, gpus, min(gpus_per_node, gpus), device, margin, stages)


def search_layouts(recipe: Recipe, model_cfg: ModelConfig, gpus: int) -> list[Recipe]:
    """Every layout of `gpus` GPUs that the recipe's rules allow: for megatron each (tp, pp), the
    recipe's cp, ep, micro-batch and recompute kept, sequence parallelism on wherever tp > 1; for
    DeepSpeed each ZeRO stage."""
    from setdiff_megatron.recipes.validation import validate_recipe

    if recipe.engine == "deepspeed":
        candidates = [updated(recipe, parallel={"zero_stage": stage}) for stage in range(4)]
    else:
        candidates = [
            updated(recipe, parallel={"tp": tp, "pp": pp, "vpp": None, "sequence_parallel": tp > 1})
            for tp in _divisors(gpus)
            for pp in _divisors(gpus // tp)
        ]
    return [
        c
        for c in candidates
        if not validate_recipe(c, world_size=gpus, has_gpu=True, check_paths=False, model_config=model_cfg)
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def plan_recipe(recipe: Recipe, model_cfg: ModelConfig, gpus: int, device: Device, **kwargs) -> Plan:
    """The plan of the recipe's own layout, with a one-line error for a GPU count it cannot use."""
    p = recipe.parallel
    if gpus < 1 or gpus % (p.tp * p.pp * p.cp):
        raise UserError(
            f"--gpus {gpus}: the recipe's layout needs a multiple of tp x pp x cp = {p.tp * p.pp * p.cp} GPUs "
            "(or plan with --search)"
        )
    return make_plan(recipe, model_cfg, gpus, device, **kwargs)


def nearest_fitting(plans: list[Plan]) -> Plan | None:
    """The fastest plan that fits, if any."""
    fitting = [p for p in plans if p.fits]
    return max(fitting, key=lambda p: p.tokens_per_second) if fitting else None
