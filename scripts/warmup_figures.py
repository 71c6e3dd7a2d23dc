"""Every figure WARMUP.md quotes, the command that prints it, and ONE command that refreshes
them all after a code change:

    python scripts/warmup_figures.py                 rerun every command, rewrite WARMUP.md
    python scripts/warmup_figures.py --check         compare only: a line per stale figure
    python scripts/warmup_figures.py --only oom      just these figures (--list names them)
    python scripts/warmup_figures.py --skip-model    leave out the figures that load the model

tests/test_warmup_figures.py runs the same comparison in CI.

WARMUP.md marks what is checked with HTML comments (a Markdown viewer hides them):

    <!-- figure NAME -->          on the line before a fenced block: the block is NAME's
    ```                           output, its command first as `$ command`
    $ python -m ...
    ```
    <!-- NAME.KEY -->VALUE<!-- / -->     a figure in the prose: VALUE is what NAME computes
                                         under KEY (a count, a ratio)

Three kinds of figure, each compared as the text says (WARMUP section "A rule for this text"):

    deterministic  rerun in this process (`python -m X` is X's main()): the simulator (a
                   virtual clock), the scheduler and KV-cache demos, capacity arithmetic, the
                   speculation formula. Compared exactly.
    timed          the speculation war story, which runs the embedded model: its counted
                   columns (drafts proposed and accepted, tokens per target pass) exactly, its
                   seconds and speedups not at all (masked as "~" before comparing).
    recorded       a benchmark's recorded full run, docs/bench/NAME.json, rendered as the
                   bench prints it (some columns left out): compared exactly with that file.
                   The bench itself takes minutes and is rerun by hand:
                   `python -m refserve.bench NAME --json docs/bench/NAME.json --plot ...`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import re
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WARMUP = ROOT / "WARMUP.md"
BENCH = ROOT / "docs" / "bench"
REFRESH = "python scripts/warmup_figures.py"

# A block's body never holds a fence: an empty or broken block cannot swallow the next one.
BLOCK = re.compile(r"(<!-- figure (?P<name>[\w-]+) -->\n```[^\n`]*\n)"
                   r"(?P<body>(?:[^`]|`(?!``))*?)(\n```)")
PROSE = re.compile(r"(<!-- (?P<name>[\w-]+)\.(?P<key>[\w-]+) -->)(?P<value>.*?)(<!-- / -->)")
TIMED = re.compile(r"\d+\.\d+ s\b|\d+\.\d+x")


@dataclass
class Figure:
    name: str
    command: str                          # as WARMUP quotes it
    compute: Callable[[], tuple[str, dict]]   # (output lines for the block, prose values)
    kind: str = "deterministic"           # or "timed" (masked) or "recorded"
    loads_model: bool = False
    prompt: bool = True                   # the block starts with `$ command`


@dataclass
class Stale:
    figure: Figure
    where: str
    text: str
    printed: str
    lines: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        f = self.figure
        src = (f"docs/bench/{f.name.split('-')[0]}.json (recorded by `{f.command}`)"
               if f.kind == "recorded" else f"`{f.command}`")
        return (f"WARMUP.md figure {f.name} ({self.where}): the text has {self.text!r}, "
                f"{src} gives {self.printed!r}. Refresh: {REFRESH} --only {f.name}")


# ---- running commands in this process ------------------------------------------------------

def captured(fn: Callable, *args) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = fn(*args)
    if isinstance(rc, int) and rc != 0:
        raise RuntimeError(f"{fn.__module__}.{fn.__name__}{args} returned {rc}")
    return out.getvalue()


def excerpt(lines: list[str], keep: Callable[[str], bool]) -> str:
    """The lines `keep` accepts, with one '...' for each run of lines left out."""
    out: list[str] = []
    for line in lines:
        if keep(line):
            out.append(line)
        elif not out or out[-1] != "...":
            out.append("...")
    return "\n".join(out)


def cli(module: str, argv: list[str], keep: Callable[[str], bool] | None = None,
        values: Callable[[str], dict] | None = None) -> Callable[[], tuple[str, dict]]:
    def compute():
        import importlib

        main = importlib.import_module(module).main
        text = captured(main, argv) if argv is not None else captured(main)
        lines = text.rstrip("\n").split("\n")
        body = "\n".join(lines) if keep is None else excerpt(lines, keep)
        return body, (values(text) if values else {})
    return compute


def capacity(name: str, argv: str, keep: tuple[str, ...] = ()) -> Figure:
    pred = (lambda line: line.startswith(keep)) if keep else None
    return Figure(name, "python -m refserve.capacity " + argv,
                  cli("refserve.capacity_cli", argv.split(), pred))


def scheduler_values(text: str) -> dict:
    out = {}
    for kind in ("continuous", "static"):
        m = re.search(rf"{kind}: (\d+) steps, slot-steps used (\d+), wasted (\d+), "
                      rf"preemptions (\d+)", text)
        out.update({f"{kind}_steps": m[1], f"{kind}_used": m[2], f"{kind}_wasted": m[3],
                    f"{kind}_preemptions": m[4]})
    return out


def scheduler_summary():
    from refserve.scheduler.demo import main

    text = captured(main)
    tail = text.rstrip("\n").split("\n")[-3:]
    return "...\n" + "\n".join(tail), scheduler_values(text)


def scheduler_events():
    from refserve.scheduler.demo import main

    text = captured(main).split("=== StaticScheduler")[0]
    lines = [line for line in text.split("\n") if line.startswith("step ")
             and ("admitted" in line or "preempted" in line)]
    return "...\n" + "\n".join(lines) + "\n...", {}


def radix():
    """The demo's second tree: b's hit split a's node."""
    from refserve.kv_cache.radix_demo import main

    paragraphs = captured(main).strip("\n").split("\n\n")
    return "...\n" + next(p for p in paragraphs if p.startswith("b = ")) + "\n...", {}


FORMULA = """from refserve.metrics import expected_tokens_per_pass as E
cases = [(0.8,4,0.0), (0.8,4,0.05), (0.3,4,0.54), (0.3,1,0.54), (0.3,4,0.0), (0.6,4,0.1),
         (0.8,8,0.0)]
for a,k,c in cases:
    e = E(a,k); rate = a*(1-a**k)/(k*(1-a))   # accepted / proposed
    print(f'alpha={a} k={k} c={c}: E={e:.4f} accepted/proposed={rate:.1%} '
          f'speedup={e/(1+k*c):.3f}')"""


def formula():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(FORMULA, {})
    return f'"\n{FORMULA}\n"\n' + out.getvalue().rstrip("\n"), {}


def war_story(name: str) -> Figure:
    def compute():
        if name == "speculation":
            from refserve.war_story_spec import run_speculation

            text = captured(run_speculation, False)
        else:
            from refserve.war_stories import run_story

            text = captured(run_story, name, False)
        return text.rstrip("\n"), {}
    return Figure(f"story-{name}", f"python -m refserve.war_stories {name}", compute,
                  kind="timed" if name == "speculation" else "deterministic",
                  loads_model=name == "speculation")


# ---- recorded benchmark runs ---------------------------------------------------------------

def recorded(name: str) -> dict:
    return json.loads((BENCH / f"{name}.json").read_text())


def table(rows: list[dict], cols) -> str:
    from refserve.bench.common import print_table

    return captured(print_table, rows, cols).rstrip("\n")


def bench_batching():
    d = recorded("batching")
    rows = [{**r, "ms_per_step": 1000 * r["elapsed_s"] / r["steps"]} for r in d["rows"]]
    cont, static = rows[0], rows[1]
    seats = static["slot_steps_wasted"] + static["slot_steps_used"]
    values = {"steps_continuous": f"{cont['steps']}", "steps_static": f"{static['steps']}",
              "used": f"{cont['slot_steps_used']}",
              "wasted": f"{static['slot_steps_wasted']:,}",
              "wasted_share": f"{static['slot_steps_wasted'] / seats:.0%}",
              "seats": f"{seats:,}",
              "step_ratio": f"{static['steps'] / cont['steps']:.2f}",
              "wall_ratio": f"{static['elapsed_s'] / cont['elapsed_s']:.2f}"}
    return table(rows, BATCHING_COLS), values


BATCHING_COLS = [("system", "system", ""), ("tokens_per_s", "tok/s", ".1f"),
                 ("elapsed_s", "seconds", ".1f"), ("steps", "steps", "d"),
                 ("ms_per_step", "ms/step", ".1f"), ("slot_steps_used", "slot used", "d"),
                 ("slot_steps_wasted", "slot wasted", "d")]


def bench_paged():
    d = recorded("paged")
    rows = [{**r, "ms_per_step": 1000 * r["elapsed_s"] / r["steps"]} for r in d["rows"]]
    cols = BATCHING_COLS + [("kv_slots_peak", "KV slots peak", "d")]
    text = table(rows, cols) + (f"\npaged / contiguous wall time: {d['wall_ratio']:.3f}x; "
                                f"model forward: {d['forward_ratio']:.3f}x")
    paged, contiguous = rows
    return text, {"slots_ratio": f"{contiguous['kv_slots_peak'] / paged['kv_slots_peak']:.1f}",
                  "paged_slots": f"{paged['kv_slots_peak']}",
                  "contiguous_slots": f"{contiguous['kv_slots_peak']:,}"}


def bench_overhead():
    o = recorded("batching")["overhead"]
    return (f"decode step at {o['running']} running: {o['step_ms']:.1f} ms, forward "
            f"{o['forward_ms']:.1f} ms, outside the forward {o['outside_forward_ms']:.2f} ms "
            f"({o['outside_forward_fraction']:.1%});\ndense-matmul floor (distinct weights) "
            f"{o['dense_matmul_floor_ms']:.1f} ms, step / floor = {o['step_over_floor']:.2f}x;"
            f" sampling at top_p 0.9\n{o['sampling_top_p_ms']:.2f} ms "
            f"({o['sampling_fraction']:.1%} of the step)"), {}


def bench_chunked():
    d = recorded("chunked")
    on, off = d["rows"]
    cols = [("chunked_prefill", "chunking", ""), ("max_num_batched_tokens", "token budget", "d"),
            ("steps", "steps", "d"), ("itl_p50_ms", "ITL p50 ms", ".0f"),
            ("itl_p99_ms", "ITL p99 ms", ".0f"), ("itl_max_ms", "ITL max ms", ".0f"),
            ("tpot_mean_ms", "TPOT mean ms", ".0f"), ("long_prompt_ttft_ms", "long TTFT ms", ".0f")]
    return table(d["rows"], cols), {
        "steps": f"{on['steps']}", "wait": f"{off['itl_max_ms'] / 1000:.1f}",
        "itl_ratio": f"{off['itl_p99_ms'] / on['itl_p99_ms']:.1f}",
        "ttft_ratio": f"{on['long_prompt_ttft_ms'] / off['long_prompt_ttft_ms']:.2f}"}


def bench_loadtest():
    d = recorded("loadtest")
    cols = [("rate", "req/s in", "g"), ("sent", "sent", "d"), ("finished", "finished", "d"),
            ("rejected", "rejected", "d"), ("failed", "failed", "d"),
            ("throughput_tok_s", "tok/s", ".1f"), ("goodput_req_s", "goodput req/s", ".2f"),
            ("ttft_p50_ms", "TTFT p50", ".0f"), ("ttft_p99_ms", "p99", ".0f"),
            ("tpot_p50_ms", "TPOT p50", ".0f"), ("tpot_p99_ms", "p99", ".0f"),
            ("usd_per_1m_output_tokens", "$/1M tok", ".2f")]
    return table(d["rows"], cols), {}


def _by(rows, *keys):
    return {tuple(r[k] for k in keys): r for r in rows}


def bench_prefix(part: str):
    def compute():
        d = recorded("prefix")
        rows = _by(d["rows"], "workload", "config")
        workloads = list(dict.fromkeys(r["workload"] for r in d["rows"]))
        out = []
        if part == "policies":
            out.append(f"{'workload':<12}{'prompt tok':>10}   "
                       f"{'prefill computed: off / hash / radix':<38}"
                       f"{'hit rate hash = radix':<24}TTFT p50 ms off / hash / radix")
            for w in workloads:
                off, h, rx = (rows[(w, c)] for c in ("off", "hash", "radix"))
                hit = (f"{h['hit_rate']:.1%}" if h["hit_rate"] == rx["hit_rate"]
                       else f"{h['hit_rate']:.1%} / {rx['hit_rate']:.1%}")
                comp = " / ".join(str(r["prefill_tokens_computed"]) for r in (off, h, rx))
                ttft = " / ".join(f"{r['ttft_p50_ms']:.0f}" for r in (off, h, rx))
                out.append(f"{w:<12}{off['prompt_tokens']:>10}   {comp:<38}{hit:<24}{ttft}")
            evict = " / ".join(str(rows[(w, "hash")]["evictions"]) for w in workloads)
            return "\n".join(out), {"evictions": evict}
        out.append(f"{'workload':<13}{'hit rate fcfs -> lpm':<24}"
                   f"{'prefill computed fcfs -> lpm':<32}TTFT p50 / p99 ms fcfs -> lpm")
        for w in workloads:
            f, lp = rows[(w, "radix + fcfs")], rows[(w, "radix + lpm")]
            hit = f"{f['hit_rate']:.1%} -> {lp['hit_rate']:.1%}"
            comp = f"{f['prefill_tokens_computed']} -> {lp['prefill_tokens_computed']}"
            ttft = (f"{f['ttft_p50_ms']:.0f} / {f['ttft_p99_ms']:.0f} -> "
                    f"{lp['ttft_p50_ms']:.0f} / {lp['ttft_p99_ms']:.0f}")
            out.append(f"{w:<13}{hit:<24}{comp:<32}{ttft}")
        return "\n".join(out), {}
    return compute


def bench_preemption():
    d = recorded("preemption")
    rows = _by(d["rows"], "context", "mode")
    out = [f"{'L':>4}   {'preemptions rec / swap':<24}{'tokens recomputed':<20}"
           f"{'MiB moved (swap)':<19}{'TPOT p99 ms rec / swap':<25}{'out tok/s rec / swap':<23}"
           "wall s rec / swap"]
    for L in sorted({r["context"] for r in d["rows"]}):
        rec, sw = rows[(L, "recompute")], rows[(L, "swap")]
        cells = [f"{rec['preemptions']} / {sw['preemptions']}", f"{rec['recomputed_tokens']}",
                 f"{sw['swap_bytes'] / 2**20:.1f}",
                 f"{rec['tpot_p99_ms']:.0f} / {sw['tpot_p99_ms']:.0f}",
                 f"{rec['throughput_tok_s']:.1f} / {sw['throughput_tok_s']:.1f}",
                 f"{rec['elapsed_s']:.1f} / {sw['elapsed_s']:.1f}"]
        widths = (24, 20, 19, 25, 23, 0)
        out.append(f"{L:>4}   " + "".join(c.ljust(w) for c, w in zip(cells, widths)))
    return "\n".join(out), {}


# ---- the registry: every figure, in WARMUP's order -----------------------------------------

FIGURES: list[Figure] = [
    capacity("capacity-smollm2", "--model smollm2-135m --memory 80GiB --context 2048 "
             "--dtype float32"),
    capacity("capacity-smollm2-cpu", "--model smollm2-135m --memory 2GiB --context 2048 "
             "--dtype float32 --gpu-memory-utilization 1.0", ("KV pool", "max concurrency")),
    capacity("capacity-llama", "--model llama-3-8b --memory 80GiB --context 2048"),
    capacity("capacity-llama-24g", "--model llama-3-8b --memory 24GiB --context 4096",
             ("usable", "KV pool", "per sequence", "max concurrency")),
    capacity("capacity-llama-192", "--model llama-3-8b --memory 80GiB --context 192",
             ("per sequence", "max concurrency")),
    capacity("capacity-llama-8192", "--model llama-3-8b --memory 80GiB --context 8192",
             ("weights", "KV pool", "per sequence", "max concurrency")),
]
FIGURES += [
    Figure("block-table", "python -m refserve.kv_cache.demo block_table",
           cli("refserve.kv_cache.demo", ["block_table"],
               lambda line: not line.startswith("position ") or line[9] in "034")),
    Figure("cow", "python -m refserve.kv_cache.demo kv_cache_manager",
           cli("refserve.kv_cache.demo", ["kv_cache_manager"],
               lambda line: line.startswith(("b shares", "c writes", "  ")) or
               "[0, 1, 4]" in line)),
    Figure("scheduler", "python -m refserve.scheduler", scheduler_summary),
    Figure("scheduler-events", "python -m refserve.scheduler", scheduler_events),
    Figure("formula", "python -c", formula),
    Figure("radix", "python -m refserve.kv_cache.radix_demo", radix),
    Figure("paged-bench", "python -m refserve.bench paged", bench_paged, kind="recorded"),
    Figure("batching-bench", "python -m refserve.bench batching", bench_batching,
           kind="recorded"),
    Figure("chunked-bench", "python -m refserve.bench chunked", bench_chunked,
           kind="recorded"),
    Figure("batching-overhead", "python -m refserve.bench batching", bench_overhead,
           kind="recorded", prompt=False),
    Figure("loadtest-bench", "python -m refserve.bench loadtest", bench_loadtest,
           kind="recorded"),
    Figure("prefix-bench", "python -m refserve.bench prefix", bench_prefix("policies"),
           kind="recorded", prompt=False),
    Figure("prefix-scheduling", "python -m refserve.bench prefix", bench_prefix("scheduling"),
           kind="recorded", prompt=False),
    Figure("preemption-bench", "python -m refserve.bench preemption", bench_preemption,
           kind="recorded", prompt=False),
]
FIGURES += [war_story(n) for n in ("oom", "static", "speculation", "speculation-sim",
                                    "prefix", "chunked")]
BY_NAME = {f.name: f for f in FIGURES}


# ---- comparing and rewriting ----------------------------------------------------------------

def block_text(fig: Figure, body: str) -> str:
    if fig.name == "formula":
        return "$ python -c " + body
    return (f"$ {fig.command}\n" if fig.prompt else "") + body


def masked(fig: Figure, text: str) -> str:
    """A timed figure's line with its seconds and speedups as "~" and its spacing squeezed
    (a table pads a column to its widest timed value)."""
    if fig.kind != "timed":
        return text
    return " ".join(TIMED.sub("~", text).split())


def used_names(text: str) -> set[str]:
    return {m["name"] for m in BLOCK.finditer(text)} | {m["name"] for m in PROSE.finditer(text)}


def compute_all(names) -> dict[str, tuple[str, dict]]:
    from tqdm import tqdm

    return {n: BY_NAME[n].compute() for n in tqdm(names, desc="figures", unit="figure",
                                                  file=sys.stderr)}


def compare(text: str, results: dict[str, tuple[str, dict]]) -> list[Stale]:
    """Every difference between WARMUP's text and the figures in `results`."""
    stale = []
    for m in BLOCK.finditer(text):
        if m["name"] not in results:
            continue
        fig = BY_NAME[m["name"]]
        want = block_text(fig, results[fig.name][0]).split("\n")
        have = m["body"].split("\n")
        for i in range(max(len(want), len(have))):
            a = have[i] if i < len(have) else "<no line>"
            b = want[i] if i < len(want) else "<no line>"
            if masked(fig, a) != masked(fig, b):
                stale.append(Stale(fig, f"output block, line {i + 1}", a, b))
                break
    for m in PROSE.finditer(text):
        if m["name"] not in results:
            continue
        fig = BY_NAME[m["name"]]
        values = results[fig.name][1]
        if m["key"] not in values:
            stale.append(Stale(fig, f"prose {m['name']}.{m['key']}", m["value"],
                               "<no such value>"))
        elif values[m["key"]] != m["value"]:
            stale.append(Stale(fig, f"prose {m['name']}.{m['key']}", m["value"],
                               values[m["key"]]))
    return stale


def rewrite(text: str, results: dict[str, tuple[str, dict]]) -> str:
    def block(m):
        if m["name"] not in results:
            return m[0]
        return m[1] + block_text(BY_NAME[m["name"]], results[m["name"]][0]) + m[4]

    def prose(m):
        values = results.get(m["name"], (None, {}))[1]
        return m[1] + values.get(m["key"], m["value"]) + m[5] if m["key"] in values else m[0]

    return PROSE.sub(prose, BLOCK.sub(block, text))


def unknown_names(text: str) -> list[str]:
    return sorted(used_names(text) - set(BY_NAME))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=REFRESH, description=__doc__, allow_abbrev=False,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="compare only; exit 1 when stale")
    p.add_argument("--only", nargs="+", metavar="NAME", help="just these figures")
    p.add_argument("--skip-model", action="store_true",
                   help="leave out the figures that load the embedded model")
    p.add_argument("--list", action="store_true", help="name every figure and its command")
    args = p.parse_args(argv)
    if args.list:
        for f in FIGURES:
            print(f"{f.name:<22} {f.kind:<13} {f.command}")
        return 0
    text = WARMUP.read_text()
    bad = unknown_names(text) + [n for n in args.only or () if n not in BY_NAME]
    if bad:
        print(f"error: no figure named {', '.join(bad)} (see --list)", file=sys.stderr)
        return 2
    names = [f.name for f in FIGURES if (args.only is None or f.name in args.only)
             and not (args.skip_model and f.loads_model) and f.name in used_names(text)]
    results = compute_all(names)
    stale = compare(text, results)
    for s in stale:
        print(s)
    if args.check:
        return 1 if stale else 0
    new = rewrite(text, results)
    if new != text:
        WARMUP.write_text(new)
    print(f"WARMUP.md: {len(names)} figures checked, {len(stale)} rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
