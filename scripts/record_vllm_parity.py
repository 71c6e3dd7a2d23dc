"""Record what the real vLLM generates for the embedded SmolLM2, so CI can check refserve
against it without vLLM (tests/test_vllm_parity.py reads the recording).

Run with the vLLM environment's python (scripts/make_vllm_env.sh makes it), from the repo root:

    /work/vllm-venv/bin/python scripts/record_vllm_parity.py            # ~5-10 min on 2 cores
    /work/vllm-venv/bin/python scripts/record_vllm_parity.py --check-with /work/venv/bin/python

It writes tests/data/vllm_parity.json: vLLM's version and settings, and for every case the
prompt, vLLM's prompt token ids, output token ids, text, finish reason and stop reason, and
(where asked) the top-5 logprobs of every output token and of every prompt token. Every case
is deterministic: greedy decoding (temperature 0), alone or with a logits processor
(penalties, logit_bias, bad_words, allowed_token_ids, min_tokens), stop rules, n-gram
speculation (which must not change greedy output). Seeded random sampling is left out: vLLM
draws with torch's generator and refserve with NumPy's, so the same seed gives different
(equally valid) samples. It also records how vLLM answers the three requests refserve's API
treats on its own (`edges`) and the shape of `LLM.get_metrics()`.

`--check-with PYTHON` then runs the parity tests with refserve's python against the new
recording (the comparison, without vLLM in that environment).

vLLM starts worker processes: everything runs under the `__main__` guard.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "tests" / "data" / "vllm_parity.json"
MODEL = Path(os.environ.get("REFSERVE_HOME", Path.home() / ".cache" / "refserve")) \
    / "models" / "SmolLM2-135M-Instruct"
MAX_TOKENS = 32
TOP = 5                 # logprobs per position
MAX_MODEL_LEN = 2048

RAW = [
    "The capital of France is",
    "Once upon a time, in a small village by the sea,",
    "The three primary colours are",
    "Water boils at a temperature of",
    "The best way to learn a new language is",
    "In 1969, astronauts first",
    "A good breakfast should include",
    "The difference between weather and climate is that",
]
CHAT = [
    "What is the capital of Japan?",
    "Write a haiku about the ocean.",
    "Explain photosynthesis in one sentence.",
    "Give me three tips for sleeping better.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Name a famous painting by Leonardo da Vinci.",
    "Why is the sky blue? Answer briefly.",
]
MULTILINGUAL = [
    "La capitale de l'Italie est",
    "Der größte Fluss in Deutschland ist",
    "El libro más famoso de Cervantes es",
    "日本の首都は",
    "中国最长的河流是",
    "Столица России —",
]
CODE = [
    "def fibonacci(n):\n",
    "import numpy as np\n\ndef softmax(x):\n",
    "// JavaScript: reverse a string\nfunction reverse(s) {\n",
    "SELECT name, COUNT(*) FROM orders\n",
    "#include <stdio.h>\n\nint main(void) {\n",
    "class Stack:\n    def __init__(self):\n",
]


def long_prompts() -> list[str]:
    """Four prompts of about 500-1100 tokens from the bench's own corpus (refserve's text,
    loaded from its file so this script needs no refserve installation)."""
    spec = importlib.util.spec_from_file_location("corpus", ROOT / "refserve/bench/corpus.py")
    corpus = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(corpus)
    paras = corpus.PARAGRAPHS
    out = []
    for i, n in enumerate((6, 9, 12, 16)):
        body = "\n\n".join(paras[(i + j) % len(paras)] for j in range(n))
        out.append(f"{body}\n\nQuestion: {corpus.QUESTIONS[i % len(corpus.QUESTIONS)]}\n"
                   "Answer:")
    return out


def chat_messages(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def logprob_rows(rows) -> list[dict] | None:
    """vLLM's per-position {token_id: Logprob} dicts as [{str(id): logprob}] (JSON keys are
    strings); None positions (the first prompt token) stay None."""
    if rows is None:
        return None
    return [None if r is None else {str(t): float(lp.logprob) for t, lp in r.items()}
            for r in rows]


def completion(out, with_logprobs: bool, with_prompt_logprobs: bool) -> dict:
    c = out.outputs[0]
    rec = {"prompt_token_ids": list(out.prompt_token_ids), "token_ids": list(c.token_ids),
           "text": c.text, "finish_reason": c.finish_reason,
           "stop_reason": c.stop_reason}
    if with_logprobs:
        rec["logprobs"] = logprob_rows(c.logprobs)
    if with_prompt_logprobs:
        rec["prompt_logprobs"] = logprob_rows(out.prompt_logprobs)
    return rec


def sampling_cases(tokenizer) -> list[dict]:
    """The deterministic SamplingParams fields, each on prompts where it changes the greedy
    output. `params` are the SamplingParams keywords (JSON-able), the same in both engines."""
    paris = tokenizer.encode(" Paris", add_special_tokens=False)
    digits = [tokenizer.encode(str(d), add_special_tokens=False)[0] for d in range(10)]
    space = tokenizer.encode(" ", add_special_tokens=False)
    return [
        {"name": "stop_string", "prompt": RAW[1],
         "params": {"stop": ["."]}},
        {"name": "stop_string_included", "prompt": RAW[1],
         "params": {"stop": ["."], "include_stop_str_in_output": True}},
        {"name": "stop_two_strings", "prompt": RAW[7],
         "params": {"stop": [" is", "\n"]}},
        {"name": "stop_token_ids", "prompt": CODE[0],
         "params": {"stop_token_ids": tokenizer.encode("\n", add_special_tokens=False)}},
        {"name": "repetition_penalty", "prompt": RAW[2],
         "params": {"repetition_penalty": 1.3}},
        {"name": "presence_penalty", "prompt": RAW[4],
         "params": {"presence_penalty": 1.5}},
        {"name": "frequency_penalty", "prompt": RAW[4],
         "params": {"frequency_penalty": 1.0}},
        {"name": "all_penalties", "prompt": CODE[1],
         "params": {"repetition_penalty": 1.1, "presence_penalty": 0.5,
                    "frequency_penalty": 0.5}},
        {"name": "logit_bias_ban", "prompt": RAW[0],
         "params": {"logit_bias": {str(paris[0]): -100.0}}},
        {"name": "logit_bias_force", "prompt": RAW[3],
         "params": {"logit_bias": {str(digits[7]): 8.0}}},
        {"name": "bad_words", "prompt": RAW[0],
         "params": {"bad_words": ["Paris", " Paris"]}},
        {"name": "allowed_token_ids", "prompt": "The answer, in digits, is",
         "params": {"allowed_token_ids": digits + space}},
        {"name": "min_tokens", "prompt": "chat:Say only the word yes.",
         "params": {"min_tokens": 12}},
        {"name": "ignore_eos", "prompt": "chat:Say only the word yes.",
         "params": {"ignore_eos": True}},
        {"name": "max_tokens_1", "prompt": RAW[5], "params": {"max_tokens": 1}},
        {"name": "skip_special_tokens_false", "prompt": "chat:Say only the word no.",
         "params": {"skip_special_tokens": False}},
    ]


def build_prompts(tokenizer) -> list[dict]:
    cases = [{"kind": "raw", "prompt": p} for p in RAW]
    cases += [{"kind": "chat", "messages": chat_messages(p)} for p in CHAT]
    cases += [{"kind": "long", "prompt": p} for p in long_prompts()]
    cases += [{"kind": "multilingual", "prompt": p} for p in MULTILINGUAL]
    cases += [{"kind": "code", "prompt": p} for p in CODE]
    return cases


def render(llm, case: dict) -> str:
    """A case's prompt text: chat cases through the model's chat template (vLLM's own
    rendering, as `LLM.chat` does it; the token ids are recorded and compared too)."""
    if "messages" in case:
        tok = llm.get_tokenizer()
        return tok.apply_chat_template(case["messages"], tokenize=False,
                                       add_generation_prompt=True)
    return case["prompt"]


def record_edges(llm, SamplingParams) -> dict:
    """What vLLM does with the three requests refserve's API settles on its own."""
    edges = {}
    prompt = RAW[0]

    def attempt(name, fn):
        try:
            edges[name] = {"accepted": True, "result": fn()}
        except Exception as e:  # noqa: BLE001 - vLLM's answer, whatever its type
            edges[name] = {"accepted": False, "error_type": type(e).__name__,
                           "error": str(e).splitlines()[0][:300]}

    attempt("sampling_params_truncate_prompt_tokens",
            lambda: str(SamplingParams(truncate_prompt_tokens=3)))
    attempt("logprobs_minus_1", lambda: len(llm.generate(
        [prompt], SamplingParams(max_tokens=2, temperature=0, logprobs=-1),
        use_tqdm=False)[0].outputs[0].logprobs[0]))
    attempt("greedy_n_2", lambda: str(SamplingParams(n=2, temperature=0.0)))
    attempt("tokenization_kwargs_truncate_prompt_tokens_3", lambda: list(llm.generate(
        [prompt], SamplingParams(max_tokens=1, temperature=0),
        tokenization_kwargs={"truncate_prompt_tokens": 3}, use_tqdm=False)[0]
        .prompt_token_ids))
    return edges


def metrics_shape(llm) -> list[dict]:
    from vllm.v1.metrics.reader import Counter, Gauge, Histogram, Vector

    kinds = {Counter: "counter", Gauge: "gauge", Histogram: "histogram", Vector: "vector"}
    return sorted(({"name": m.name, "type": kinds[type(m)], "labels": sorted(m.labels),
                    "finished_reason": m.labels.get("finished_reason")}
                   for m in llm.get_metrics()),
                  key=lambda m: (m["name"], m["finished_reason"] or ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--model", type=Path, default=MODEL)
    ap.add_argument("--check-with", metavar="PYTHON",
                    help="then run tests/test_vllm_parity.py with this python (refserve's)")
    args = ap.parse_args()
    if not (args.model / "model.safetensors").exists():
        print(f"error: no model at {args.model}: run refserve once (python -m refserve."
              "generate 'hi') so it converts the embedded SmolLM2 there", file=sys.stderr)
        return 2
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the model needs little

    import torch
    import vllm
    from vllm import LLM, SamplingParams

    settings = {"model": "SmolLM2-135M-Instruct (refserve's embedded copy)",
                "dtype": "float32", "seed": 0, "max_model_len": MAX_MODEL_LEN,
                "max_tokens": MAX_TOKENS, "logprobs": TOP, "temperature": 0.0,
                "disable_log_stats": False}
    llm = LLM(model=str(args.model), dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN,
              disable_log_stats=False)
    tokenizer = llm.get_tokenizer()
    greedy = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)

    prompts = build_prompts(tokenizer)
    texts = [render(llm, c) for c in prompts]
    outs = llm.generate(texts, greedy)
    for case, text, out in zip(prompts, texts, outs):
        case["prompt_text"] = text
        case.update(completion(out, True, False))

    # prompt_logprobs on a few: one raw, one chat, one multilingual, one code
    chosen = [0, 8, 20, 26]
    plp = SamplingParams(temperature=0.0, max_tokens=4, logprobs=TOP, prompt_logprobs=TOP)
    outs = llm.generate([texts[i] for i in chosen], plp)
    prompt_logprob_cases = [{"index": i, "prompt_text": texts[i], **completion(o, True, True)}
                            for i, o in zip(chosen, outs)]

    fields = sampling_cases(tokenizer)
    field_texts = [render(llm, {"messages": chat_messages(c["prompt"][5:])})
                   if c["prompt"].startswith("chat:") else c["prompt"] for c in fields]
    field_params = []
    for c in fields:
        kw = dict(c["params"])
        if "logit_bias" in kw:
            kw["logit_bias"] = {int(k): v for k, v in kw["logit_bias"].items()}
        kw.setdefault("max_tokens", MAX_TOKENS)
        field_params.append(SamplingParams(temperature=0.0, **kw))
    outs = llm.generate(field_texts, field_params)
    for c, text, out in zip(fields, field_texts, outs):
        c["prompt_text"] = text
        c.update(completion(out, False, False))

    edges = record_edges(llm, SamplingParams)
    metrics = metrics_shape(llm)
    del llm

    # n-gram speculation: a second engine; greedy output must equal the one without it
    spec_config = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2,
                   "prompt_lookup_max": 4}
    spec_prompts = [RAW[1], CODE[5], long_prompts()[0],
                    "Repeat exactly: the red fox, the red fox, the red fox,"]
    spec = {"speculative_config": spec_config, "cases": []}
    try:
        llm = LLM(model=str(args.model), dtype="float32", seed=0, max_model_len=MAX_MODEL_LEN,
                  speculative_config=spec_config)
        outs = llm.generate(spec_prompts, SamplingParams(temperature=0.0,
                                                         max_tokens=MAX_TOKENS))
        spec["cases"] = [{"prompt_text": p, **completion(o, False, False)}
                         for p, o in zip(spec_prompts, outs)]
        del llm
    except Exception as e:  # noqa: BLE001 - a CPU build without it: recorded, not fatal
        spec["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:300]}"

    result = {
        "about": "Recorded from the real vLLM by scripts/record_vllm_parity.py; compared "
                 "with refserve by tests/test_vllm_parity.py.",
        "vllm_version": vllm.__version__, "torch_version": torch.__version__,
        "recorded_on": datetime.date.today().isoformat(),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores, python "
                   f"{platform.python_version()}",
        "settings": settings,
        "greedy": prompts, "prompt_logprobs": prompt_logprob_cases,
        "sampling_fields": fields, "speculation": spec, "edges": edges,
        "get_metrics": metrics,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    print(f"recorded {len(prompts)} greedy prompts, {len(prompt_logprob_cases)} with "
          f"prompt_logprobs, {len(fields)} sampling-field cases, {len(spec['cases'])} "
          f"speculative: {args.out}")
    if args.check_with:
        env = {**os.environ, "REFSERVE_VLLM_PARITY": str(args.out)}
        return subprocess.call([args.check_with, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                "tests/test_vllm_parity.py"], cwd=ROOT, env=env)
    return 0


if __name__ == "__main__":
    sys.exit(main())
