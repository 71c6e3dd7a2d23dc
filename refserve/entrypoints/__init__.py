"""Entry points that put the engine behind a network API, and what every command line shares.

| module | holds |
| --- | --- |
| `cli_common.py` | every CLI's parser (one `error:` line, no abbreviations), output-path checks |
| `engine_args.py` | the engine flags (vLLM's names), once for generate, serve, simulate, plan |
| `async_engine.py` | `AsyncEngine`: a background thread steps the engine; requests hand off |
| `protocol.py` | OpenAI request bodies → `SamplingParams`; the error shape |
| `responses.py` | OpenAI response, chunk, usage and logprobs shapes |
| `detokenize.py` | streaming deltas, holding back what a stop string may still cut |
| `prometheus.py` | `/metrics` in Prometheus text: gauges, counters, TTFT/TPOT histograms |
| `options.py` | `ServerOptions`: the server's limits and access rules, checked once |
| `guards.py` | ASGI middleware: Host (DNS rebinding), API key, body size and time |
| `openai_server.py` | the FastAPI app: `/v1/completions`, `/v1/chat/completions`, ... |
| `openai_outputs.py` | engine outputs → one response body or server-sent events |
| `http_server.py` | uvicorn in a thread: request-head timeout, drain on shutdown |

`python -m refserve.serve` (refserve/serve.py) wires them together and runs uvicorn.
"""
