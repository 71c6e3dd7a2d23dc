"""`python -m refserve.serve [MODEL]`: refserve behind OpenAI's HTTP API.

    python -m refserve.serve --port 8000              # the embedded SmolLM2-135M-Instruct
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

Any OpenAI client works unchanged:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True,
                                   messages=[{"role": "user", "content": "Hi"}])

MODEL (as in `vllm serve MODEL`) or --model names the HF-format folder or a hub id. Engine
flags are those of `refserve.generate` (vLLM's names): both take them from
refserve/entrypoints/engine_args.py; the server's own are in the "server" group of
--help (refserve/entrypoints/options.py says what each limit is for). The server listens on
127.0.0.1 unless --host says otherwise, and then answers only loopback Host names (DNS
rebinding). SIGTERM / SIGINT drain it: no new requests, the running ones get up to
--shutdown-timeout seconds, the rest end with an error event; the exit code is 0.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import threading
from pathlib import Path

from refserve.entrypoints.cli_common import (
    ArgumentParser,
    CLIError,
    check_output_path,
    write_trace,
)
from refserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from refserve.entrypoints.options import MiB, ServerOptions

API_KEY_VARIABLES = ("REFSERVE_API_KEY", "VLLM_API_KEY")  # vLLM users have the second set


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m refserve.serve",
                       description="An OpenAI-compatible server around refserve's engine "
                       "(continuous batching over a paged KV cache).")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="HF-format model folder or hub id, as in `vllm serve MODEL` (same as "
                   "--model)")
    d = ServerOptions()
    s = p.add_argument_group("server")
    s.add_argument("--host", default=d.host, help="address to listen on (default: "
                   "loopback only; 0.0.0.0 exposes the server to the network: set an API key)")
    s.add_argument("--port", type=int, default=d.port)
    s.add_argument("--served-model-name", default=None, help="the model name clients send "
                   "(default: the model folder's name)")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY' on "
                   "every /v1/* route (default: $REFSERVE_API_KEY, else $VLLM_API_KEY, else "
                   "none); /health and /metrics stay open")
    s.add_argument("--allowed-hosts", default=None, metavar="HOST[,HOST...]",
                   help="Host header names to answer besides the loopback ones ('*': any; "
                   "default: loopback names on a loopback bind, any name otherwise)")
    s.add_argument("--disable-docs", "--disable-fastapi-docs", action="store_true",
                   help="do not serve /docs, /redoc and /openapi.json")
    s.add_argument("--max-waiting", type=int, default=1024, help="sequences that may wait "
                   "for a seat; beyond that a request gets HTTP 503 with Retry-After")
    s.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                   help=f"longest request body, else 413 (default {d.max_request_bytes // MiB}"
                   " MiB)")
    s.add_argument("--max-prompts-per-request", type=int, default=d.max_prompts_per_request,
                   help="most prompts in one completions 'prompt' list, else 400 (default "
                   "%(default)s)")
    s.add_argument("--max-logprobs", type=int, default=d.max_logprobs, help="most logprobs / "
                   "top_logprobs a request may ask for (default %(default)s, vLLM's)")
    s.add_argument("--header-timeout", type=float, default=d.header_timeout,
                   help="seconds a connection has to send a whole request head (default "
                   "%(default)s)")
    s.add_argument("--body-timeout", type=float, default=d.body_timeout,
                   help="seconds the whole body may take after the head, else 408 (default "
                   "%(default)s)")
    s.add_argument("--timeout-keep-alive", type=float, default=d.keep_alive_timeout,
                   help="seconds an idle keep-alive connection stays open (default "
                   "%(default)s, uvicorn's)")
    s.add_argument("--limit-concurrency", type=int, default=d.limit_concurrency,
                   help="most connections + tasks at once; beyond it uvicorn answers 503 "
                   "(default %(default)s)")
    s.add_argument("--shutdown-timeout", type=float, default=d.shutdown_timeout,
                   help="on SIGTERM / SIGINT, seconds running requests may still finish "
                   "(default %(default)s)")
    s.add_argument("--trace", type=Path, metavar="PATH", help="on shutdown, write the engine's "
                   "timeline here (Chrome trace-event JSON: https://ui.perfetto.dev); the "
                   "folder is checked at start-up")
    s.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    return p


def server_options(args: argparse.Namespace) -> ServerOptions:
    """Raises ValueError naming the knob."""
    api_key = args.api_key
    for name in API_KEY_VARIABLES:
        api_key = api_key or os.environ.get(name) or None
    hosts = None if args.allowed_hosts is None else tuple(
        h for h in args.allowed_hosts.split(",") if h.strip())
    return ServerOptions(
        host=args.host, port=args.port, api_key=api_key, allowed_hosts=hosts,
        docs=not args.disable_docs, max_request_bytes=args.max_request_bytes,
        max_prompts_per_request=args.max_prompts_per_request, max_logprobs=args.max_logprobs,
        header_timeout=args.header_timeout, body_timeout=args.body_timeout,
        keep_alive_timeout=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency,
        shutdown_timeout=args.shutdown_timeout)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model_tag is not None:
        if args.model is not None and args.model != args.model_tag:
            parser.error(f"MODEL {args.model_tag!r} and --model {args.model!r} disagree; "
                         "give one")
        args.model = args.model_tag
    if args.max_waiting < 1:
        parser.error(f"--max-waiting {args.max_waiting}: must be >= 1")
    if args.trace is not None:
        try:
            check_output_path(args.trace, "--trace")
        except CLIError as e:
            parser.error(str(e))
    try:
        options = server_options(args)
        config = engine_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        import uvicorn  # noqa: F401

        from refserve.entrypoints.http_server import HTTPServer, bind
        from refserve.entrypoints.openai_server import build_app
    except ImportError as e:
        parser.error(f"{e.name} is not installed; pip install 'refserve[serve]'")
    try:  # before loading the model: a taken port is known in a millisecond
        sock = bind(options.host, options.port)
    except OSError as e:
        parser.error(f"cannot listen on {options.host}:{options.port}: {e.strerror or e}")
    if options.exposure_warning():
        print(f"refserve: {options.exposure_warning()}", file=sys.stderr, flush=True)

    from refserve.engine import LLMEngine
    from refserve.entrypoints.async_engine import AsyncEngine
    from refserve.models.hub import hub_id_of

    try:
        engine = LLMEngine(config)
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    # vLLM serves a hub id under that id; a folder under its own name.
    name = args.served_model_name or hub_id_of(engine.model_path) or engine.model_path.name
    trace = None
    if args.trace is not None:
        from refserve.simulator.trace import EngineTrace

        trace = EngineTrace()
        trace.attach(engine)
    server = AsyncEngine(engine, max_waiting=args.max_waiting)
    server.start()
    http = HTTPServer(build_app(server, name, options), sock, options, server,
                      log_level=args.log_level)
    stop = threading.Event()
    signals: list[int] = []

    def on_signal(sig, frame) -> None:
        signals.append(sig)
        stop.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    http.start()
    print(f"refserve: serving {name} on http://{options.host}:{http.port}/v1"
          f"{' (API key required)' if options.api_key else ''}", file=sys.stderr, flush=True)
    while not stop.wait(0.5):
        if not http.alive:
            print("error: the HTTP server stopped on its own", file=sys.stderr)
            server.stop()
            finish_trace(trace, args.trace)
            return 1
    print(f"refserve: {signal.Signals(signals[0]).name}: draining (up to "
          f"{options.shutdown_timeout:g} s for {len(server.request_ids)} running request(s))",
          file=sys.stderr, flush=True)
    left = http.drain()
    print(f"refserve: stopped ({left} request(s) ended unfinished)", file=sys.stderr,
          flush=True)
    finish_trace(trace, args.trace)
    return 0


def finish_trace(trace, path) -> None:
    """After the engine loop stopped (nothing steps while the file is written): write the
    trace; an error is reported, not raised, since the server has already stopped."""
    try:
        write_trace(trace, path)
    except CLIError as e:
        print(f"error: {e}", file=sys.stderr)
    else:
        if trace is not None:
            print(f"refserve: trace written to {path}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    sys.exit(main())
