"""`chunked`: what a long prompt does to the decodes already running, chunked prefill on/off.

D requests are decoding when a prompt of L tokens arrives. Without chunking
(max_num_batched_tokens >= L + D) the step that admits it computes all L prompt tokens, and
every running decode waits for that whole step: one huge inter-token gap. With chunking
(token budget B, e.g. 512) the prompt is split over ~L/B steps, each of which still advances
every decode by one token, so the largest gap shrinks to about one chunk's time. The price
is the long prompt's own TTFT, which grows a little (more steps, each re-reading the
weights).

Measured per decode request: the inter-token latencies (ITL, time between two of its
tokens) from the long prompt's arrival until its first token. Reported: ITL p50/p99/max
over all decodes, and the mean TPOT over the same window. Also the TTFT of a short request
sent right after the long prompt. Without chunking it waits for the long prompt's one huge
step. With chunking, `long_prefill_token_threshold` (vLLM's knob; NumPy default: half the
budget) caps what a prefill takes per step, so the short request is admitted beside the
long prompt's first chunk and answers within a few steps instead of after all its chunks.

Chunking on uses the backend's default token budget unless --budget says otherwise (NumPy:
256, chosen so that one step stays well under a second on 2 cores; see
refserve/config.py DEFAULT_MAX_NUM_BATCHED_TOKENS).
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from refserve.bench.common import ms, percentiles, print_table, pyplot, save_figure, traced
from refserve.bench.corpus import QUESTIONS, passage
from refserve.sampling import SamplingParams

HELP = "running decodes while a long prompt arrives: chunked prefill on vs off"


def add_arguments(p) -> None:
    p.add_argument("--long-prompt-tokens", type=int, default=4000)
    p.add_argument("--budget", type=int, default=None,
                   help="max_num_batched_tokens with chunking on (default: the backend's, "
                   "refserve.config.DEFAULT_MAX_NUM_BATCHED_TOKENS)")
    p.add_argument("--decodes", type=int, default=4, help="requests decoding meanwhile")
    p.add_argument("--warmup-tokens", type=int, default=4,
                   help="tokens each decode has produced before the long prompt arrives")


def apply_quick(args) -> None:
    args.long_prompt_tokens, args.budget, args.decodes, args.warmup_tokens = 256, 64, 2, 2


POSITIVE = ("long_prompt_tokens", "decodes", "warmup_tokens")  # --budget: None = default


def _run_one(args, chunking: bool) -> dict:
    from refserve.engine import LLMEngine

    budget = args.budget if chunking else args.long_prompt_tokens + args.decodes + 64
    engine = LLMEngine(model=args.model, max_num_batched_tokens=budget,
                       enable_prefix_caching=False, progress=False,
                       max_model_len=max(args.long_prompt_tokens + 64, 2048))
    traced(args, engine, "chunked" if chunking else "unchunked")
    source = ("longer than the prompt" if not chunking else "--budget" if budget else
              f"the {engine.backend.name} default")
    budget = engine.config.max_num_batched_tokens   # None resolved by the engine
    per_step = engine.config.long_prefill_token_threshold or budget - args.decodes
    tok = engine.tokenizer
    if tok is None:
        raise ValueError("the chunked scenario needs a model with a tokenizer")
    long_prompt = passage(tok, args.long_prompt_tokens, args.seed)
    # warm-up: the first forward pays one-off costs that are not chunking's doing
    engine.add_request("warm-up", "Hello", SamplingParams(max_tokens=1))
    while engine.has_unfinished_requests():
        engine.step()
    decode_ids = [engine.add_request(f"decode-{i}", QUESTIONS[i % len(QUESTIONS)],
                                     SamplingParams(max_tokens=100_000, temperature=0.0,
                                                    ignore_eos=True))
                  for i in range(args.decodes)]
    counts = dict.fromkeys(decode_ids, 0)
    while min(counts.values()) < args.warmup_tokens:
        for out in engine.step():
            counts[out.request_id] = len(out.outputs[0].token_ids)
    # The long prompt arrives; from now on record when each decode gets each token.
    arrival = time.perf_counter()
    engine.add_request("long", long_prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                           ignore_eos=True))
    engine.add_request("short", "Hi", SamplingParams(max_tokens=1, ignore_eos=True))
    last = dict.fromkeys(decode_ids, arrival)
    itl: list[float] = []
    ttft = short_ttft = None
    steps = 0
    bar = tqdm(total=args.long_prompt_tokens, desc=f"chunking {'on' if chunking else 'off'}",
               unit="prompt tok")
    computed_before = 0
    while ttft is None or short_ttft is None:
        outs = engine.step()
        now = time.perf_counter()
        steps += ttft is None
        for out in outs:
            if out.request_id == "long":
                ttft = now - arrival
            elif out.request_id == "short":
                short_ttft = now - arrival
            elif ttft is None and len(out.outputs[0].token_ids) > counts[out.request_id]:
                counts[out.request_id] = len(out.outputs[0].token_ids)
                itl.append(now - last[out.request_id])
                last[out.request_id] = now
        computed = min(args.long_prompt_tokens, steps * per_step)
        bar.update(computed - computed_before)
        computed_before = computed
    bar.close()
    for rid in decode_ids:
        engine.abort_request(rid)
    p = percentiles(itl, (50, 99))
    return {"chunked_prefill": "on" if chunking else "off", "max_num_batched_tokens": budget,
            "budget_source": source,
            "long_prefill_token_threshold": engine.config.long_prefill_token_threshold,
            "short_ttft_ms": ms(short_ttft),
            "steps": steps, "decode_tokens": len(itl), "itl_p50_ms": ms(p["p50"]),
            "itl_p99_ms": ms(p["p99"]), "itl_max_ms": ms(max(itl)),
            "tpot_mean_ms": ms(sum(itl) / len(itl)), "long_prompt_ttft_ms": ms(ttft),
            "itl_ms": [ms(x) for x in itl]}


def run(args) -> dict:
    if args.budget is not None and args.budget <= 0:
        args.parser.error("--budget must be > 0")
    print(f"{args.decodes} decodes running; a {args.long_prompt_tokens}-token prompt arrives",
          flush=True)
    rows = [_run_one(args, True), _run_one(args, False)]
    on, off = rows
    ratio = off["itl_p99_ms"] / on["itl_p99_ms"]
    print()
    print_table(rows, [("chunked_prefill", "chunking", ""),
                       ("max_num_batched_tokens", "token budget", "d"),
                       ("budget_source", "budget from", ""),
                       ("long_prefill_token_threshold", "prefill cap", ""),
                       ("steps", "steps", "d"),
                       ("itl_p50_ms", "ITL p50 ms", ".0f"), ("itl_p99_ms", "ITL p99 ms", ".0f"),
                       ("itl_max_ms", "ITL max ms", ".0f"),
                       ("tpot_mean_ms", "TPOT mean ms", ".0f"),
                       ("long_prompt_ttft_ms", "long TTFT ms", ".0f"),
                       ("short_ttft_ms", "short TTFT ms", ".0f")])
    ttft_ratio = on["long_prompt_ttft_ms"] / off["long_prompt_ttft_ms"]
    print(f"p99 inter-token latency of the running decodes: {ratio:.1f}x lower with chunked "
          f"prefill; the long prompt's TTFT x{ttft_ratio:.2f} (its price)")
    cap = on["long_prefill_token_threshold"]
    print(f"a short request sent right after the long prompt: TTFT {on['short_ttft_ms']:.0f} "
          f"ms with budget {on['max_num_batched_tokens']} ({on['budget_source']})"
          + (f" and a prefill capped at {cap} tokens a step" if cap else "")
          + f", {off['short_ttft_ms']:.0f} ms behind the prompt's one step "
          f"({off['short_ttft_ms'] / on['short_ttft_ms']:.1f}x)")
    return {"rows": rows, "itl_p99_ratio_off_over_on": ratio}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    for r, color in zip(result["rows"], ("tab:green", "tab:gray")):
        ax.plot(range(len(r["itl_ms"])), r["itl_ms"], "o-", ms=3, color=color,
                label=f"chunking {r['chunked_prefill']} (budget {r['max_num_batched_tokens']})")
    ax.set_xlabel("decode token (all running decodes, in arrival order)")
    ax.set_ylabel("inter-token latency (ms)")
    ax.set_yscale("log")
    ax.set_title("Decode stalls while a long prompt is prefilled")
    ax.legend(fontsize=8)
    save_figure(fig, result, path)
