"""`prefix`: prefix caching on vs off, same requests, same engine settings otherwise.

Two workloads, each request arriving after the previous one was answered (so each finds
what the earlier ones left in the cache, and TTFT is prefill time, not queueing):
  shared system prompt   N requests: one ~1000-token system prompt + a short distinct
                         question each. With caching, every request after the first
                         computes only its question: prefill tokens fall by ~(N-1)/N.
  multi-turn chat        conversations whose every turn resends the whole history plus the
                         new user message; with caching a turn computes only what is new.

prefill tokens computed = prompt tokens - prefix-cache hit tokens (per request, summed).
"""

from __future__ import annotations

import time
from pathlib import Path

from tqdm import tqdm

from refserve.bench.common import ms, percentiles, print_table, pyplot, save_figure, traced
from refserve.bench.corpus import CHAT_TURNS, QUESTIONS, passage
from refserve.sampling import SamplingParams

HELP = "prefix caching on vs off: shared system prompt; multi-turn chat"


def add_arguments(p) -> None:
    p.add_argument("--num-requests", type=int, default=32, help="shared-prompt requests")
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--conversations", type=int, default=4)
    p.add_argument("--turns", type=int, default=6)
    p.add_argument("--max-tokens", type=int, default=16, help="answer length")


def apply_quick(args) -> None:
    args.num_requests, args.system_tokens = 3, 96
    args.conversations, args.turns, args.max_tokens = 1, 2, 4


POSITIVE = ("num_requests", "system_tokens", "conversations", "turns", "max_tokens")


def _chat_prompt(tok, messages) -> str:
    if getattr(tok, "chat_template", None):
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def _answer(engine, prompt: str, max_tokens: int):
    """Send one request and step the engine until it is answered."""
    rid = engine.add_request(None, prompt, SamplingParams(max_tokens=max_tokens,
                                                          temperature=0.0, ignore_eos=True))
    while True:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out


def _row(workload: str, caching: bool, outs, elapsed: float) -> dict:
    prompt = sum(o.metrics.num_prompt_tokens for o in outs)
    cached = sum(o.metrics.num_cached_tokens for o in outs)
    ttft = percentiles([o.metrics.ttft for o in outs], (50, 99))
    return {"workload": workload, "prefix_caching": "on" if caching else "off",
            "requests": len(outs), "prompt_tokens": prompt, "cached_tokens": cached,
            "prefill_tokens_computed": prompt - cached,
            "hit_rate": cached / prompt if prompt else 0.0,
            "ttft_p50_ms": ms(ttft["p50"]), "ttft_p99_ms": ms(ttft["p99"]),
            "elapsed_s": elapsed}


def run(args) -> dict:
    from refserve.engine import LLMEngine

    rows, texts = [], {}
    for caching in (True, False):
        engine = traced(args, LLMEngine(model=args.model, enable_prefix_caching=caching,
                                        progress=False),
                        f"prefix caching {'on' if caching else 'off'}")
        tok = engine.tokenizer
        if tok is None:
            raise ValueError("the prefix scenario needs a model with a tokenizer")
        _answer(engine, "Hello", 1)  # warm-up: the first forward pays one-off costs
        system = passage(tok, args.system_tokens, args.seed)
        questions = [QUESTIONS[(args.seed + i) % len(QUESTIONS)] + f" (request {i})"
                     for i in range(args.num_requests)]
        label = "on" if caching else "off"
        t0, outs = time.perf_counter(), []
        for q in tqdm(questions, desc=f"shared system prompt, caching {label}", unit="req"):
            messages = [{"role": "system", "content": system}, {"role": "user", "content": q}]
            outs.append(_answer(engine, _chat_prompt(tok, messages), args.max_tokens))
        rows.append(_row("shared system prompt", caching, outs, time.perf_counter() - t0))
        texts[("shared", caching)] = [o.outputs[0].token_ids for o in outs]

        t0, outs = time.perf_counter(), []
        chats = [[] for _ in range(args.conversations)]
        bar = tqdm(total=args.conversations * args.turns, desc=f"multi-turn, caching {label}",
                   unit="turn")
        for turn in range(args.turns):
            for c, messages in enumerate(chats):
                messages.append({"role": "user",
                                 "content": CHAT_TURNS[(turn + c) % len(CHAT_TURNS)]})
                out = _answer(engine, _chat_prompt(tok, messages), args.max_tokens)
                messages.append({"role": "assistant", "content": out.outputs[0].text})
                outs.append(out)
                bar.update(1)
        bar.close()
        rows.append(_row("multi-turn chat", caching, outs, time.perf_counter() - t0))
        texts[("chat", caching)] = [o.outputs[0].token_ids for o in outs]

    ratios = {}
    for workload in ("shared system prompt", "multi-turn chat"):
        on, off = (next(r for r in rows if r["workload"] == workload
                        and r["prefix_caching"] == x) for x in ("on", "off"))
        ratios[workload] = {
            "prefill_tokens_reduction": 1 - on["prefill_tokens_computed"]
            / off["prefill_tokens_computed"],
            "ttft_p50_speedup": off["ttft_p50_ms"] / on["ttft_p50_ms"]}
    same = {k: sum(a == b for a, b in zip(texts[(k, True)], texts[(k, False)]))
            for k in ("shared", "chat")}
    print()
    print_table(rows, [("workload", "workload", ""), ("prefix_caching", "caching", ""),
                       ("requests", "requests", "d"), ("prompt_tokens", "prompt tok", "d"),
                       ("prefill_tokens_computed", "prefill computed", "d"),
                       ("hit_rate", "hit rate", ".1%"), ("ttft_p50_ms", "TTFT p50 ms", ".0f"),
                       ("ttft_p99_ms", "TTFT p99 ms", ".0f"), ("elapsed_s", "seconds", ".1f")])
    for workload, r in ratios.items():
        print(f"{workload}: prefill tokens computed down {r['prefill_tokens_reduction']:.1%}, "
              f"TTFT p50 {r['ttft_p50_speedup']:.1f}x lower with prefix caching")
    print(f"greedy outputs identical with and without caching: shared "
          f"{same['shared']}/{args.num_requests}, multi-turn "
          f"{same['chat']}/{args.conversations * args.turns}")
    return {"rows": rows, "ratios": ratios, "same_outputs": same}


def plot(result: dict, path: Path) -> None:
    plt = pyplot()
    rows = result["rows"]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    workloads = ["shared system prompt", "multi-turn chat"]
    x = range(len(workloads))
    for offset, caching, color in ((-0.2, "off", "tab:gray"), (0.2, "on", "tab:green")):
        sel = [next(r for r in rows if r["workload"] == w and r["prefix_caching"] == caching)
               for w in workloads]
        a.bar([i + offset for i in x], [r["prefill_tokens_computed"] for r in sel], 0.4,
              label=f"caching {caching}", color=color)
        b.bar([i + offset for i in x], [r["ttft_p50_ms"] for r in sel], 0.4,
              label=f"caching {caching}", color=color)
    for ax, title in ((a, "prefill tokens computed"), (b, "TTFT p50 (ms)")):
        ax.set_xticks(list(x), workloads)
        ax.set_title(title)
        ax.legend(fontsize=8)
    save_figure(fig, result, path)
