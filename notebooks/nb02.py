"""Cells of notebooks/02_one_scheduler_iteration.ipynb (built by build_notebooks.py)."""

CELLS = [
    ("md", r"""
# 02 · One scheduler iteration, stage by stage

A serving engine repeats one step. `LLMEngine.step()` in `refserve/engine.py` is eight public
stages, and nothing else; this notebook runs them **one cell each, with exactly the calls
`step()` makes**, on the embedded SmolLM2-135M and a deliberately tiny KV pool, so that
admission, chunked prefill, retirement and preemption all happen within a dozen steps. Each
stage hands its result to the next as a value. The listing of the stages belongs to
`refserve/engine.py` (its module docstring); the first cell prints it from there.

* WARMUP.md §1 (the step), §6 (iteration- vs request-level batching), §7 (chunked prefill,
  preemption)
* code: `refserve/engine.py`, `refserve/scheduler/`, `refserve/model_runner.py`
* grading: `pytest -m scheduler`, `-m chunked_prefill`, `-m preemption`, `-m engine`
"""),
    ("code", r"""
import refserve.engine

# The step's eight stages, as refserve/engine.py lists them (the one place they are written).
print("\n\n".join(refserve.engine.__doc__.split("\n\n")[1:3]))
"""),
    ("code", r"""
import time

import matplotlib.pyplot as plt
from matplotlib.ticker import MaxNLocator
import numpy as np
from kvpictures import before_after, snapshot

from refserve import LLM, SamplingParams

POOL = dict(num_gpu_blocks_override=10, block_size=4, max_model_len=40,   # 10 blocks x 4 = 40 slots
            max_num_seqs=3, max_num_batched_tokens=16)           # 3 seats, 16 tokens a step
llm = LLM(**POOL, backend="numpy", progress=False)   # the plain reference: the code you read
engine = llm.llm_engine
scheduler, runner, kv = engine.scheduler, engine.runner, engine.kv_cache_manager
print(f"{kv.num_blocks} blocks of {kv.block_size} tokens, {scheduler.max_num_seqs} seats, "
      f"token budget {scheduler.max_num_batched_tokens}")
"""),
    ("md", r"""
## The workload

Four requests of different lengths. Greedy, and `ignore_eos=True` so every request runs to
exactly `max_tokens`: the story below is then the same on every machine. Prompts are cut to
exact token counts so that the arithmetic is easy to follow: 13 + 8 + 3 + 5 prompt tokens.
"""),
    ("code", r"""
tok = engine.tokenizer
texts = {
    "long":  ("The history of the printing press begins in the fifteenth century, when "
              "Johannes Gutenberg", 13, 10),
    "mid":   ("A haiku about autumn leaves falling in the quiet", 8, 9),
    "short": ("Two plus two", 3, 3),
    "late":  ("The capital city of France is", 5, 5),
}
for request_id, (text, prompt_len, max_tokens) in texts.items():
    prompt_ids = tok.encode(text, add_special_tokens=False)[:prompt_len]
    engine.add_request(request_id, prompt_ids, SamplingParams(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
SEQS = [engine.requests[r].seqs[0] for r in texts]   # for the pictures: one colour each
for seq in SEQS:
    print(f"seq {seq.seq_id} {seq.request_id:>5}: {seq.num_prompt_tokens:>2} prompt tokens, "
          f"max_tokens {seq.sampling_params.max_tokens}: {tok.decode(seq.prompt_token_ids)!r}")
print("waiting:", [s.seq_id for s in scheduler.waiting], " running:", scheduler.running)
"""),
    ("md", r"""
## Iteration 0, one stage per cell

### Stage 0: `proposals = engine.propose()`

With `speculative_config` set, this is where the proposer (n-gram or draft model) drafts
tokens for each decoding sequence (notebook 03). The drafts are a value handed to the next
stages, never stored on a sequence (`refserve/scheduler/drafts.py` tells their whole life).
This engine does not speculate, so it proposes nothing; `step()` calls it all the same.
"""),
    ("code", r"""
proposals = engine.propose()
print("proposals:", proposals)
"""),
    ("md", r"""
### Stage 1: `out = scheduler.schedule(proposals)`

Continuous batching first ADVANCES the running sequences (none yet), then ADMITS waiting ones
first-come-first-served while a seat, token budget and KV blocks are left. The budget is 16
tokens: `long` takes 13 for its whole prompt, `mid` gets the 3 that are left, a **chunked
prefill** (`kind = chunk`: it does not reach the end of its prompt, so it samples nothing).
`short` would need a token of budget: it waits.
"""),
    ("code", r"""
pool_before = snapshot(kv, SEQS)
out = scheduler.schedule(proposals)
print(out)
"""),
    ("md", r"""
The last line counts the pool in three words: **held** blocks (some block table holds them),
**cached** ones (evictable: nobody holds them, but their KV is still findable by the prefix
cache) and **free** ones. The pool is at its fullest right after `schedule()` (this step's
blocks are allocated, nothing is retired yet); the KV-cache manager records that peak itself,
inside `allocate_slots`.
"""),
    ("code", r"""
print("KV blocks held at peak so far:", kv.num_held_blocks_peak, "of", kv.num_blocks)
"""),
    ("md", r"""
### Stage 2: `inputs = runner.prepare(out)`

The scheduler's rows become one flat batch of integers: every query token of every row, one
after the other (decodes first), with its absolute **position** and the **slot** its K/V will be
written to, `slot = block_table[p // 4] * 4 + p % 4`. `query_start_loc` says where each row's
tokens start, `context_lens` how many keys each row sees after the write, and `block_tables`
are what paged attention reads (padded with -1). `logits_indices` picks the tokens whose
logits are needed: only the last prompt token of `long`; `mid`'s chunk needs none.
"""),
    ("code", r"""
inputs = runner.prepare(out)
print(inputs)
"""),
    ("md", r"""
### Stage 3: `runner.copy_blocks(out.block_copies, out.swap_out, out.swap_in)`

Copy-on-write pairs, copied in every layer's K and V cache **before** the forward writes.
Nobody shares a block in this workload, so the list is empty (notebook 01 shows a real copy).
"""),
    ("code", r"""
print("copy-on-write pairs:", out.block_copies)
runner.copy_blocks(out.block_copies, out.swap_out, out.swap_in)
"""),
    ("md", r"""
### Stage 4: `logits = runner.forward(inputs)`

One model forward over all 16 tokens at once. In each of the 30 layers, `write_kv` scatters
the new keys and values into their slots and `paged_attention` reads each row's context
through its block table. Only the rows named by `logits_indices` come back: one row of
49,152 logits here.
"""),
    ("code", r"""
t0 = time.perf_counter()
logits = runner.forward(inputs)
print(f"logits {logits.shape} in {time.perf_counter() - t0:.2f} s; greedy choice per row:",
      [tok.decode([int(i)]) for i in logits.argmax(axis=-1)])
"""),
    ("md", r"""
### Stage 5: `sampled = engine.sample(out, logits, proposals)`

One token per sampling row, with each request's own sampling parameters and seeded generator
(greedy here); a speculative verify row would get its accepted drafts plus one token instead.
Nothing in the engine has changed yet: had any stage so far failed, the next `schedule()`
would redo the same work.
"""),
    ("code", r"""
sampled = engine.sample(out, logits, proposals)
print("seq_id -> sampled tokens:", sampled.token_ids)
"""),
    ("md", r"""
### Stage 6: `update = scheduler.update(out, sampled)`

Now the step is applied, and this is the ONLY place a sequence finishes:
`num_computed_tokens` advances by the tokens computed, sampled tokens are appended one by one
under the stop rules (EOS, stop ids, stop strings, lengths: `refserve/sequence.py`),
full computed blocks are hashed for the prefix cache, finished sequences are RETIRED and their
blocks released. The `StepUpdate` it returns records what it decided.

In the picture each block-table entry says how many of its slots hold written K/V
(`KV c/4`), and each sequence how many of its tokens are computed: `long` has 13 of 14 (the
token just sampled gets its KV in the next step, hatched), `mid` 3 of 8: its chunk filled 3
slots of block 4, and the other 5 prompt tokens have no KV (nor, past block 4, a block) yet.
"""),
    ("code", r"""
update = scheduler.update(out, sampled)
for seq in SEQS:
    print(f"seq {seq.seq_id} {seq.request_id:>5}: {seq.status.value:<8} computed "
          f"{seq.num_computed_tokens:>2} / {seq.num_tokens:>2} tokens")
print("appended:", update.appended, "| retired:", update.retired)
before_after(pool_before, snapshot(kv, SEQS), ("before iteration 0", "after iteration 0"))
plt.show()
"""),
    ("md", r"""
### Stage 7: `outputs = engine.finish_step(out, sampled, update)`

Only reporting is left: per-request target passes, first-token and finish times, the text
as the stop rules cut it, and one `RequestOutput` per request that got tokens.
"""),
    ("code", r"""
outputs = engine.finish_step(out, sampled, update)
print([(o.request_id, o.outputs[0].text, o.finished) for o in outputs])
"""),
    ("md", r"""
## The next iterations: the same eight calls in a function

`iteration()` is `engine.step()` written out: the same calls in the same order. Each line of
the log says who was **admitted**, who **advanced** (was computed this step), who **retired**
and who was **preempted**. We also count slot-steps: each of the 3 seats in each step is
*used* when it computes a live sequence.

Watch for the step that preempts: the pool has only 10 blocks, and when a running sequence
needs a new block and none is free, the scheduler preempts the **newest** running sequence
(`late`): its blocks are freed and it goes back to the head of the waiting queue, output
kept, to be prefilled again later (*recompute*). Nobody crashes; the price is recomputation
and latency.
"""),
    ("code", r"""
def iteration(engine):
    # LLMEngine.step(), stage by stage (timing and error wrapping left out).
    scheduler, runner = engine.scheduler, engine.runner
    proposals = engine.propose()
    out = scheduler.schedule(proposals)
    inputs = runner.prepare(out)
    runner.copy_blocks(out.block_copies, out.swap_out, out.swap_in)
    logits = runner.forward(inputs)
    sampled = engine.sample(out, logits, proposals)
    update = scheduler.update(out, sampled)
    outputs = engine.finish_step(out, sampled, update)
    return out, update.retired, outputs


def log_line(out, retired):
    advanced = [r.seq.seq_id for r in out.scheduled if r.seq.seq_id not in out.admitted]
    return (f"step {out.step:>2}: admitted {out.admitted!s:<7} advanced {advanced!s:<10} "
            f"retired {[s.seq_id for s in retired]!s:<7} preempted {out.preempted!s:<5} "
            f"tokens {out.num_batched_tokens:>2}  blocks held {out.blocks.held}")


print(log_line(out, update.retired))    # iteration 0, from the cells above
preemption = None
while engine.has_unfinished_requests() and scheduler.num_steps < 9:
    before = snapshot(kv, SEQS)
    out, retired, outputs = iteration(engine)
    print(log_line(out, retired))
    if out.preempted and preemption is None:
        preemption = (before, snapshot(kv, SEQS), out)
"""),
    ("code", r"""
before, after, out_preempt = preemption
print(out_preempt)
before_after(before, after, (f"before step {out_preempt.step}",
                             f"step {out_preempt.step}: seq {out_preempt.preempted} preempted"))
plt.show()
"""),
    ("md", r"""
## `engine.step()` does the same

From here the engine's own `step()` finishes the run. It returns the same kind of result as
`iteration()` above (a list of `RequestOutput`), and the scheduler's counters keep counting as
if nothing had changed hands.
"""),
    ("code", r"""
while engine.has_unfinished_requests():
    outputs = engine.step()
    for o in outputs:
        print(f"step {scheduler.num_steps - 1:>2}: {type(o).__name__}({o.request_id!r}, "
              f"finished={o.finished}, tokens={len(o.outputs[0].token_ids)})")
stats = engine.stats()
print({k: stats[k] for k in ("num_steps", "slot_steps_used", "slot_steps_wasted",
                             "num_preemptions", "kv_blocks_peak", "kv_blocks_total")})
"""),
    ("md", r"""
## The same workload under static batching

Request-level (static) batching forms a batch only when none is running, reserves blocks for
each member's whole generation up front, and keeps a finished member in its seat, computed
as a **padding** row, until the whole batch is done. Same model, same pool, same requests,
`batching="static"`. Each bar below is one step's 3 seats: used (a live sequence advanced),
wasted (a finished one computed as padding) or idle (nobody in the seat).
"""),
    ("code", r"""
def slot_steps(engine, workload):
    # Run `workload` to completion with engine.step(); per step: (used, wasted, idle) seats.
    for request_id, (text, prompt_len, max_tokens) in workload.items():
        ids = tok.encode(text, add_special_tokens=False)[:prompt_len]
        engine.add_request(request_id, ids, SamplingParams(
            max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    s, rows, texts_out = engine.scheduler, [], {}
    while engine.has_unfinished_requests():
        used, wasted = s.slot_steps_used, s.slot_steps_wasted
        for o in engine.step():
            if o.finished:
                texts_out[o.request_id] = o.outputs[0].text
        used, wasted = s.slot_steps_used - used, s.slot_steps_wasted - wasted
        rows.append((used, wasted, s.max_num_seqs - used - wasted))
    return np.array(rows), texts_out


reference = dict(POOL, backend="numpy", progress=False)
continuous, texts_continuous = slot_steps(LLM(**reference).llm_engine, texts)
static, texts_static = slot_steps(LLM(**reference, batching="static").llm_engine, texts)
print("same text under both schedulers:", texts_continuous == texts_static)

fig, axes = plt.subplots(1, 2, figsize=(12, 3), sharey=True)
for ax, (name, rows) in zip(axes, [("continuous", continuous), ("static", static)]):
    steps = np.arange(len(rows))
    bottom = np.zeros(len(rows))
    for col, (label, color) in enumerate([("used", "tab:green"), ("wasted", "tab:red"),
                                          ("idle", "0.85")]):
        ax.bar(steps, rows[:, col], bottom=bottom, color=color, label=label)
        bottom += rows[:, col]
    used, wasted = rows[:, 0].sum(), rows[:, 1].sum()
    ax.set_title(f"{name}: {len(rows)} steps, slot-steps used {used}, wasted {wasted}")
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
axes[0].set_ylabel("seats")
axes[0].set_yticks(range(POOL["max_num_seqs"] + 1))
axes[1].legend(loc="upper left", bbox_to_anchor=(1.01, 1))  # beside the bars, not on them
fig.tight_layout()
plt.show()
"""),
    ("md", r"""
Static batching takes more steps for the same useful work: its seats sit wasted behind the
longest member of each batch, and nobody joins until the whole batch is done. Continuous
batching refills a seat the step after it frees up (WARMUP.md §6 turns this into a
throughput model).

**Try it**: give `POOL` 16 blocks and watch the preemption disappear; set
`max_num_batched_tokens=4` and count the prefill chunks; give `late` the same first 4 tokens
as `long` and look for a prefix-cache hit in its admission row.
"""),
]
