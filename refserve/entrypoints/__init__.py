"""Entry points that put the engine behind a network API, and what every command line shares.

| module | holds |
| --- | --- |
| `cli_common.py` | every CLI's parser (one `error:` line, no abbreviations), output-path checks |
| `engine_args.py` | the engine flags (vLLM's names): one list for `generate` and `serve` |
| `async_engine.py` | `AsyncEngine`: a background thread steps the engine; requests hand off |
| `protocol.py` | OpenAI request bodies → `SamplingParams`; response and error shapes |
| `detokenize.py` | streaming deltas, holding back what a stop string may still cut |
| `prometheus.py` | `/metrics` in Prometheus text: gauges, counters, TTFT/TPOT histograms |
| `openai_server.py` | the FastAPI app: `/v1/completions`, `/v1/chat/completions`, ... |

`python -m refserve.serve` (refserve/serve.py) wires them together and runs uvicorn.
"""
