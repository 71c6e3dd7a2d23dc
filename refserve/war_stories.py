"""`python -m refserve.war_stories STORY`: the course's five war stories, one command each,
whose output shows the lesson (WARMUP.md section 11 quotes every one).

    oom          "It fits in memory": uncapped max_num_seqs preempts at peak; capped, none
    static       one long answer in a static batch holds its seats; continuous refills them
    speculation  a weak draft on creative text makes decoding slower; n-gram on quotes wins
    speculation-sim   the same story at full size: α 0.3 and 0.8, a costly draft and a free one
    prefix       a shared system prompt stored once per request; prefix caching stores it once
    chunked      long prompts stall every decoder; a token budget bounds the step

Four stories (and speculation-sim) run at full size on the simulator: refserve's own
Scheduler and KVCacheManager on a virtual clock, each step priced by the roofline cost model
of a Llama-3-8B shape on one H100 (`python -m refserve.simulate` with the flags each story
prints). Their figures are deterministic: the same on every machine.

The speculation story runs the embedded SmolLM2-135M on the tuned CPU backend (proven equal
to the reference by tests/test_backend_equality_cpu.py), batch 1, the adaptive rule off (so
the drafts are paid for whatever they earn): refserve/war_story_spec.py. Its counted columns
(drafts proposed and accepted, tokens per target pass) are deterministic on a machine; its
seconds and speedups are wall-clock, the systems taking turns request by request.

A mistake is one `error: ...` line, exit status 2.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass

from refserve import capacity
from refserve.bench.common import print_table
from refserve.entrypoints.cli_common import (
    EXIT_USAGE,
    ArgumentParser,
    CLIError,
    RawDescriptionHelpFormatter,
)

SIM = ("--model", "llama-3-8b", "--gpu", "h100-80gb")


@dataclass(frozen=True)
class SimStory:
    """Variants of one simulate command: `common` flags plus each variant's own."""

    title: str
    common: tuple[str, ...]
    variants: tuple[tuple[str, str, tuple[str, ...]], ...]  # (name, label, flags)
    columns: tuple[str, ...]                                # keys of COLUMNS
    lesson: Callable[[dict[str, dict]], str]                # variant name -> its row


def _s(ms: float) -> str:
    return f"{ms / 1000:.1f} s"


# header, and how a row (simulate's summary and latency percentiles) prints in that column
COLUMNS: dict[str, tuple[str, Callable[[dict], str]]] = {
    "blocks": ("KV blocks peak / pool", lambda r: f"{r['peak']:,} / {r['pool']:,}"),
    "preemptions": ("preemptions", lambda r: f"{r['preemptions']:,}"),
    "ttft_s": ("TTFT p50 / p99", lambda r: f"{_s(r['TTFT'][50])} / {_s(r['TTFT'][99])}"),
    "ttft_ms": ("TTFT p50 / p99 ms", lambda r: f"{r['TTFT'][50]:.0f} / {r['TTFT'][99]:.0f}"),
    "tpot": ("TPOT p50 / p99 ms", lambda r: f"{r['TPOT'][50]:.1f} / {r['TPOT'][99]:.1f}"),
    "itl": ("ITL p50 / p99 / max ms",
            lambda r: f"{r['ITL'][50]:.1f} / {r['ITL'][99]:.1f} / {r['ITL']['max']:.0f}"),
    "itl_max": ("longest gap ms", lambda r: f"{r['ITL']['max']:.0f}"),
    "tok_s": ("output tok/s", lambda r: f"{r['tok_s']:.1f}"),
    "done": ("done in", lambda r: f"{r['elapsed']:.2f} s"),
    "slots": ("slot-steps used / wasted",
              lambda r: f"{r['used']:,} / {r['wasted']:,} ({r['wasted_share']:.0%} wasted)"),
    "hit": ("prefix hit rate", lambda r: "-" if r["hit"] is None else f"{r['hit']:.1%}"),
    "peak_gib": ("KV blocks at peak", lambda r: f"{r['peak']:,} ({r['peak_gib']:.1f} GiB)"),
}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x"


STORIES: dict[str, SimStory] = {
    "oom": SimStory(
        "It fits in memory: the OOM at peak. 300 requests whose contexts nearly fill 8192 "
        "tokens arrive at 3 per second",
        (*SIM, "--workload", "long-context", "--rate", "3", "--num-requests", "300",
         "--max-model-len", "8192"),
        (("uncapped", "max_num_seqs 256 (vLLM's default)", ("--max-num-seqs", "256")),
         ("capped", "max_num_seqs 53 (what the pool holds)", ("--max-num-seqs", "53"))),
        ("blocks", "preemptions", "ttft_s", "tpot", "itl_max", "tok_s"),
        lambda v: (f"capped: preemptions {v['uncapped']['preemptions']} -> "
                   f"{v['capped']['preemptions']}, longest gap between tokens "
                   f"{v['uncapped']['ITL']['max']:.0f} -> {v['capped']['ITL']['max']:.0f} ms, "
                   f"TPOT p99 {v['uncapped']['TPOT'][99]:.1f} -> "
                   f"{v['capped']['TPOT'][99]:.1f} ms; the queue waits instead: TTFT p99 "
                   f"{_s(v['uncapped']['TTFT'][99])} -> {_s(v['capped']['TTFT'][99])}")),
    "static": SimStory(
        "The one long answer: 1000 chat requests (answers of 16-512 tokens, long-tailed) "
        "sent at once",
        (*SIM, "--workload", "chat", "--rate", "inf", "--num-requests", "1000"),
        (("static", "static", ("--batching", "static")),
         ("continuous", "continuous", ("--batching", "continuous"))),
        ("done", "tok_s", "slots", "ttft_s", "tpot"),
        lambda v: (f"the same useful slot-steps; static wastes "
                   f"{v['static']['wasted_share']:.0%} of its seats on finished answers, takes "
                   f"{_ratio(v['static']['elapsed'], v['continuous']['elapsed'])} as long, and "
                   f"its TTFT p99 is "
                   f"{_ratio(v['static']['TTFT'][99], v['continuous']['TTFT'][99])} "
                   f"continuous's")),
    "prefix": SimStory(
        "The prefix nobody was sharing: 200 requests with one 1500-token system prompt, "
        "sent at once",
        (*SIM, "--workload", "system-prompt", "--rate", "inf", "--num-requests", "200"),
        (("on", "prefix caching on", ("--enable-prefix-caching",)),
         ("off", "prefix caching off", ("--no-enable-prefix-caching",))),
        ("peak_gib", "hit", "ttft_ms", "tpot", "done"),
        lambda v: (f"without caching the pool holds {_ratio(v['off']['peak'], v['on']['peak'])}"
                   f" the blocks; TTFT p99 {v['off']['TTFT'][99]:.0f} -> "
                   f"{v['on']['TTFT'][99]:.0f} ms with it "
                   f"({_ratio(v['off']['TTFT'][99], v['on']['TTFT'][99])} lower), done in "
                   f"{v['off']['elapsed']:.2f} -> {v['on']['elapsed']:.2f} s")),
    "chunked": SimStory(
        "The chunked-prefill rescue: 300 long documents (prompts of 2048-6144 tokens) at 5 "
        "per second",
        (*SIM, "--workload", "long-document", "--rate", "5", "--num-requests", "300"),
        (("prefill_first", "prefill-first", ("--max-num-batched-tokens", "8192",
                                             "--no-enable-chunked-prefill")),
         ("mixed", "mixed, budget 8192", ("--max-num-batched-tokens", "8192")),
         ("chunked", "chunked, budget 2048", ("--max-num-batched-tokens", "2048")),
         ("small", "chunked, budget 512", ("--max-num-batched-tokens", "512"))),
        ("itl", "tpot", "ttft_ms"),
        lambda v: (f"a 2048-token budget: ITL p99 {v['prefill_first']['ITL'][99]:.0f} / "
                   f"{v['mixed']['ITL'][99]:.0f} -> {v['chunked']['ITL'][99]:.0f} ms "
                   f"({_ratio(v['prefill_first']['ITL'][99], v['chunked']['ITL'][99])} and "
                   f"{_ratio(v['mixed']['ITL'][99], v['chunked']['ITL'][99])} lower than "
                   f"prefill-first and mixed) for TTFT p50 "
                   f"{v['prefill_first']['TTFT'][50]:.0f} / {v['mixed']['TTFT'][50]:.0f} -> "
                   f"{v['chunked']['TTFT'][50]:.0f} ms; at 512 the steps are shorter still "
                   f"(ITL p99 {v['small']['ITL'][99]:.0f} ms) but too many: the prompts queue, "
                   f"TTFT p50 {_s(v['small']['TTFT'][50])}")),
}
NAMES = ("oom", "static", "speculation", "speculation-sim", "prefix", "chunked")

SPEC_CHAT = (*SIM, "--workload", "chat", "--rate", "8", "--num-requests", "1000")
SPEC_DRAFTERS = {
    "self-draft, 16 of 32 layers": '{"method": "draft_model", "model": "self", '
                                   '"num_draft_layers": 16, "num_speculative_tokens": 4, '
                                   '"adaptive": false}',
    "n-gram (free drafts)": '{"method": "ngram", "num_speculative_tokens": 4, '
                            '"adaptive": false}'}


def simulate_row(argv: list[str]) -> dict:
    """One `python -m refserve.simulate ARGV` run, in this process: its summary figures."""
    from refserve.simulate import build_parser, prepare
    from refserve.simulator.report import latency_table

    args = build_parser().parse_args(argv)
    model, _, _, engine, requests = prepare(args)
    result = engine.run(requests, progress=False)
    s = result.summary
    block_bytes = capacity.kv_bytes_per_block(model.kv_bytes_per_token(
        capacity.kv_cache_dtype_bytes(engine.dtype, args.kv_cache_dtype),
        args.tensor_parallel_size), args.block_size)
    used, wasted = s.slot_steps_used, s.slot_steps_wasted
    row = {"peak": s.kv_blocks_peak, "pool": s.kv_blocks_total,
           "peak_gib": s.kv_blocks_peak * block_bytes / 2**30,
           "preemptions": s.num_preemptions, "tok_s": s.output_tokens_per_s,
           "elapsed": s.elapsed, "used": used, "wasted": wasted,
           "wasted_share": wasted / (used + wasted) if used + wasted else 0.0,
           "hit": s.prefix_hit_rate, "rate": s.acceptance_rate,
           "mal": s.mean_accepted_length}
    for r in latency_table(result):
        row[r["metric"]] = {50: r["p50"], 90: r["p90"], 99: r["p99"], "max": r["max"]}
    return row


def run_simulated(story: SimStory, progress: bool = True) -> None:
    from tqdm import tqdm

    print(story.title)
    print("python -m refserve.simulate " + " ".join(story.common) + " plus:")
    rows: dict[str, dict] = {}
    for name, label, flags in tqdm(story.variants, desc="simulating", unit="run",
                                   disable=not progress):
        print(f"  {label:<40} {' '.join(flags)}")
        rows[name] = {"variant": label, **simulate_row([*story.common, *flags])}
    print()
    table = [{"variant": r["variant"], **{c: COLUMNS[c][1](r) for c in story.columns}}
             for r in rows.values()]
    print_table(table, [("variant", "", "")] + [(c, COLUMNS[c][0], "") for c in story.columns])
    print(f"lesson: {story.lesson(rows)}")


def run_speculation_at_scale(progress: bool = True) -> None:
    """Chat at 8 req/s, k = 4, the adaptive rule off: TPOT p50 with a costly draft (a
    self-draft of half the layers, about 0.6 of a decode step per draft) and a free one
    (n-gram), at α = 0.3 and 0.8, against no speculation. α is the per-token acceptance
    probability the simulator draws with; the draft acceptance rate is accepted / proposed."""
    from tqdm import tqdm

    print("Speculation at full size: chat at 8 req/s, k = 4, the adaptive rule off")
    print("python -m refserve.simulate " + " ".join(SPEC_CHAT) + " plus:")
    runs = [("no speculation", "-", ())]
    for label, spec in SPEC_DRAFTERS.items():
        print(f"  {label:<28} --speculative-config '{spec}' --spec-alpha A")
        runs += [(label, alpha, ("--speculative-config", spec, "--spec-alpha", alpha))
                 for alpha in ("0.3", "0.8")]
    rows = []
    for label, alpha, flags in tqdm(runs, desc="simulating", unit="run", disable=not progress):
        rows.append({"drafter": label, "alpha": alpha, **simulate_row([*SPEC_CHAT, *flags])})
    plain = rows[0]["TPOT"][50]
    for r in rows:
        tpot = r["TPOT"][50]
        r["vs"] = ("-" if r is rows[0] else f"{plain / tpot:.2f}x faster" if tpot < plain
                   else f"{tpot / plain:.2f}x slower")
        r["rate_text"] = "-" if r["rate"] is None else f"{r['rate']:.1%}"
        r["mal_text"] = "-" if r["mal"] is None else f"{r['mal']:.2f}"
        r["tpot_text"] = f"{tpot:.1f} ms"
        r["pool_text"] = f"{r['pool']:,}"
    print()
    print_table(rows, [("drafter", "drafter", ""), ("alpha", "α", ""),
                       ("rate_text", "accepted/proposed", ""),
                       ("mal_text", "mean accepted length", ""), ("tpot_text", "TPOT p50", ""),
                       ("vs", "vs no speculation", ""), ("pool_text", "KV pool blocks", "")])
    print("lesson: the same α buys a speedup with free drafts and a slowdown with costly "
          "ones; the draft model's KV also takes its share of the pool")


def run_story(name: str, progress: bool = True) -> None:
    """Print the story `name` (one of NAMES)."""
    if name == "speculation":
        from refserve.war_story_spec import run_speculation

        run_speculation(progress=progress)
    elif name == "speculation-sim":
        run_speculation_at_scale(progress)
    else:
        run_simulated(STORIES[name], progress)


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(prog="python -m refserve.war_stories", description=__doc__,
                       formatter_class=RawDescriptionHelpFormatter)
    p.add_argument("story", choices=NAMES)
    p.add_argument("--no-progress", action="store_true", help="no progress bar (stderr)")
    args = p.parse_args(argv)
    try:
        run_story(args.story, progress=not args.no_progress)
    except CLIError as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    return 0


if __name__ == "__main__":
    sys.exit(main())
