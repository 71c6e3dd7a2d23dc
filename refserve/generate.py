"""`python -m refserve.generate`: serve prompts with the engine from the command line.

    python -m refserve.generate "The capital of France is"            # streams the answer
    python -m refserve.generate --chat "What is the capital of France?"
    python -m refserve.generate --file prompts.txt --json out.json    # many, with a summary
    echo "Once upon a time" | python -m refserve.generate            # stdin: one prompt
    python -m refserve.generate --file requests.jsonl   # {"prompt": ..., "max_tokens": 8}
    python -m refserve.generate --speculative-config '{"method": "ngram", \
        "num_speculative_tokens": 4}' "Repeat this: ..."     # summary shows the acceptance

Prompts come from the arguments, from --file (one per line, or JSONL: see
refserve/prompt_files.py) or from standard input. With one prompt the text streams as it is
generated; with many a progress bar runs and the outputs print at the end. Every run ends
with a summary line: requests, tokens/s, TTFT and TPOT p50/p99, KV blocks at peak,
prefix-cache hit rate, preemptions.

A user's mistake (a bad flag or file, a model folder that cannot be loaded, no GPU for
--backend cupy, a pool too small, ...) ends in one `error: ...` line and exit status 2,
never a traceback; Ctrl-C prints the outputs finished so far and the summary, exit 130.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from refserve.capacity import parse_memory
from refserve.config import BACKENDS, BATCHING, DTYPES, KV_CACHE_LAYOUTS, EngineConfig
from refserve.prompt_files import PromptFileError, read_prompts
from refserve.sampling import SamplingParams

EXIT_USAGE, EXIT_INTERRUPTED = 2, 130


class CLIError(Exception):
    """A user's mistake: printed as one `error: ...` line, exit status 2."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one `error: ...` line (the usage is in --help)."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {message} (see {self.prog} --help)\n")


class DeprecatedAlias(argparse.Action):
    """An old flag spelling: stores into the new flag's dest and says so."""

    def __call__(self, parser, namespace, values, option_string=None):
        new = "--" + self.dest.replace("_", "-")
        print(f"warning: {option_string} is deprecated; use {new} (vLLM's name)",
              file=sys.stderr)
        setattr(namespace, self.dest, values)


def _memory(text: str) -> int:
    try:
        return parse_memory(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="python -m refserve.generate",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Generate text with refserve (continuous batching over a paged KV cache). "
        "Option groups say which names are vLLM's (same flag, same meaning) and which are "
        "refserve's own.")
    io = p.add_argument_group("input and output (refserve's own)")
    io.add_argument("prompts", nargs="*", help="prompt(s); none: --file, or one prompt piped "
                    "on stdin")
    io.add_argument("--file", metavar="FILE", help="one prompt per line, or JSONL: "
                    "{\"prompt\": ...} or {\"prompt_token_ids\": [...]} plus SamplingParams "
                    "keys per line; '-' reads stdin")
    io.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat "
                    "template as a user message")
    io.add_argument("--json", type=Path, metavar="PATH", help="write every output and metric "
                    "(the folder is checked before generating)")
    io.add_argument("--quiet", action="store_true", help="print only the generated text")

    e = p.add_argument_group("engine: vLLM's names and meanings")
    e.add_argument("--model", default=None, help="HF-format folder (default: the embedded "
                   "SmolLM2-135M-Instruct, fetched and converted on first use)")
    e.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="weights and KV cache; auto: float32 on NumPy")
    e.add_argument("--seed", type=int, default=0, help="engine-level seed: requests without "
                   "their own seed draw from it")
    e.add_argument("--block-size", type=int, default=16)
    e.add_argument("--num-gpu-blocks-override", type=int, default=None,
                   help="force the KV pool size in blocks")
    e.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="share of the device's TOTAL memory for weights + activations + KV")
    e.add_argument("--max-model-len", type=int, default=None,
                   help="longest prompt + output (default: the model's)")
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    e.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction,
                   default=True)
    e.add_argument("--enforce-eager", action="store_true", help="never capture CUDA graphs")
    e.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding, vLLM\'s JSON: \'{"method": "ngram", '
                   '"num_speculative_tokens": 4}\' or \'{"method": "draft_model", '
                   '"num_speculative_tokens": 4, "model": "self", "num_draft_layers": 8}\'')

    r = p.add_argument_group("engine: refserve's own")
    r.add_argument("--backend", default="auto", choices=BACKENDS)
    r.add_argument("--kv-cache-memory-bytes", type=_memory, default=2 * 1024**3,
                   help="host memory for the KV pool on the NumPy backend, e.g. 2GiB")
    r.add_argument("--batching", default="continuous", choices=BATCHING)
    r.add_argument("--kv-cache-layout", default="paged", choices=KV_CACHE_LAYOUTS)
    r.add_argument("--num-gpu-blocks", dest="num_gpu_blocks_override", type=int,
                   action=DeprecatedAlias, help="deprecated: --num-gpu-blocks-override")
    r.add_argument("--kv-cache-memory", dest="kv_cache_memory_bytes", type=_memory,
                   action=DeprecatedAlias, help="deprecated: --kv-cache-memory-bytes")

    s = p.add_argument_group("sampling: vLLM's SamplingParams names (per request in JSONL)")
    s.add_argument("--max-tokens", type=int, default=128)
    s.add_argument("--min-tokens", type=int, default=0, help="no EOS / stop before this many")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0)
    s.add_argument("--top-k", type=int, default=0, help="0 or -1: off")
    s.add_argument("--min-p", type=float, default=0.0)
    s.add_argument("--repetition-penalty", type=float, default=1.0)
    s.add_argument("--presence-penalty", type=float, default=0.0)
    s.add_argument("--frequency-penalty", type=float, default=0.0)
    s.add_argument("--n", type=int, default=1, help="samples per prompt (copy-on-write)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--include-stop-str-in-output", action="store_true")
    s.add_argument("--ignore-eos", action="store_true")
    s.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token "
                   "(in --json)")
    return p


SAMPLING_FLAGS = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                  "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                  "include_stop_str_in_output", "ignore_eos", "logprobs")
ENGINE_FLAGS = ("model", "backend", "dtype", "seed", "block_size", "num_gpu_blocks_override",
                "gpu_memory_utilization", "kv_cache_memory_bytes", "max_model_len",
                "max_num_seqs", "max_num_batched_tokens", "enable_prefix_caching",
                "enforce_eager", "batching", "kv_cache_layout", "speculative_config")


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from e
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


def check_json_path(path: Path, flag: str = "--json") -> None:
    """An output file (--json, ...) must be writable: checked before the model loads, not
    after the run."""
    if path.is_dir():
        raise CLIError(f"{flag} {path}: is a folder; give a file path")
    folder = path.parent
    if not folder.is_dir():
        raise CLIError(f"{flag} {path}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CLIError(f"{flag} {path}: cannot write there (permission denied)")


def build_requests(args) -> tuple[list, list[SamplingParams]]:
    """The prompts and one SamplingParams each: the sampling flags, overridden per request
    by a JSONL line's own keys."""
    specs = read_prompts(args.prompts, args.file)
    defaults = {name: getattr(args, name) for name in SAMPLING_FLAGS}
    params = []
    for i, spec in enumerate(specs, 1):
        try:
            params.append(SamplingParams(**{**defaults, **spec.overrides}))
        except (TypeError, ValueError) as e:
            raise CLIError(f"--file {args.file} request {i}: {e}" if spec.overrides
                           else str(e)) from None
    if args.chat and any(not isinstance(s.prompt, str) for s in specs):
        raise CLIError("--chat needs text prompts, not prompt_token_ids")
    return [s.prompt for s in specs], params


def output_record(o) -> dict:
    def logprobs(position):
        return None if position is None else {
            str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
            for t, lp in position.items()}

    return {
        "request_id": o.request_id, "prompt": o.prompt, "prompt_token_ids": o.prompt_token_ids,
        "num_cached_tokens": o.num_cached_tokens,
        "prompt_logprobs": (None if o.prompt_logprobs is None
                            else [logprobs(p) for p in o.prompt_logprobs]),
        "outputs": [{"index": c.index, "text": c.text, "token_ids": c.token_ids,
                     "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                     "cumulative_logprob": c.cumulative_logprob,
                     "logprobs": (None if c.logprobs is None
                                  else [logprobs(p) for p in c.logprobs])}
                    for c in o.outputs],
        "metrics": o.metrics.to_dict()}


def report(args, outputs, summary, streamed: bool) -> None:
    """Print the outputs (unless streamed) and the summary; write --json."""
    if not streamed:
        for i, o in outputs:
            for c in o.outputs:
                tag = f"[{i}]" if len(o.outputs) == 1 else f"[{i}.{c.index}]"
                print(f"{tag} {c.text!r}" if not args.quiet else c.text)
    if not args.quiet and summary is not None:
        print(f"summary: {summary.format()}", file=sys.stderr)
    if args.json is not None:
        try:
            args.json.write_text(json.dumps({
                "summary": None if summary is None else summary.to_dict(),
                "outputs": [output_record(o) for _, o in outputs]}, indent=2) + "\n")
        except OSError as e:
            raise CLIError(f"--json {args.json}: cannot write it ({e.strerror})") from None


def run(args) -> int:
    if args.json is not None:
        check_json_path(args.json)
    prompts, params = build_requests(args)
    try:
        config = EngineConfig(**{k: getattr(args, k) for k in ENGINE_FLAGS if hasattr(args, k)})
    except (ValueError, NotImplementedError) as e:
        raise CLIError(str(e)) from None

    from refserve.llm import LLM

    try:
        llm = LLM.from_config(config, progress=not args.quiet)
        if args.chat:
            prompts = [llm.llm_engine.apply_chat_template(p) for p in prompts]
    except (ValueError, OSError, RuntimeError, NotImplementedError) as e:
        # A folder that cannot be loaded, an unsupported model, no GPU for --backend cupy,
        # the default model's first fetch offline, a pool too small, no chat template, ...
        raise CLIError(str(e)) from None

    stream = len(prompts) == 1 and params[0].n == 1
    printed = [0]

    def on_step(out):
        # The engine holds back what a stop string may still remove, so this text only grows.
        text = out.outputs[0].text
        safe = text if out.finished else text.rstrip("\ufffd")  # half a multi-byte char
        if len(safe) > printed[0]:
            sys.stdout.write(safe[printed[0]:])
            sys.stdout.flush()
            printed[0] = len(safe)

    try:
        outputs = llm.generate(prompts, params, use_tqdm=not args.quiet,
                               on_step=on_step if stream else None)
    except ValueError as e:  # a prompt too long for the model or the pool, ...
        raise CLIError(str(e)) from None
    except KeyboardInterrupt:
        done = [(i, o) for i, o in enumerate(llm.partial_outputs) if o is not None]
        if stream:
            print()
        report(args, done, llm.last_summary, streamed=stream)
        print(f"interrupted (Ctrl-C): {len(done)} of {len(prompts)} requests finished",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if stream:
        print()
    report(args, list(enumerate(outputs)), llm.last_summary, streamed=stream)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)  # a bad flag: one `error:` line, exit 2
    try:
        return run(args)
    except (CLIError, PromptFileError) as e:
        print(f"error: {' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("\nerror: interrupted (Ctrl-C) before any output", file=sys.stderr)
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
