"""The megatron-core engine: the set-causal model as megatron ModuleSpecs under TP, PP, CP, EP and DP.

It builds the process groups (gloo on a CPU through the compatibility layer, NCCL on GPUs), this
rank's model chunks in megatron DDP, megatron's optimizer and LR scheduler, and a step through
get_forward_backward_func() over one global batch's micro-batches. The update uses megatron's own
pieces with the gradient norm checked for finiteness before anything is applied, so the NaN
policy means what it means under the DeepSpeed engine. Checkpoints are dist_checkpointing shards
that reshard over TP, PP and DP. docs/training.md ("Training and checkpoints").
"""

from __future__ import annotations

import contextlib
import math
import queue
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from setdiff_megatron.checkpoint.ema_files import average_shards, empty_averages, load_averaged
from setdiff_megatron.checkpoint.megatron_shards import load_shards, model_sharded_state, save_shards
from setdiff_megatron.checkpoint.names import RNG_FILE
from setdiff_megatron.checkpoint.resolve import Resumed
from setdiff_megatron.distributed import runtime
from setdiff_megatron.distributed.child_processes import start_manager
from setdiff_megatron.distributed.layout import Layout
from setdiff_megatron.distributed.signals import PREEMPTION_SIGNALS, blocked
from setdiff_megatron.log import say
from setdiff_megatron.models.config import ModelConfig
from setdiff_megatron.models.dtypes import DTYPES
from setdiff_megatron.models.lora import is_adapter_key, load_weights
from setdiff_megatron.recipes import Recipe
from setdiff_megatron.training import lr_schedule
from setdiff_megatron.training.engines.base import Engine, StepOutcome, evaluating, fill_torch_optimizer_state
from setdiff_megatron.training.engines.rng import host_rng_state, set_host_rng_state
from setdiff_megatron.training.expert_load import ExpertLoad
from setdiff_megatron.training.objective import Objective
from setdiff_megatron.training.weight_average import Share

__all__ = ["MegatronEngine", "build_optimizer"]


def _same_layout(saved: dict, here: dict) -> bool:
    """Layouts equal, counting keys an older checkpoint lacks (cp, ep) at their default of 1."""
    return all(saved.get(k, 1 if k in ("cp", "ep") else None) == v for k, v in here.items())


def _layout_text(lay: dict) -> str:
    optim = {True: "distributed optimizer", False: "optimizer per rank", None: "weights only"}
    more = "".join(f" {k} {lay[k]}" for k in ("cp", "ep") if lay.get(k, 1) > 1)
    return (
        f"tp {lay['tp']} pp {lay['pp']} vpp {lay.get('vpp') or 1}{more} dp {lay['dp']}, "
        f"{optim[lay['distributed_optimizer']]}"
    )


class MegatronEngine(Engine):
    name = "megatron"

    def __init__(self, recipe: Recipe):
        from megatron.core import parallel_state

        p = recipe.parallel
        self.recipe = recipe
        self.layout = Layout.of(runtime.world_size(), tp=p.tp, pp=p.pp, vpp=p.vpp, ep=p.ep, cp=p.cp)
        runtime.init_model_parallel(self.layout, recipe.train.seed)
        self.dp_rank, self.dp_size = parallel_state.get_data_parallel_rank(), self.layout.dp
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.sync_seconds = 0.0
        self._async_saves = None  # megatron's AsyncCallsQueue, made by the first background save
        self._background_results = None  # the background saves' write-results queue (`_results_queue`)

    # ---- building --------------------------------------------------------------------------

    def build(self, model_cfg: ModelConfig, total_steps: int, *, router_stats: bool = True, **config_overrides) -> None:
        """The chunks, DDP buffers and optimizer; `config_overrides` change TransformerConfig fields
        and `router_stats` off leaves the MoE routing statistics out (the planner's stand-ins,
        planning/measure.py)."""
        from megatron.core.distributed import (
            DistributedDataParallel,
            DistributedDataParallelConfig,
            finalize_model_grads,
        )
        from megatron.core.pipeline_parallel import get_forward_backward_func

        from setdiff_megatron.models.megatron_forward import (
            build_model_chunks,
            forward_step,
            pipeline_seq_length,
            transformer_config_from,
        )
        from setdiff_megatron.models.megatron_model import adapt_megatron_model

        r, t = self.recipe, self.recipe.train
        overrides = (
            dict(fp8=t.fp8, fp8_recipe=t.fp8_recipe, fp8_dot_product_attention=t.fp8_dot_product_attention)
            if t.fp8 is not None
            else {}
        )
        config = transformer_config_from(
            model_cfg,
            tp=r.parallel.tp,
            pp=r.parallel.pp,
            vpp=r.parallel.vpp,
            ep=r.parallel.ep,
            cp=r.parallel.cp,
            sequence_parallel=r.parallel.sequence_parallel,
            recompute=t.recompute,
            params_dtype=DTYPES[t.precision],
            **overrides,
            **config_overrides,
        )
        config.finalize_model_grads_func = self._timed(finalize_model_grads)  # the DP gradient all-reduce
        chunks = build_model_chunks(model_cfg, config, backend=r.model.backend)
        if torch.cuda.is_available():
            chunks = [c.cuda() for c in chunks]
        if r.model.lora is not None:  # frozen weights, trained adapters (models/lora.py), before DDP
            for chunk in chunks:
                adapt_megatron_model(chunk, r.model.lora.spec(), t.seed)
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True, use_distributed_optimizer=r.parallel.distributed_optimizer
        )
        self.model_cfg = model_cfg
        self.chunks = [DistributedDataParallel(config, ddp_config, c) for c in chunks]
        self.optimizer, self.scheduler = build_optimizer(r, self.chunks, total_steps)
        self._start_ema()
        self._schedule = get_forward_backward_func()
        self._forward_step = partial(forward_step, weigh=Objective.of(r))
        self._seq_length = pipeline_seq_length(r.data.seq_len, streams=1 if r.method.family == "mdlm" else 2)
        self.expert_load = (
            watch_routers(chunks, model_cfg, self.device) if model_cfg.num_experts and router_stats else None
        )

    def init_from(self, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
        """Each rank loads its own chunks, mapped for its (tp, pp, vpp) position, then the
        optimizer's main (fp32) params copy the loaded weights."""
        for chunk in self.chunks:
            self._load_torch_weights(chunk.module, state_dict, model_cfg)
        self.optimizer.reload_model_params()

    def _load_torch_weights(self, module, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
        """A chunk's share of torch-model weights, mapped for this rank's (tp, pp, vpp, ep) position."""
        from megatron.core import parallel_state

        from setdiff_megatron.models.weight_maps.megatron_map import torch_to_megatron

        p = self.recipe.parallel
        mapped = torch_to_megatron(
            state_dict,
            model_cfg,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            tp_size=p.tp,
            pp_rank=parallel_state.get_pipeline_model_parallel_rank(),
            pp_size=p.pp,
            vp_size=p.vpp,
            vp_stage=module.vp_stage,
            ep_rank=parallel_state.get_expert_model_parallel_rank(),
            ep_size=p.ep,
            backend=self.recipe.model.backend,
        )
        load_weights(module, mapped, "model.init_from: a megatron chunk")

    # ---- RL (training/rollouts.py): sampling from, and scoring with, the policy ----------

    def policy_model(self):
        """The model being trained, as the sampler's StepModel (RL runs at pp = 1: one chunk)."""
        return self.chunks[0].module

    @contextlib.contextmanager
    def decoding(self) -> Iterator[None]:
        """RL's rollouts decode with FP8 off: megatron-core enters an fp8 autocast for any forward
        of a model whose config sets fp8, and TE's FP8 GEMMs refuse a decode step's token counts,
        which are not multiples of 8 (recipes/schema.py, `TrainSection.fp8_rules`). The exact likelihoods
        of the decoded tokens are computed afterwards by forwards in FP8, as training's are."""
        config = self.chunks[0].module.config
        fp8, config.fp8 = config.fp8, None
        try:
            yield
        finally:
            config.fp8 = fp8

    def set_reference(self, state_dict: dict[str, torch.Tensor], model_cfg: ModelConfig) -> None:
        """A frozen copy of `state_dict`'s weights, this rank's shard of it: RL's KL reference."""
        from setdiff_megatron.models.megatron_forward import build_model_chunks

        (reference,) = build_model_chunks(model_cfg, self.chunks[0].module.config, backend=self.recipe.model.backend)
        self._load_torch_weights(reference, state_dict, model_cfg)
        self.reference = reference.to(self.device).eval().requires_grad_(False)

    @torch.no_grad()
    def token_logprobs(self, batches, *, reference: bool = False) -> list[torch.Tensor]:
        """Each target's log-probability [b, L] under the policy (or the reference), no gradient."""
        from setdiff_megatron.models.megatron_forward import batch_nll

        with evaluating(self.reference if reference else self.policy_model()) as model:
            return [-batch_nll(model, b) for b in batches]

    # ---- steps -----------------------------------------------------------------------------

    def _run(self, batches, *, forward_only: bool) -> tuple[float, float]:
        """[weighted NLL sum, denominator] of the global batch (training/objective.py): only
        last-stage ranks report, one per DP replica per TP rank, so the all-reduced sum is divided
        by TP."""
        from megatron.core import parallel_state

        reports = self._schedule(
            forward_step_func=self._forward_step,
            data_iterator=[iter(batches) for _ in self.chunks],
            model=self.chunks,
            num_microbatches=len(batches),
            seq_length=self._seq_length,
            micro_batch_size=self.recipe.parallel.micro_batch_size,
            forward_only=forward_only,
        )
        total = torch.zeros(2, dtype=torch.float64)
        for report in reports or []:
            total += report["lm loss"].detach().double().cpu()
        self._timed(dist.all_reduce)(total)
        nll, count = (total / parallel_state.get_tensor_model_parallel_world_size()).tolist()
        return nll, count

    def _timed(self, collective: Callable) -> Callable:
        def timed(*args, **kwargs):
            start = time.perf_counter()
            out = collective(*args, **kwargs)
            self.sync_seconds += time.perf_counter() - start
            return out

        return timed

    def forward_backward(self, batches) -> tuple[float, float]:
        self.sync_seconds = 0.0
        for c in self.chunks:
            c.zero_grad_buffer()
        self.optimizer.zero_grad()
        if self.expert_load is not None:
            self.expert_load.reset()
        return self._run(batches, forward_only=False)

    def optimizer_step(self) -> StepOutcome:
        """megatron's ChainedOptimizer.step, with the gradient norm checked before the update."""
        from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32

        opt = self.optimizer
        with torch.no_grad():
            if opt.prepare_grads():  # fp16: the loss scaler found inf/nan and lowered its scale
                return StepOutcome(applied=False, grad_norm=None)
            grad_norm = float(opt.get_grad_norm())
            if not math.isfinite(grad_norm):
                return StepOutcome(applied=False, grad_norm=grad_norm, problem="the gradients are not finite")
            for inner in opt.chained_optimizers:
                params = inner.get_parameters()
                if params and inner.config.clip_grad > 0.0:
                    clip_grad_by_total_norm_fp32(
                        params,
                        max_norm=inner.config.clip_grad,
                        total_norm=grad_norm,
                        use_decoupled_grad=inner.config.use_precision_aware_optimizer_no_fp8_or_ds_fp8,
                    )
            applied = opt.step_with_ready_grads()
            if applied:
                self._update_ema()
        self.scheduler.step(increment=1)
        return StepOutcome(applied=applied, grad_norm=grad_norm)

    def discard(self) -> bool:
        return True  # nothing was applied; the next step zeroes the gradient buffers

    def evaluate(self, batches) -> tuple[float, float]:
        for c in self.chunks:
            c.eval()
        with torch.no_grad(), self._ema_weights():
            out = self._run(batches, forward_only=True)
        for c in self.chunks:
            c.train()
        return out

    def lr(self) -> float:
        return self.scheduler.get_lr(self.optimizer.param_groups[0])

    # ---- checkpoints -----------------------------------------------------------------------

    def layout_record(self) -> dict:
        return {**self.layout.as_record(), "distributed_optimizer": self.recipe.parallel.distributed_optimizer}

    def _modules(self) -> list:
        return [c.module for c in self.chunks]

    def _shares(self) -> list[Share]:
        """Each parameter's fp32 main weights on this rank (training/weight_average.py): under the
        distributed optimizer this rank's shard of it, in the order of the optimizer's buffers
        (the same on every data-parallel rank); otherwise the whole main parameter."""
        from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

        names = {p: f"{i}.{n}" for i, c in enumerate(self._modules()) for n, p in c.named_parameters()}
        shares, sharded = [], set()
        for opt in getattr(self.optimizer, "chained_optimizers", [self.optimizer]):
            if not isinstance(opt, DistributedOptimizer):
                continue
            for buffer in opt.buffers:
                for p in buffer.param_index_map:
                    sharded.add(p)
                    if p not in opt.model_param_group_index_map:  # no part of it on this rank
                        shares.append(Share(names[p], p, p.shape, None, group=opt.data_parallel_group))
                        continue
                    main = opt._get_main_param_and_optimizer_states(p)["param"]
                    start = opt._get_model_param_range_map(p)["param"].start
                    shares.append(Share(names[p], p, p.shape, main, start, opt.data_parallel_group))
        for p, name in names.items():
            if p.requires_grad and p not in sharded:
                main = getattr(p, "main_param", None)  # the fp32 copy of a 16-bit parameter
                shares.append(Share(name, p, p.shape, p if main is None else main))
        return shares

    def _sharded_state(self, optimizer, *, is_loading: bool = False, ema: bool = False) -> dict:
        """The model's shards (with LoRA the adapters' only: the frozen base is model.init_from's,
        read again on resume), the optimizer's unless None, and with `ema` the average's: whole
        per parameter, gathered now (collective) for a save, empty ones to fill for a load."""
        keep = is_adapter_key if self.recipe.model.lora is not None else None
        state = model_sharded_state(self._modules(), optimizer, is_loading=is_loading, keep=keep)
        if not ema:
            return state
        if is_loading:
            wholes = empty_averages(s.param for s in self._shares())
        else:
            wholes = {id(s.param): whole for s, whole in self._ema_wholes()}
        return state | average_shards(state, wholes)

    def save(self, directory: Path) -> None:
        self._results_queue(background=False)
        save_shards(self._sharded_state(self.optimizer, ema=self.ema_state() is not None), directory)
        self._save_rng(directory)

    def start_save(self, directory: Path, then: Callable[[], None]) -> None:
        """megatron-core's own async save: dist_checkpointing's request, run by its AsyncCallsQueue
        (a forked writer per save); the RNG states are small and written now. The processes it
        starts (the writer, its workers, the results queue's manager) inherit blocked preemption
        signals, and the results queue's manager ignores them: a SIGTERM that SLURM sends every
        process of the step must reach this one, which decides when the save is finished, and not
        kill a writer half-way."""
        from megatron.core.dist_checkpointing.strategies.async_utils import AsyncCallsQueue

        self._results_queue(background=True)
        with blocked():
            state = self._sharded_state(self.optimizer, ema=self.ema_state() is not None)
            request = save_shards(state, directory, background=True)
            request.add_finalize_fn(then)
            self._save_rng(directory)
            if self._async_saves is None:
                self._async_saves = AsyncCallsQueue()
            self._async_saves.schedule_async_request(request)

    def _results_queue(self, *, background: bool) -> None:
        """Give dist_checkpointing the write-results queue of the next save (its writer takes it
        when made). A synchronous save writes and collects its results in this process: a queue of
        this process. Megatron-core's own would be a manager in a fresh interpreter, which imports
        torch to read the first results (2.5 s of CPU a rank, each run). A background save's
        writer is another process: the queue is a manager we start, once, since megatron-core's
        (a spawned interpreter) unblocks SIGTERM, so its default action would kill it under a
        preemption and lose the save in flight, and nothing ends it when the rank dies without
        running its exit handlers. Ours ignores the preemption signals and exits with the rank
        (distributed/child_processes.py)."""
        from megatron.core.dist_checkpointing.strategies import filesystem_async

        if not background:
            filesystem_async._results_queue = queue.Queue()
            return
        if self._background_results is None:
            self._background_results = start_manager(ignore=PREEMPTION_SIGNALS).Queue()
        filesystem_async._results_queue = self._background_results

    def finish_saves(self, *, blocking: bool) -> bool:
        if self._async_saves is None:
            return True
        self._async_saves.maybe_finalize_async_calls(blocking=blocking)
        return self._async_saves.get_num_unfinalized_calls() == 0

    def _save_rng(self, directory: Path) -> None:
        from megatron.core import tensor_parallel

        rng = {**host_rng_state(), "tracker": tensor_parallel.get_cuda_rng_tracker().get_states()}
        torch.save(rng, directory / RNG_FILE.format(rank=dist.get_rank()))

    def load(self, resumed: Resumed) -> None:
        """Resume from dist_checkpointing shards (checkpoint/megatron_shards.py) on this or another layout.

        Model, optimizer (the distributed optimizer in megatron's `fully_reshardable` format) and
        weight-average shards all reshard over TP, PP and DP; only switching
        `parallel.distributed_optimizer` itself restarts the Adam moments, with a warning. Each
        rank's RNG states are restored on an unchanged layout only."""
        from megatron.core import tensor_parallel

        saved, here = resumed.state.layout, self.layout_record()
        with_optimizer = saved.get("distributed_optimizer") == here["distributed_optimizer"]
        if not _same_layout(saved, here):
            say(f"setdiff: loading {resumed.path}, saved at {_layout_text(saved)}, into {_layout_text(here)}")
        if not with_optimizer:
            say(
                "setdiff: warning: parallel.distributed_optimizer changed since the checkpoint (or it holds weights only): "
                "Adam moments start from zero; weights, step, LR schedule and data position are restored"
            )
        else:
            fill_optimizer_state(self.optimizer)
        ema = self._ema_to_load(resumed)
        with torch.no_grad():
            state = self._sharded_state(self.optimizer if with_optimizer else None, is_loading=True, ema=ema)
            loaded, averages = load_averaged(state, lambda s: load_shards(s, resumed.path))
            for i, c in enumerate(self.chunks):
                load_weights(
                    c.module,
                    loaded[f"model{i}"],
                    f"checkpoint.resume: {resumed.path}",
                    adapters=self.recipe.model.lora is not None,
                )
            if with_optimizer:
                _load_optimizer(self.optimizer, loaded["optimizer"])
            if ema:
                self._load_ema(lambda share: averages[id(share.param)])
        if not resumed.state.weights_only:  # an import's schedule is the recipe's, from step 0
            self.scheduler.load_state_dict(resumed.state.scheduler)
        if _same_layout(saved, here):  # other layouts draw fresh streams from the recipe's seed
            state = torch.load(resumed.path / RNG_FILE.format(rank=dist.get_rank()), weights_only=True)
            set_host_rng_state(state)
            tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])


def watch_routers(chunks, model_cfg: ModelConfig, device: torch.device) -> ExpertLoad:
    """Feed every router's routing of each forward to an ExpertLoad: each TopKRouter's `routing`
    (logits in, routing map out) is wrapped, so the logits are read, not computed again; rows
    under megatron's padding mask (models/megatron_moe.py) are not counted. A full recompute
    repeats a layer's forward inside the backward; that repeat is not counted."""
    from megatron.core.transformer.moe.router import TopKRouter

    from setdiff_megatron.models.moe import router_losses

    load = ExpertLoad(model_cfg, device)

    def recorded(routing, layer: int):
        def routing_and_record(logits, padding_mask=None):
            probs, routing_map = routing(logits, padding_mask=padding_mask)
            if torch._C._current_graph_task_id() == -1:  # -1: not inside a backward pass
                with torch.no_grad():
                    flat, routed = logits.detach().view(-1, model_cfg.num_experts), routing_map
                    if padding_mask is not None:
                        kept = ~padding_mask.reshape(-1)
                        flat, routed = flat[kept], routed[kept]
                    load.add(layer, routed.sum(0), *router_losses(flat, model_cfg))
            return probs, routing_map

        return routing_and_record

    for chunk in chunks:
        for module in chunk.modules():
            if isinstance(module, TopKRouter):  # megatron counts layers from 1
                module.routing = recorded(module.routing, module.layer_number - 1)
    return load


def build_optimizer(recipe: Recipe, chunks, total_steps: int):
    """megatron-core's optimizer over the DDP chunks (distributed when asked) and its LR scheduler.
    megatron's param groups leave norms and biases undecayed; decoupled_adamw decays every
    parameter in one group (composer's), its decay scaled by the LR scheduler (lr_schedule.py)."""
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer

    t = recipe.train
    opt_config = OptimizerConfig(
        optimizer="sgd" if t.optimizer == "sgd" else "adam",
        lr=t.lr,
        min_lr=t.min_lr,
        weight_decay=lr_schedule.scheduled_weight_decay(recipe),
        adam_beta1=t.betas[0],
        adam_beta2=t.betas[1],
        adam_eps=t.eps,
        clip_grad=t.clip_grad,
        bf16=t.precision == "bf16",
        fp16=t.precision == "fp16",
        params_dtype=DTYPES[t.precision],
        use_distributed_optimizer=recipe.parallel.distributed_optimizer,
    )
    # An empty override table puts every parameter in the default (decayed) group.
    optimizer = get_megatron_optimizer(opt_config, chunks, {} if t.optimizer == "decoupled_adamw" else None)
    return optimizer, lr_schedule.build_lr_scheduler(recipe, optimizer, total_steps)


def _adam_optimizers(optimizer) -> list:
    return [
        o
        for o in getattr(optimizer, "chained_optimizers", [optimizer])
        if isinstance(o.optimizer, torch.optim.Adam | torch.optim.AdamW)
    ]


def fill_optimizer_state(optimizer) -> None:
    """Give every parameter an Adam state (step, moments) before a sharded load: the load fills
    existing tensors in place, and megatron's own init leaves `step` out
    (docs/megatron-on-cpu.md, "Around the layer")."""
    for opt in _adam_optimizers(optimizer):
        fill_torch_optimizer_state(opt.optimizer)


def _restore_adam_steps(optimizer) -> None:
    """Set each parameter's Adam `step` from its loaded param group. Without Apex/TE, megatron's
    distributed optimizer keeps the step in the param groups but leaves the per-parameter state
    at its pre-load value, and torch's Adam reads (and increments in place) the per-parameter one;
    each parameter gets its own tensor so one increment is one step (docs/megatron-on-cpu.md,
    "Around the layer")."""
    for opt in _adam_optimizers(optimizer):
        inner = opt.optimizer
        for group in inner.param_groups:
            if "step" not in group:
                continue
            for p in group["params"]:
                if "exp_avg" in inner.state[p]:
                    inner.state[p]["step"] = torch.tensor(float(group["step"]), dtype=torch.float32)


def _load_optimizer(optimizer, loaded: dict) -> None:
    """Load optimizer state. A distributed optimizer's per-parameter part is loaded apart:
    megatron's fully-reshardable loader copies every key of the live per-parameter state, `step`
    included, which the checkpoint keeps in the param groups instead (KeyError 'step')."""
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer

    optimizers = getattr(optimizer, "chained_optimizers", [optimizer])
    parts = [loaded] if len(optimizers) == 1 else [loaded[k] for k in sorted(loaded)]
    param_states = []
    for opt, part in zip(optimizers, parts):
        if isinstance(opt, DistributedOptimizer):
            param_states.append((opt, part.pop("param_state")))
            part.pop("param_state_sharding_type")
    optimizer.load_state_dict(loaded)  # param groups (with the step), grad scaler, plain states
    for opt, param_state in param_states:
        for st in opt.optimizer.state.values():
            st.pop("step", None)
        opt.load_parameter_state_from_fully_reshardable(param_state)
    _restore_adam_steps(optimizer)
