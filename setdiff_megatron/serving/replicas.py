"""The engines behind `setdiff serve`: model replicas that run the continuous-batching sampler.

Each replica runs `serve_loop`: take commands, run one engine step, report events. The front end
(app.py) reaches every replica through `Replica`: `LocalReplica`, the engine on a thread of the
server's process (TP = 1), or `ProcessReplica`, a group of `--tp` torchrun processes (replica_main)
of `setdiff serve --nproc`. A job's output does not depend on which replica runs it or on what
shares its batch (docs/sampling.md, "Sampling"; docs/serving.md, "Serving").
"""

from __future__ import annotations

import json
import os
import queue
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from setdiff_megatron.sampling.decoding import DecodingConfig
from setdiff_megatron.sampling.engine import Sampler
from setdiff_megatron.sampling.sample_output import RowResult
from setdiff_megatron.sampling.sample_request import Request

__all__ = ["Job", "Replica", "LocalReplica", "ProcessReplica"]


@dataclass(frozen=True)
class Job:
    key: Hashable
    prompt: tuple[int, ...]
    cfg: DecodingConfig
    stream: bool = False


def row_summary(row: RowResult, prompt: tuple[int, ...], mask_token_id: int) -> dict[str, Any]:
    """What the front end needs of a finished row (picklable, small): the completion, and the
    tokens of each infilled span."""
    spans, current = [], None
    for i, t in enumerate(prompt):
        if t == mask_token_id:
            if current is None:
                current = []
                spans.append(current)
            current.append(row.tokens[i] if i < len(row.tokens) else mask_token_id)
        else:
            current = None
    return {
        "completion": row.completion,
        "spans": spans,
        "finish_reason": row.finish_reason,
        "num_decoded": row.num_decoded,
        "steps": row.steps,
        "nfe": row.nfe,
        "busy_s": row.busy_s,
        "seconds": row.seconds,
    }


def serve_loop(
    sampler: Sampler,
    next_commands: Callable[[bool], list],
    emit: Callable[[tuple], None] | None,
    share: Callable[[list], list] | None = None,
    stats_every_s: float = 0.5,
) -> None:
    """Run commands and steps until a ("stop",) command. `next_commands(block)` waits for commands
    when `block` (the engine is idle); `share` hands the commands of each loop to the peers of a
    tensor-parallel group (identity without peers); `emit` (None on peers) reports events:
    ("progress", key, tokens), ("done", key, summary), ("stats", None, dict)."""
    streaming: set[Hashable] = set()
    prompts: dict[Hashable, tuple[int, ...]] = {}
    last_stats = 0.0
    with torch.inference_mode():
        while True:
            commands = next_commands(sampler.idle)
            if share is not None:
                commands = share(commands)
            for command in commands:
                if command[0] == "stop":
                    return
                if command[0] == "submit":
                    job: Job = command[1]
                    sampler.submit(Request(key=job.key, prompt=job.prompt, cfg=job.cfg, seed=job.cfg.seed))
                    prompts[job.key] = job.prompt
                    if job.stream:
                        streaming.add(job.key)
                elif command[0] == "cancel":
                    sampler.cancel(command[1])
            if sampler.idle:
                continue
            finished = sampler.step()
            if emit is None:
                continue
            if streaming:
                for p in sampler.progress(streaming):
                    emit(("progress", p.key, p.prefix))
            for key, row in finished:
                streaming.discard(key)
                emit(("done", key, row_summary(row, prompts.pop(key), sampler.mask_token_id)))
            now = time.monotonic()
            if now - last_stats >= stats_every_s or sampler.idle:
                last_stats = now
                emit(("stats", None, {**sampler.load, "steps": sampler.metrics.forwards}))


class Replica:
    """What the front end calls; events come back through the `on_event` it was made with."""

    max_rows: int

    def submit(self, job: Job) -> None: ...

    def cancel(self, key: Hashable) -> None: ...

    def close(self) -> None: ...


@dataclass
class LocalReplica(Replica):
    """The engine on a background thread of this process."""

    sampler: Sampler
    on_event: Callable[[tuple], None]
    _inbox: queue.Queue = field(default_factory=queue.Queue)
    _thread: threading.Thread | None = None

    def __post_init__(self) -> None:
        self.max_rows = self.sampler.max_rows
        self._thread = threading.Thread(
            target=serve_loop, name="setdiff-engine", daemon=True, args=(self.sampler, self._commands, self.on_event)
        )
        self._thread.start()

    def _commands(self, block: bool) -> list:
        out = []
        try:
            out.append(self._inbox.get(timeout=0.5) if block else self._inbox.get_nowait())
            while True:
                out.append(self._inbox.get_nowait())
        except queue.Empty:
            pass
        return out

    def submit(self, job: Job) -> None:
        self._inbox.put(("submit", job))

    def cancel(self, key: Hashable) -> None:
        self._inbox.put(("cancel", key))

    def close(self) -> None:
        self._inbox.put(("stop",))
        self._thread.join(timeout=30)


class ProcessReplica(Replica):
    """One replica group of worker processes, reached through a multiprocessing connection."""

    def __init__(self, connection, max_rows: int, on_event: Callable[[tuple], None]):
        self.connection, self.max_rows, self.on_event = connection, max_rows, on_event
        self._lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="setdiff-replica-reader", daemon=True)
        self._reader.start()

    def _read(self) -> None:
        try:
            while True:
                self.on_event(self.connection.recv())
        except (EOFError, OSError):
            self.on_event(("lost", None, None))

    def _send(self, message: tuple) -> None:
        with self._lock:
            self.connection.send(message)

    def submit(self, job: Job) -> None:
        self._send(("submit", job))

    def cancel(self, key: Hashable) -> None:
        self._send(("cancel", key))

    def close(self) -> None:
        try:
            self._send(("stop",))
        except (OSError, ValueError):
            pass


REPLICA_SETTINGS_ENV = "SETDIFF_SERVE_REPLICA"
"""The environment variable that hands `setdiff serve`'s parsed settings to its worker processes."""


@dataclass(frozen=True)
class ReplicaSettings:
    """What a worker process of `setdiff serve --nproc/--tp` needs: the front end's parsed
    arguments, passed as they are (JSON in REPLICA_SETTINGS_ENV), not as a command line."""

    source: str
    address: str
    """host:port of the front end."""
    tp: int
    device: str
    dtype: str | None
    max_rows: int
    kv_budget: int | None
    prefill_chunk: int | None
    batching: str

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_env(cls) -> ReplicaSettings:
        return cls(**json.loads(os.environ[REPLICA_SETTINGS_ENV]))


def replica_main() -> int:
    """A worker process of `setdiff serve --nproc/--tp` (started by torchrun): load this rank's
    model, then serve the front end at the settings' address (the group's first rank) or its peers."""
    from multiprocessing.connection import Client

    from setdiff_megatron.distributed.child_processes import follow_parent
    from setdiff_megatron.distributed.runtime import join, tensor_parallel_broadcast
    from setdiff_megatron.inference.sampling_model import load_sampling_model

    follow_parent()  # a front end killed outright takes its replicas with it
    args = ReplicaSettings.from_env()
    ranks = join(args.tp)
    sm = load_sampling_model(args.source, ranks, device=args.device, dtype=args.dtype)
    sampler = sm.sampler(
        max_rows=args.max_rows,
        kv_budget=args.kv_budget,
        prefill_chunk=args.prefill_chunk,
        static=args.batching == "static",
    )
    leader = ranks.rank % args.tp == 0
    # At --tp > 1 the model was built on megatron-core's groups (init_model_parallel), whose TP
    # groups are these replica groups: T consecutive ranks.
    share = tensor_parallel_broadcast if args.tp > 1 else None

    if not leader:
        serve_loop(sampler, lambda block: [], None, share)
        return 0
    host, port = args.address.rsplit(":", 1)
    connection = Client((host, int(port)), authkey=os.environ["SETDIFF_SERVE_AUTHKEY"].encode())
    connection.send(("ready", ranks.dp_rank, None))

    def commands(block: bool) -> list:
        out = []
        if connection.poll(0.5 if block else 0):
            out.append(connection.recv())
            while connection.poll(0):
                out.append(connection.recv())
        return out

    try:
        serve_loop(sampler, commands, connection.send, share)
    except (EOFError, OSError):  # the front end went away: the peers stop at the next share
        if share is not None:
            share([("stop",)])
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(replica_main())
