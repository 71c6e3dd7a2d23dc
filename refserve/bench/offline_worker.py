"""`compare --in-process`'s worker: one engine, refserve or vLLM, in a process of its own,
running workloads through its offline API (`LLM.generate`) as the bench sends them.

    python offline_worker.py ENGINE MODEL_DIR MAX_NUM_SEQS MAX_MODEL_LEN SEED

ENGINE is "refserve" or "vllm". The worker builds its `LLM` (float32, prefix caching on),
prints {"ready": true, "engine": ...} and then answers each line of stdin, a job

    {"requests": [{"prompt": [token ids], "max_tokens": n}, ...], "one_at_a_time": bool}

with one line {"seconds": wall time of the generate calls, "output_tokens": n}: greedy,
EOS ignored, all requests in one `generate` call (the engine schedules them on its seats),
or one call per request (batch 1). Nothing else of refserve is imported, so vLLM's own
environment runs this file as it is.
"""

from __future__ import annotations

import json
import sys
import time


def build(engine: str, model: str, max_num_seqs: int, max_model_len: int, seed: int):
    """(llm, SamplingParams class) of the engine asked for."""
    common = dict(model=model, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
                  enable_prefix_caching=True, seed=seed)
    if engine == "vllm":
        from vllm import LLM, SamplingParams

        return LLM(dtype="float32", **common), SamplingParams
    if engine == "refserve":
        from refserve import LLM, SamplingParams

        return LLM(progress=False, **common), SamplingParams
    raise SystemExit(f"offline_worker: unknown engine {engine!r} (refserve or vllm)")


def run(llm, sampling_params, job: dict) -> dict:
    prompts = [{"prompt_token_ids": r["prompt"]} for r in job["requests"]]
    params = [sampling_params(max_tokens=r["max_tokens"], temperature=0.0, ignore_eos=True)
              for r in job["requests"]]
    t0 = time.perf_counter()
    if job.get("one_at_a_time"):
        outs = [o for p, sp in zip(prompts, params)
                for o in llm.generate([p], [sp], use_tqdm=False)]
    else:
        outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - t0
    return {"seconds": seconds,
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}


def main(argv: list[str]) -> None:
    engine, model, seats, model_len, seed = argv
    llm, sampling_params = build(engine, model, int(seats), int(model_len), int(seed))
    print(json.dumps({"ready": True, "engine": engine}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run(llm, sampling_params, json.loads(line))), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
