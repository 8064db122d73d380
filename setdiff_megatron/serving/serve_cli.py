"""`setdiff serve SOURCE`: the OpenAI-compatible server over the continuous-batching sampler.

One replica runs the engine on a thread of the server's process. `--nproc N` starts N worker
processes under torchrun (groups of `--tp T` tensor-parallel ranks, N/T data-parallel
replicas), each group's first rank connected to this front end over a local socket; requests go
to the least loaded replica.
"""

from __future__ import annotations

import secrets
import sys
import time
from multiprocessing.connection import Listener
from pathlib import Path

from setdiff_megatron.errors import UserError, require
from setdiff_megatron.log import say
from setdiff_megatron.sampling.step_compiler import COMPILE_MODES
from setdiff_megatron.sources.base_model import add_base_argument

__all__ = ["add_parser", "build_server"]

WARM_UP_PROMPT_TOKENS = 32
"""`--compile on` compiles, before serving, the buckets of a full batch of prompts this long."""


def _served_model(args, source):
    from setdiff_megatron.recipe_data import prompt_format
    from setdiff_megatron.serving.app import ServedModel

    name = args.model_name or Path(args.source).resolve().name
    return ServedModel(
        name=name,
        tokenizer=source.tokenizer,
        context_len=source.config.max_seq_len,
        defaults=source.decoding,
        chat_template=source.tokenizer.chat_template,
        kv_budget=args.kv_budget,
        prompt_format=prompt_format(source.recipe, source.tokenizer),
    )


def _local_replicas(args, source, defaults):
    from setdiff_megatron.distributed.runtime import Ranks
    from setdiff_megatron.inference.sampling_model import load_sampling_model
    from setdiff_megatron.serving.replicas import LocalReplica

    sm = load_sampling_model(source, Ranks(), device=args.device, dtype=args.dtype)

    def make(on_event):
        sampler = sm.sampler(
            max_rows=args.batch_size,
            kv_budget=args.kv_budget,
            prefill_chunk=args.prefill_chunk,
            static=args.batching == "static",
            compile=args.compile,
        )
        if args.compile == "on":
            seconds = sampler.warm_up(
                defaults, WARM_UP_PROMPT_TOKENS, lambda line: say(f"setdiff: {line}", file=sys.stderr)
            )
            say(f"setdiff: decode steps compiled in {seconds:.1f} s", file=sys.stderr)
        return [LocalReplica(sampler, lambda event: on_event(event, 0))]

    return make


def _process_replicas(args):
    """Start the worker processes now (they load the model while the front end starts) and
    connect their group leaders when the event loop runs."""
    from setdiff_megatron.distributed.workers import Torchrun
    from setdiff_megatron.serving.replicas import REPLICA_SETTINGS_ENV, ProcessReplica, ReplicaSettings

    if args.nproc % args.tp:
        raise UserError(f"--nproc {args.nproc} must be a multiple of --tp {args.tp}")
    authkey = secrets.token_hex(16)
    listener = Listener(("127.0.0.1", 0), authkey=authkey.encode())
    host, port = listener.address
    settings = ReplicaSettings(
        source=args.source,
        address=f"{host}:{port}",
        tp=args.tp,
        device=args.device,
        dtype=args.dtype,
        max_rows=args.batch_size,
        kv_budget=args.kv_budget,
        prefill_chunk=args.prefill_chunk,
        batching=args.batching,
    )
    workers = Torchrun(
        args.nproc,
        [],
        "setdiff_megatron.serving.replicas",
        env={"SETDIFF_SERVE_AUTHKEY": authkey, REPLICA_SETTINGS_ENV: settings.to_json()},
    ).start()

    def make(on_event):
        replicas: dict[int, ProcessReplica] = {}
        while len(replicas) < args.nproc // args.tp:
            if workers.poll() is not None:
                raise UserError(f"the worker processes exited with code {workers.returncode} before serving")
            connection = listener.accept()
            kind, dp_rank, _ = connection.recv()
            replicas[dp_rank] = ProcessReplica(connection, args.batch_size, lambda event, r=dp_rank: on_event(event, r))
        listener.close()
        return [replicas[i] for i in sorted(replicas)]

    return make, workers


def build_server(args):
    """(the Server, the worker processes or None) for parsed `setdiff serve` arguments."""
    from setdiff_megatron.serving.app import Server
    from setdiff_megatron.sources.read import read_source

    for name in ("batch_size", "nproc", "tp"):
        if getattr(args, name) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(args, name)}")
    local = args.nproc == 1 and args.tp == 1
    source = read_source(args.source, weights=local)  # the worker processes read their own weights
    model = _served_model(args, source)
    if local:
        return Server(model, _local_replicas(args, source, model.defaults)), None
    make, workers = _process_replicas(args)
    return Server(model, make), workers


def _run(args) -> int:
    from setdiff_megatron.distributed.runtime import check_port

    # Before the model loads: past 65535 uvicorn ends in a traceback (OverflowError) once the model
    # loaded, and 0 would listen on a port the printed address does not name.
    check_port(args.port, f"--port must be in 1..65535; got {args.port}")
    uvicorn = require("uvicorn", "serve", "setdiff serve")
    from setdiff_megatron.serving.app import create_app

    server, workers = build_server(args)
    config = uvicorn.Config(create_app(server), host=args.host, port=args.port, log_level=args.log_level)
    say(
        f"setdiff: serving {server.model.name} on http://{args.host}:{args.port}/v1 "
        f"({args.nproc // args.tp} replica(s), tp {args.tp}, {args.batch_size} rows each)",
        file=sys.stderr,
    )
    try:
        uvicorn.Server(config).run()
    finally:
        if workers is not None:
            deadline = time.monotonic() + 30
            while workers.poll() is None and time.monotonic() < deadline:
                time.sleep(0.2)
            if workers.poll() is None:
                workers.terminate()
    return 0


def add_parser(sub) -> None:
    parser = sub.add_parser(
        "serve",
        help="serve a model behind an OpenAI-compatible HTTP API",
        description=__doc__.split("\n\n")[0].replace("\n", " "),
    )
    parser.add_argument("source", help="a run directory, step_* directory, Hugging Face export or SetDLM release")
    add_base_argument(parser)
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument(
        "--model-name", default=None, help="the name clients ask for (default: the source's directory name)"
    )
    parser.add_argument("--batch-size", type=int, default=16, help="rows of each replica's batch (default 16)")
    parser.add_argument(
        "--kv-budget",
        type=int,
        default=None,
        help="KV cache slots per layer of a replica (rows x capacity); a request that does not fit waits",
    )
    parser.add_argument("--prefill-chunk", type=int, default=None, help="tokens a joining prompt prefills per step")
    parser.add_argument(
        "--batching",
        default="continuous",
        choices=["continuous", "static"],
        help="continuous (requests join a running batch) or static (a batch runs until its last "
        "row ends; the baseline of benchmarks/serving.py)",
    )
    parser.add_argument(
        "--compile",
        default="auto",
        choices=list(COMPILE_MODES),
        help="decode steps at bucketed static shapes, compiled (one process, TP=1): auto compiles "
        "a bucket once its eager steps have taken what a compile costs; on compiles the buckets of a "
        f"full batch of {WARM_UP_PROMPT_TOKENS}-token prompts before serving, the others at first use; "
        "off never (docs/sampling.md)",
    )
    parser.add_argument(
        "--nproc", type=int, default=1, help="worker processes (torchrun); data-parallel replicas of --tp ranks each"
    )
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per replica (megatron model)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"])
    parser.add_argument("--log-level", default="warning", help="uvicorn's log level")
    parser.set_defaults(func=_run)
