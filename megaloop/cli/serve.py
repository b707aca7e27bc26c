"""Serve a looped model trained by megaloop over an OpenAI-compatible HTTP API.

    pip install -e '.[serve]'
    python tools/serve.py --load CKPT --host 127.0.0.1 --port 8000
    curl -s localhost:8000/v1/models
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "x = 3 ; y = x + 4 ; y ?", "max_tokens": 16, "temperature": 0}'

    curl -sN localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "hi"}], "stream": true}'

Tensor parallel: every rank holds a slice of the model; rank 0 serves HTTP and the ranks step
the same batch in lockstep (the other ranks open no port):

    torchrun --nproc-per-node 2 tools/serve.py --tensor-model-parallel-size 2 --load CKPT

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming, ``n``, stop strings,
``ignore_eos``), ``GET /v1/models[/{id}]``, ``GET /health``, ``GET /stats`` (the batching
engine's counters) and vLLM's tokenizer endpoints: see megaloop/inference/server.py. Concurrent
requests are decoded together by the batching engine (megaloop/inference/engine.py; its knobs
``--max-batch``, ``--block-size``, ``--num-blocks``, ``--prefill-chunk``). ``--num-loops``,
``--kv-policy`` and ``--exit`` are those of tools/generate.py and apply to every request;
``--max-prompts-per-request``, ``--max-n`` and ``--max-request-tokens`` limit one request (HTTP
400), ``--max-request-bytes`` its body (HTTP 413, before the body is read).
``--api-key KEY`` (or the MEGALOOP_API_KEY environment variable): every request but ``GET
/health`` must send ``Authorization: Bearer KEY`` (HTTP 401 otherwise; the ``openai`` client's
``api_key``); serving beyond loopback (``--host 0.0.0.0``) without one prints a warning.
``--transformer-impl`` is the layer backend the model is built with: `local`, the one the engine
runs, whatever the checkpoint was saved with (the weights map by name; a line says so where the
checkpoint's flag would build other layers on this machine).
``--bf16`` / ``--fp16`` / ``--fp32``: the precision the model is held in, as tools/generate.py's
(default: on a GPU the checkpoint's, bf16 if it trained with --bf16; on CPU fp32).
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading


from megaloop import runtime
from megaloop.arguments import ArgumentParser, FlagCheck, add_dataclass_args, dataclass_from_args
from megaloop.inference.flags import (add_ckpt_step_flag, add_generation_flags,
                                      add_transformer_impl_flag)
from megaloop.inference.limits import RequestLimits
from megaloop.inference.precision import PrecisionConfig


ENGINE_FLAGS = ("max_batch", "block_size", "num_blocks", "prefill_chunk", "speculate",
                "layer_forward", "cuda_graphs")
API_KEY_ENV = "MEGALOOP_API_KEY"  # --api-key's default (vLLM's flag reads VLLM_API_KEY so)


def is_loopback(host: str) -> bool:
    """Whether ``host`` listens on this machine's loopback only (a host name other than
    localhost may resolve to any interface: not loopback)."""
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# Folder names that say what a folder is, not which model it holds: the model id is then the
# parent folder's name (demo/checkpoint serves as "demo", run/ckpt/iter_0000100 as "run").
GENERIC_FOLDER_NAMES = frozenset({"checkpoint", "checkpoints", "ckpt"})


def default_model_id(load: str) -> str:
    """The model id of a checkpoint at ``load`` when --served-model-name is not given: the
    folder's name, skipping generic names (GENERIC_FOLDER_NAMES, iter_NNNNNNN) upwards."""
    path = os.path.abspath(load)
    name = os.path.basename(path)
    while (name in GENERIC_FOLDER_NAMES or re.fullmatch(r"iter_\d+", name)) \
            and os.path.dirname(path) != path:
        parent = os.path.dirname(path)
        if not os.path.basename(parent):  # the filesystem root: keep the generic name
            break
        path, name = parent, os.path.basename(parent)
    return name


def build_parser() -> argparse.ArgumentParser:
    from megaloop.inference.engine_config import EngineConfig

    p = ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True,
                   help="megaloop checkpoint directory, or a folder written by export-hf")
    add_ckpt_step_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port, 1 to 65535 (default 8000)")
    p.add_argument("--api-key", default=None,
                   help="require this key of every request (the header Authorization: Bearer "
                        "KEY; without it HTTP 401), except GET /health. Default: the "
                        f"{API_KEY_ENV} environment variable (which keeps the key out of the "
                        "process list), else no key")
    p.add_argument("--served-model-name", "--model-name", dest="model_name", default=None,
                   help="the model id /v1/models reports and requests may name (vLLM's "
                        "--served-model-name; --model-name is accepted too). Default: the --load "
                        "folder's name, or its parent folder's when that name is a generic one "
                        "(checkpoint, checkpoints, ckpt, iter_NNNNNNN): demo/checkpoint -> demo")
    p.add_argument("--tensor-model-parallel-size", type=int, default=None,
                   help="tensor-parallel size; must equal the launch's ranks (torchrun "
                        "--nproc-per-node; default: that number)")
    add_generation_flags(p)
    add_transformer_impl_flag(p, engine=True)
    add_dataclass_args(p, PrecisionConfig)
    add_dataclass_args(p, RequestLimits)
    # The engine's knobs; its --max-sequence-length is the model's context.
    add_dataclass_args(p, EngineConfig, only=ENGINE_FLAGS)
    p.add_argument("--log-level", default="info", help="debug | info | warning (default info)")
    return p


def _ignore(signum, frame):
    """A rank other than 0 stops when rank 0 tells it to (a signal there would break off a
    forward that rank 0 and the others are inside)."""


def _graphs_note(engine_config) -> str:
    """The start line's words on --cuda-graphs."""
    import torch

    if not engine_config.cuda_graphs:
        return ""
    return (", CUDA graphs" if torch.cuda.is_available() else
            ", static decode forwards (no GPU: no graph captured)")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank_zero = runtime.is_rank_zero()

    def refuse(message: str) -> int:
        if rank_zero:
            print(f"error: {message}", file=sys.stderr)
        return 2

    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        return refuse("the server needs FastAPI and uvicorn: pip install -e '.[serve]'")
    from megaloop.inference.engine_config import EngineConfig
    from megaloop.inference.loading import check_generation_flags, check_transformer_impl
    from megaloop.inference.cuda_graphs import check_cuda_graphs
    from megaloop.inference.speculation import check_speculate

    # Every independent refusal at once (megaloop.arguments.FlagCheck)
    flags = FlagCheck()
    with flags.check():
        if not 1 <= args.port <= 65535:
            raise ValueError(f"--port {args.port}: must be from 1 to 65535")
    api_key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    with flags.check():
        if api_key is not None and not api_key.strip():
            where = "--api-key" if args.api_key is not None else API_KEY_ENV
            raise ValueError(f"{where} is empty: give the key clients must send, or leave it out")
    with flags.check():
        if args.tensor_model_parallel_size not in (None, world):
            raise ValueError(
                f"--tensor-model-parallel-size {args.tensor_model_parallel_size}: this launch has "
                f"{world} rank{'s' if world > 1 else ''}, and every rank of the server is tensor "
                f"parallel: launch it with torchrun --nproc-per-node "
                f"{args.tensor_model_parallel_size}, or leave the flag out")
    limits = dataclass_from_args(RequestLimits, args)
    precision = dataclass_from_args(PrecisionConfig, args)
    engine_config = EngineConfig(**{name: getattr(args, name) for name in ENGINE_FLAGS})
    rule = impl = None
    for check in (precision.validate, limits.check, engine_config.validate):
        with flags.check():
            check()
    with flags.check():
        rule = check_generation_flags(args.load, args.kv_policy, args.exit, args.num_loops,
                                      ckpt_step=args.ckpt_step)
    with flags.check():
        impl = check_transformer_impl(args.transformer_impl, engine=True)
    if flags.ok:  # (these need the exit rule and an engine config that passed)
        with flags.check():
            check_speculate(args.speculate, rule, args.kv_policy)
        # (what needs the model, its TP size and layers, is checked when it is loaded)
        with flags.check():
            check_cuda_graphs(args.cuda_graphs, rule, args.speculate, args.kv_policy, 1, True)
    try:
        flags.raise_any()
    except ValueError as exc:
        return refuse(str(exc))

    if api_key is None and not is_loopback(args.host) and rank_zero:
        print(f"warning: --host {args.host} serves beyond this machine without --api-key: "
              f"anyone who reaches port {args.port} can use the model; pass --api-key KEY "
              f"(or set {API_KEY_ENV}) and clients send Authorization: Bearer KEY",
              file=sys.stderr, flush=True)
    logging.basicConfig(level=args.log_level.upper() if rank_zero else "WARNING",
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime.quiet_megatron()
    from megaloop.inference.jobs import ModelService
    from megaloop.inference.loading import context_length, load_for_generation, setup_processes
    from megaloop.inference.server import serve
    from megaloop.parallel import initialize

    # SIGTERM and Ctrl-C on rank 0 end its model loop between two steps; it then tells the other
    # ranks to stop. They ignore both: torchrun signals every rank.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, (lambda *_: stop.set()) if rank_zero else _ignore)
    tp = setup_processes()
    try:
        try:
            model, tokenizer, run = load_for_generation(args.load, tp, ckpt_step=args.ckpt_step,
                                                        transformer_impl=impl, purpose="serving",
                                                        precision=precision)
        except (ValueError, FileNotFoundError) as exc:
            return refuse(f"--load {args.load}: {exc}")
        context = context_length(run)
        if context is not None:
            engine_config.max_sequence_length = context
        name = args.model_name or default_model_id(args.load)
        try:
            service = ModelService(model, tokenizer, name, num_loops=args.num_loops,
                                   kv_policy=args.kv_policy, exit_rule=rule, max_length=context,
                                   limits=limits, engine_config=engine_config)
        except ValueError as exc:
            return refuse(str(exc))
        if not rank_zero:
            service.follow()
            return 0
        logging.getLogger("megaloop.serve").info(
            "serving model id %r (%d loop steps, kv-policy %s, exit %s, TP %d, up to %d rows "
            "per step, layers: %s%s) on http://%s:%d", name, service.num_loops, args.kv_policy,
            rule.text if rule else "none", tp, engine_config.max_batch,
            service.runner.lockstep.engine.forward_impl, _graphs_note(engine_config),
            args.host, args.port)
        try:
            started = serve(service, args.host, args.port, args.log_level.lower(), stop,
                            api_key=api_key)
        finally:
            service.runner.lockstep.close()  # (done already, unless serving failed to start)
    finally:
        initialize.destroy()
    return 0 if started else 1


if __name__ == "__main__":
    sys.exit(main())
