"""Cells of notebooks/04_capacity_and_the_contract.ipynb (built by build_notebooks.py)."""

CELLS = [
    ("md", r"""
# 04 · Capacity and the contract

Weights decide whether a model loads; **KV memory decides how many users it serves at once.**
This notebook does the capacity arithmetic with `refserve.capacity`, replays the "it fits in
memory" war story (the weights fit, the KV cache at peak does not) on the embedded model with
a small pool, measures TTFT and TPOT against batch size in-process, and replays every war
story of WARMUP.md §11 at Llama-3-8B scale on the simulator.

* WARMUP.md §2 (capacity), §10 (the contract), §11 (war stories)
* code: `refserve/capacity.py`, `refserve/metrics.py`, `refserve/scheduler/scheduler.py` (preemption)
* grading: `pytest -m capacity`, `-m preemption`, `-m engine`
"""),
    ("code", r"""
import matplotlib.pyplot as plt
import numpy as np

from refserve import LLM, SamplingParams
from refserve import capacity as cap
from refserve.engine import load_tokenizer, resolve_model_path
"""),
    ("md", r"""
## 1. The capacity math

    KV bytes per token = 2 (K and V) × layers × KV heads × head_dim × dtype bytes
    pool (blocks)      = floor((memory × utilisation − weights) / (block_size × bytes per token))
    max concurrency    = floor(pool / ceil(context / block_size))

For the embedded SmolLM2-135M and for Llama-3-8B and Llama-3-70B shapes, all in float16, on an
80 GiB card at `gpu_memory_utilization = 0.9` and 8192 tokens of context (the 70B's weights
alone are larger than the card: no pool at all, whatever the batch):
"""),
    ("code", r"""
GiB = 2**30
memory, utilization, block_size, context = 80 * GiB, 0.9, 16, 8192
rows = {}
for name, config in cap.PRESETS.items():
    shape = cap.model_shape(config)
    per_token = cap.kv_bytes_per_token(shape["num_layers"], shape["num_kv_heads"],
                                       shape["head_dim"], cap.DTYPE_BYTES["float16"])
    weights = cap.weights_bytes(config, cap.DTYPE_BYTES["float16"])
    per_seq = cap.blocks_for_tokens(context, block_size)
    head = f"{name:>13}: {per_token / 1024:7.1f} KiB per token | weights {weights / GiB:6.2f} GiB"
    if weights > utilization * memory:
        # Llama-3-70B: 131 GiB of float16 weights; it needs tensor parallelism (planner).
        print(f"{head} | does not fit on one {memory / GiB:.0f} GiB GPU: split it over several")
        continue
    pool = cap.num_blocks_for_memory(memory, utilization, weights,
                                     cap.kv_bytes_per_block(per_token, block_size))
    rows[name] = (per_token, weights, pool, per_seq,
                  cap.max_concurrent_sequences(pool, context, block_size))
    print(f"{head} | pool {pool:>9,} blocks | {per_seq} blocks per {context}-token sequence "
          f"| max concurrency {rows[name][4]:,}")
"""),
    ("md", r"""
The war story in one picture: demand grows linearly with the number of concurrent sequences,
the pool is a fixed line. Batch 8 (the load test) uses a sliver of the Llama-3-8B pool; batch
60 (production) is past it.
"""),
    ("code", r"""
per_token, weights, pool, per_seq, max_seqs = rows["llama-3-8b"]
batch = np.arange(0, 81)
plt.figure(figsize=(6, 3))
plt.plot(batch, batch * per_seq, label=f"KV demand: batch × {per_seq} blocks")
plt.axhline(pool, color="tab:red", label=f"pool: {pool:,} blocks")
for b in (8, 60):
    plt.plot([b], [b * per_seq], "o")
    plt.annotate(f"batch {b}: {b * per_seq:,}", (b, b * per_seq), textcoords="offset points",
                 xytext=(-60, 8))
plt.axvline(max_seqs, ls=":", color="0.5", label=f"max_num_seqs cap = {max_seqs}")
plt.xlabel("concurrent 8192-token sequences")
plt.ylabel("KV blocks")
plt.title("Llama-3-8B shape, 80 GiB, float16")
plt.legend(fontsize=8)
plt.show()
"""),
    ("md", r"""
## 2. The OOM at peak, replayed with a small pool

The embedded model with a pool of 12 blocks of 16 tokens (192 token slots) and eight requests,
each generating 24 tokens (greedy, `ignore_eos=True`). The cell below computes each request's
peak demand in blocks: together they need more than the pool. With `max_num_seqs=8` the
scheduler admits all eight while their prompts fit, the pool runs dry as they decode, and it
must **preempt** (recompute). refserve does not crash; a real deployment pays in recomputed
prefills and in tail latency. Capping `max_num_seqs` at what the pool holds at peak
(`floor(pool / blocks per request)`) queues the rest instead.
"""),
    ("code", r"""
prompts = [f"Question {i}: name three facts about the number {i * 7 + 3} and explain why."
           for i in range(8)]
params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
POOL_BLOCKS, BLOCK = 12, 16

tok = load_tokenizer(resolve_model_path(None, progress=False))   # the embedded model's
peak = [cap.blocks_for_tokens(len(tok.encode(p, add_special_tokens=False)) + params.max_tokens,
                              BLOCK) for p in prompts]
capped = POOL_BLOCKS // max(peak)
print(f"blocks per request at its peak: {peak} -> {sum(peak)} together, pool {POOL_BLOCKS}; "
      f"cap max_num_seqs at {POOL_BLOCKS} // {max(peak)} = {capped}")


def replay(max_num_seqs):
    llm = LLM(num_gpu_blocks_override=POOL_BLOCKS, block_size=BLOCK, max_model_len=128,
              max_num_seqs=max_num_seqs, backend="numpy", progress=False)
    engine = llm.llm_engine
    kv = engine.kv_cache_manager
    for i, prompt in enumerate(prompts):
        engine.add_request(str(i), prompt, params)
    held, preempted_at, outputs = [], [], {}
    while engine.has_unfinished_requests():
        before = engine.scheduler.num_preemptions
        for o in engine.step():
            if o.finished:
                outputs[o.request_id] = o
        held.append(kv.num_held_blocks)
        if engine.scheduler.num_preemptions > before:
            preempted_at.append(len(held) - 1)
    return engine, held, preempted_at, outputs


runs = {n: replay(n) for n in (8, capped)}
for n, (engine, _, _, outputs) in runs.items():
    s = engine.stats()
    ttfts = [o.metrics.ttft for o in outputs.values()]
    print(f"max_num_seqs={n}: {s['num_steps']} steps, {s['num_preemptions']} preemptions, "
          f"KV blocks at peak {s['kv_blocks_peak']}/{s['kv_blocks_total']}, "
          f"TTFT max {max(ttfts):.2f} s")
same = ({k: o.outputs[0].text for k, o in runs[8][3].items()}
        == {k: o.outputs[0].text for k, o in runs[capped][3].items()})
print("same text either way (preemption recomputes, it does not change the answer):", same)
"""),
    ("code", r"""
fig, axes = plt.subplots(1, 2, figsize=(12, 3), sharey=True)
for ax, (n, (engine, held, preempted_at, _)) in zip(axes, runs.items()):
    ax.step(range(len(held)), held, where="post", label="blocks held after the step")
    ax.axhline(engine.kv_cache_manager.num_blocks, color="tab:red", label="pool")
    for step in preempted_at:
        ax.axvline(step, color="tab:orange", alpha=0.5)
    ax.set_title(f"max_num_seqs={n}: {len(preempted_at)} steps with a preemption (orange)")
    ax.set_xlabel("step")
axes[0].set_ylabel("KV blocks")
axes[0].legend(fontsize=8, loc="lower right")
fig.tight_layout()
plt.show()
"""),
    ("md", r"""
## 3. TTFT and TPOT against batch size

The contract is written in TTFT (time to first token), TPOT (time per output token),
throughput and dollars, and they pull against each other. A short in-process measurement:
B requests submitted together, for B = 1, 2, 4, 8, each generating 12 tokens.

The evidence is **counted** first: how many engine steps (target passes) the batch took and
how many tokens each step produced. A decode step reads the weights once for all B running
sequences, so tokens per step grows with B while the step count stays about the same: that
is where a bigger batch's throughput comes from, on any machine. The wall times (TTFT, TPOT,
tokens/s) are measured in ROUNDS interleaved repeats (each round runs B = 1, 2, 4, 8 once, so
a burst of load on a shared machine hits every B alike) and shown as the median with its
min–max spread; one run of each can rank B = 2 below B = 4 by noise alone. The prefix cache
is off so that every round computes the same prompts again. CPU numbers are small-model,
2-core numbers: the shape matters, not the values.
"""),
    ("code", r"""
# The tuned CPU backend, as a user runs it: this cell times it (the reference gives the same
# tokens: tests/test_backend_equality_cpu.py).
llm = LLM(num_gpu_blocks_override=64, block_size=16, max_model_len=128, max_num_seqs=8,
          enable_prefix_caching=False, backend="cpu", progress=False)
measure = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
llm.generate(prompts[:1], measure, use_tqdm=False)   # warm-up (first-call allocations)
BATCHES, ROUNDS = (1, 2, 4, 8), 3
counted, timed = {}, {b: [] for b in BATCHES}
for r in range(ROUNDS):
    for b in BATCHES:                                # interleaved: every B once per round
        llm.generate(prompts[:b], measure, use_tqdm=False)
        s = llm.last_summary
        cell = (s.num_steps, s.num_output_tokens, s.slot_steps_used)
        assert counted.setdefault(b, cell) == cell   # counts do not change between rounds
        timed[b].append((s.ttft_p50 * 1000, s.tpot_p50 * 1000, s.output_tokens_per_s))
print(f"{'batch':>5}  {'steps':>5}  {'tokens':>6}  {'tokens/step':>11}  "
      f"{'TTFT p50 ms':>19}  {'TPOT p50 ms':>17}  {'tokens/s':>17}   (median [min, max])")
for b in BATCHES:
    steps, tokens, _ = counted[b]
    cols = np.array(timed[b])
    spread = [f"{np.median(c):.0f} [{c.min():.0f}, {c.max():.0f}]" for c in cols.T]
    print(f"{b:>5}  {steps:>5}  {tokens:>6}  {tokens / steps:>11.2f}  {spread[0]:>19}  "
          f"{spread[1]:>17}  {spread[2]:>17}")
fig, axes = plt.subplots(1, 4, figsize=(14, 2.8))
axes[0].plot(BATCHES, [counted[b][1] / counted[b][0] for b in BATCHES], "o-")
axes[0].set_title("tokens per step\ncounted", fontsize=9)
for ax, col, label in zip(axes[1:], (0, 1, 2), ("TTFT p50 (ms)", "TPOT p50 (ms)",
                                                "throughput (output tokens/s)")):
    cols = np.array([[t[col] for t in timed[b]] for b in BATCHES])
    med = np.median(cols, axis=1)
    ax.errorbar(BATCHES, med, yerr=[med - cols.min(axis=1), cols.max(axis=1) - med],
                fmt="o-", capsize=3)
    ax.set_title(f"{label}\nmedian, min–max of {ROUNDS}", fontsize=9)
for ax in axes:
    ax.set_xlabel("batch size")
    ax.set_xticks(BATCHES)
fig.tight_layout()
plt.show()
"""),
    ("md", r"""
## 4. The war stories at their real size

The same Scheduler and KVCacheManager, at Llama-3-8B on one H100 SXM 80 GB: the simulator
(`refserve/simulator/`) replaces only the model forward, by the roofline cost model of the
step's composition (every GPU figure's source is in `refserve/simulator/gpus.toml`). Each
story below is one command of WARMUP.md §11, `python -m refserve.war_stories STORY`, run
through its Python API: the same runs, the same seed, the same table and lesson line. It
prints the `python -m refserve.simulate` flags of each run. Together they take about a
minute.

**The OOM at peak.** 300 requests whose contexts nearly fill 8192 tokens, 3 per second:
vLLM's default `max_num_seqs` 256 against 53, what the pool holds at 8192 tokens. Uncapped,
the pool fills and the scheduler preempts; capped, nothing is preempted and TPOT p99 drops,
paid for in queueing (TTFT).
"""),
    ("code", r"""
from refserve.war_stories import run_story

run_story("oom", progress=False)
"""),
    ("md", r"""
**The long answer in a static batch.** 1000 chat requests at once: static batching holds
each seat until the batch's longest answer ends.
"""),
    ("code", r"""
run_story("static", progress=False)
"""),
    ("md", r"""
**The prefix nobody was sharing.** One 1500-token system prompt, 200 requests at once.
"""),
    ("code", r"""
run_story("prefix", progress=False)
"""),
    ("md", r"""
**The chunked-prefill rescue.** Long documents at 5 per second under three schedules:
prefill-first (decodes wait while prompts are prefilled), mixed (whole prompts beside the
decodes, budget 8192) and chunked (a 2048- or 512-token budget caps what a prompt adds to a
step; too small a budget pays the engine's host cost in too many steps, and the prompts
queue).
"""),
    ("code", r"""
run_story("chunked", progress=False)
"""),
    ("md", r"""
**"Speculative decoding made it worse".** k = 4 at α = 0.3 and 0.8 (α: the per-token
acceptance probability the simulator draws with), a self-draft (the target's first 16
layers: about 0.22 of a decode step per draft, which pays no scheduler call of its own) against free n-gram drafts, the adaptive rule
off. Tokens per verify step follow (1 − α^(k+1)) / (1 − α); what they buy depends on what a
draft costs. The `accepted/proposed` column is the draft acceptance rate the engine counts,
lower than α. (The same story on the embedded model, with real drafts and wall-clock
seconds: `python -m refserve.war_stories speculation`, notebook 03.)
"""),
    ("code", r"""
run_story("speculation-sim", progress=False)
"""),
    ("md", r"""
**Try it**: give the replay 24 blocks and find the smallest pool with no preemption at
`max_num_seqs=8`; predict it first from the arithmetic (WARMUP.md §11 exercise 1 does the same
for the 80 GiB card). For the contract, write a TPOT target and read off the largest batch
that meets it from the chart above.
"""),
]
