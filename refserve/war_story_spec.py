"""The war story "speculative decoding made it worse", on the embedded SmolLM2-135M
(`python -m refserve.war_stories speculation`).

Two drafters, two workloads, each cell beside plain decoding of the same requests:

    weak draft   the target's own first 8 of 30 layers (draft_model "self"): a draft pass
                 costs about 0.4 of a target pass (the LM head is a fifth of the model), and
                 an early exit this shallow rarely guesses the target's token
    n-gram       prompt lookup: drafts copied from the context, free to propose

    creative     "Write a short story about ...", sampled at temperature 1 (seeded)
    quotes       "Repeat the following passage exactly ...", greedy

k = 4 drafts a step, the adaptive rule off: every drafted step pays for its drafts whatever
they earn, as in the seed's story before anyone looked at the acceptance rate. Printed per
cell: drafts proposed and accepted, the draft acceptance rate (accepted / proposed, vLLM's
name; not α, the per-token acceptance probability of the expected-length formula), output
tokens per target pass, wall-clock seconds and the speedup over no speculation.

The counted columns are deterministic on a machine (the tuned CPU backend, float32, seeded
sampling); the seconds are wall-clock, the systems taking turns request by request.
"""

from __future__ import annotations

import time

from refserve.bench.common import print_table

K = 4
DRAFT_LAYERS = 8
MAX_TOKENS = 32
TOPICS = ("a lighthouse keeper who finds a strange bottle", "a robot learning to paint")
DRAFTERS = {
    "none": None,
    f"weak draft (self, {DRAFT_LAYERS} layers)": {
        "method": "draft_model", "model": "self", "num_draft_layers": DRAFT_LAYERS,
        "num_speculative_tokens": K, "adaptive": False},
    "n-gram": {"method": "ngram", "num_speculative_tokens": K, "adaptive": False},
}


def _workloads(tok):
    from refserve.bench.corpus import passage
    from refserve.sampling import SamplingParams

    def chat(text):
        return tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                       add_generation_prompt=True)

    creative = [chat(f"Write a short story about {t}.") for t in TOPICS]
    quotes = [chat("Repeat the following passage exactly, word for word:\n\n"
                   + passage(tok, 120, seed)) for seed in range(len(TOPICS))]
    return {
        "creative": (creative, [SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0,
                                               seed=i, ignore_eos=True)
                                for i in range(len(creative))]),
        "quotes": (quotes, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                           ignore_eos=True)] * len(quotes)),
    }


def run_speculation(progress: bool = True) -> list[dict]:
    """Run the grid and print it; returns its rows."""
    from tqdm import tqdm

    from refserve import LLM
    from refserve.sampling import SamplingParams

    print(f"The speculation story: SmolLM2-135M on the tuned CPU backend, batch 1, k = {K}, "
          f"the adaptive rule off, {MAX_TOKENS} output tokens per request")
    llms = {name: LLM(backend="cpu", progress=False, speculative_config=spec)
            for name, spec in DRAFTERS.items()}
    for llm in llms.values():  # first-call costs are not speculation's
        llm.generate(["Hello"], SamplingParams(max_tokens=4, temperature=0.0), use_tqdm=False)
    workloads = _workloads(llms["none"].get_tokenizer())
    names = list(llms)
    rows = []
    bar = tqdm(total=sum(len(p) for p, _ in workloads.values()) * len(names),
               desc="speculation", unit="request", disable=not progress)
    for kind, (prompts, params) in workloads.items():
        stats = {name: dict(seconds=0.0, tokens=0, proposed=0, accepted=0, passes=0)
                 for name in names}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            for name in names[i % len(names):] + names[:i % len(names)]:
                t0 = time.perf_counter()
                out = llms[name].generate([prompt], p, use_tqdm=False)[0]
                st, m = stats[name], out.metrics
                st["seconds"] += time.perf_counter() - t0
                st["tokens"] += len(out.outputs[0].token_ids)
                st["proposed"] += m.num_spec_proposed
                st["accepted"] += m.num_spec_accepted
                st["passes"] += m.num_target_passes
                bar.update(1)
        for name in names[1:]:
            st = stats[name]
            rows.append({
                "workload": kind, "drafter": name, "proposed": st["proposed"],
                "accepted": st["accepted"],
                "rate": f"{st['accepted'] / st['proposed']:.1%}" if st["proposed"] else "-",
                "per_pass": st["tokens"] / st["passes"],
                "seconds": f"{st['seconds']:.2f} s",
                "plain": f"{stats['none']['seconds']:.2f} s",
                "speedup_x": stats["none"]["seconds"] / st["seconds"]})
            rows[-1]["speedup"] = f"{rows[-1]['speedup_x']:.2f}x"
    bar.close()
    print()
    print_table(rows, [("workload", "workload", ""), ("drafter", "drafter", ""),
                       ("proposed", "drafts", "d"), ("accepted", "accepted", "d"),
                       ("rate", "accepted/proposed", ""),
                       ("per_pass", "tokens/target pass", ".2f"),
                       ("plain", "no spec", ""), ("seconds", "with spec", ""),
                       ("speedup", "speedup", "")])
    weak = next(r for r in rows if r["workload"] == "creative" and r["drafter"] != "n-gram")
    ngram = next(r for r in rows if r["workload"] == "quotes" and r["drafter"] == "n-gram")
    print(f"lesson: the weak draft on creative text: {weak['rate']} of drafts accepted, "
          f"{weak['speedup']} (slower); n-gram on quotes: {ngram['rate']} accepted, "
          f"{ngram['speedup']}. Acceptance is the whole game.")
    return rows
