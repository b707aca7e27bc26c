"""Serve a looped model trained by megaloop over an OpenAI-compatible HTTP API.

    pip install -e '.[serve]'
    python tools/serve.py --load CKPT --host 127.0.0.1 --port 8000
    curl -s localhost:8000/v1/models
    curl -s localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "x = 3 ; y = x + 4 ; y ?", "max_tokens": 16, "temperature": 0}'

    curl -sN localhost:8000/v1/chat/completions -H 'Content-Type: application/json' \\
         -d '{"messages": [{"role": "user", "content": "hi"}], "stream": true}'

``POST /v1/completions`` and ``POST /v1/chat/completions`` (streaming, ``n``, stop strings),
``GET /v1/models[/{id}]``, ``GET /health`` and vLLM's tokenizer endpoints: see
megaloop/inference/server.py. ``--num-loops``, ``--kv-policy`` and ``--exit`` are those of
tools/generate.py and apply to every request; ``--max-prompts-per-request``, ``--max-n`` and
``--max-request-tokens`` limit one request. The model runs in this one process at TP=1 and
requests are answered one at a time; serving under torchrun (TP>1) is not supported yet.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megaloop import runtime  # noqa: E402
from megaloop.arguments import add_dataclass_args, dataclass_from_args  # noqa: E402
from megaloop.inference.flags import add_ckpt_step_flag, add_generation_flags  # noqa: E402
from megaloop.inference.limits import RequestLimits  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    p.add_argument("--load", required=True,
                   help="megaloop checkpoint directory, or a folder written by export-hf")
    add_ckpt_step_flag(p)
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--model-name", default=None,
                   help="the model id /v1/models reports (default: the --load folder's name)")
    add_generation_flags(p)
    add_dataclass_args(p, RequestLimits)
    p.add_argument("--log-level", default="info", help="debug | info | warning (default info)")
    return p


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if runtime.is_rank_zero():
            print("error: tools/serve.py runs the model in one process at TP=1; serving with "
                  "tensor parallelism (a torchrun launch) is not supported yet: start it with "
                  "python", file=sys.stderr)
        return 2
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        print("error: the server needs FastAPI and uvicorn: pip install -e '.[serve]'",
              file=sys.stderr)
        return 2
    from megaloop.inference.loading import check_generation_flags

    limits = dataclass_from_args(RequestLimits, args)
    try:
        limits.check()
        rule = check_generation_flags(args.load, args.kv_policy, args.exit, args.num_loops,
                                      ckpt_step=args.ckpt_step)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    runtime.quiet_megatron()
    from megaloop.inference.loading import context_length, load_for_generation, setup_processes
    from megaloop.inference.jobs import Engine
    from megaloop.inference.server import serve
    from megaloop.parallel import initialize

    # SIGTERM shuts down like Ctrl-C: the server stops, the process group is destroyed.
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    setup_processes()
    try:
        try:
            model, tokenizer, run = load_for_generation(args.load, 1, ckpt_step=args.ckpt_step)
        except (ValueError, FileNotFoundError) as exc:
            print(f"error: --load {args.load}: {exc}", file=sys.stderr)
            return 2
        name = args.model_name or os.path.basename(os.path.normpath(args.load))
        try:
            engine = Engine(model, tokenizer, name, num_loops=args.num_loops,
                            kv_policy=args.kv_policy, exit_rule=rule,
                            max_length=context_length(run), limits=limits)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        logging.getLogger("megaloop.serve").info(
            "serving %s (%d loop steps, kv-policy %s, exit %s) on http://%s:%d", name,
            engine.num_loops, args.kv_policy, args.exit or "none", args.host, args.port)
        started = serve(engine, args.host, args.port, args.log_level.lower(), stop)
    finally:
        initialize.destroy()
    return 0 if started else 1


if __name__ == "__main__":
    sys.exit(main())
