"""`python -m refserve.serve`: refserve behind OpenAI's HTTP API.

    python -m refserve.serve --port 8000              # the embedded SmolLM2-135M-Instruct
    curl localhost:8000/v1/completions -H 'Content-Type: application/json' \\
         -d '{"prompt": "The capital of France is", "max_tokens": 16, "temperature": 0}'

Any OpenAI client works unchanged:

    from openai import OpenAI
    client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="unused")
    client.chat.completions.create(model="SmolLM2-135M-Instruct", stream=True,
                                   messages=[{"role": "user", "content": "Hi"}])

Engine flags are those of `refserve.generate` (vLLM's names): both take them from
refserve/entrypoints/engine_args.py. The server listens on
127.0.0.1 unless --host says otherwise. See refserve/entrypoints/ for the pieces.
"""

from __future__ import annotations

import sys

from refserve.entrypoints.cli_common import ArgumentParser
from refserve.entrypoints.engine_args import add_engine_args, engine_config_from_args


def build_parser() -> ArgumentParser:
    p = ArgumentParser(prog="python -m refserve.serve",
                       description="An OpenAI-compatible server around refserve's engine "
                       "(continuous batching over a paged KV cache).")
    s = p.add_argument_group("server")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (default: "
                   "loopback only; 0.0.0.0 exposes the server to the network)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", default=None, help="the model name clients send "
                   "(default: the model folder's name)")
    s.add_argument("--max-waiting", type=int, default=1024, help="sequences that may wait "
                   "for a seat; beyond that a request gets HTTP 503 with Retry-After")
    s.add_argument("--log-level", default="warning",
                   choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not 0 <= args.port <= 65535:
        parser.error(f"--port {args.port}: must be in 0..65535")
    if args.max_waiting < 1:
        parser.error(f"--max-waiting {args.max_waiting}: must be >= 1")
    try:
        config = engine_config_from_args(args)
    except ValueError as e:
        parser.error(str(e))
    try:
        import uvicorn

        from refserve.entrypoints.openai_server import build_app
    except ImportError as e:
        parser.error(f"{e.name} is not installed; pip install 'refserve[serve]'")

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
    server = AsyncEngine(engine, max_waiting=args.max_waiting)
    server.start()
    print(f"refserve: serving {name} on http://{args.host}:{args.port}/v1", file=sys.stderr,
          flush=True)
    try:
        uvicorn.run(build_app(server, name), host=args.host, port=args.port,
                    log_level=args.log_level, timeout_graceful_shutdown=5)
    finally:
        server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
