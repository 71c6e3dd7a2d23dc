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

import json
import sys
from pathlib import Path

from refserve.entrypoints.cli_common import (
    EXIT_USAGE,
    ArgumentParser,
    CLIError,
    check_output_path,
    write_trace,
)
from refserve.entrypoints.engine_args import add_engine_args, engine_config_from_args
from refserve.prompt_files import PromptFileError, read_prompts
from refserve.sampling import SamplingParams

EXIT_INTERRUPTED = 130
# The command line asks for more tokens than the API: SamplingParams' default (16, vLLM's,
# after OpenAI's completions API) cuts a one-sentence answer in the middle.
CLI_MAX_TOKENS = 128


def build_parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="python -m refserve.generate",
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
    io.add_argument("--trace", type=Path, metavar="PATH", help="write the run's timeline as "
                    "Chrome trace-event JSON (open it in https://ui.perfetto.dev): a track "
                    "per request, one for the engine's steps")

    add_engine_args(p)

    s = p.add_argument_group("sampling: vLLM's SamplingParams names (per request in JSONL)")
    s.add_argument("--max-tokens", type=int, default=CLI_MAX_TOKENS,
                   help=f"output tokens per request (default: {CLI_MAX_TOKENS} here; the "
                   f"Python API's SamplingParams default is {SamplingParams().max_tokens}, as "
                   "in vLLM, which cuts a one-sentence answer short)")
    s.add_argument("--min-tokens", type=int, default=0, help="no EOS / stop before this many")
    s.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    s.add_argument("--top-p", type=float, default=1.0, help="nucleus: the smallest set of "
                   "tokens whose probability reaches top_p; 1 = off")
    s.add_argument("--top-k", type=int, default=0, help="the k most likely tokens; 0 or -1: off")
    s.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p times "
                   "the top probability; 0 = off")
    s.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="divide (or multiply, if negative) logits of tokens already seen; 1 = off")
    s.add_argument("--presence-penalty", type=float, default=0.0,
                   help="subtract from the logit of every token already output; 0 = off")
    s.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="subtract per occurrence in the output so far; 0 = off")
    s.add_argument("--n", type=int, default=1, help="samples per prompt (copy-on-write)")
    s.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    s.add_argument("--include-stop-str-in-output", action="store_true",
                   help="keep the stop string at the end of the text")
    s.add_argument("--ignore-eos", action="store_true", help="go on past the EOS token")
    s.add_argument("--logprobs", type=int, default=None, help="top-N logprobs per token "
                   "(in --json; -1: the whole vocabulary)")
    return p


SAMPLING_FLAGS = ("n", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p",
                  "repetition_penalty", "presence_penalty", "frequency_penalty", "stop",
                  "include_stop_str_in_output", "ignore_eos", "logprobs")


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
    for flag in ("json", "trace"):
        if getattr(args, flag) is not None:
            check_output_path(getattr(args, flag), f"--{flag}")
    prompts, params = build_requests(args)
    try:
        config = engine_config_from_args(args)
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

    trace = None
    if args.trace is not None:
        from refserve.simulator.trace import EngineTrace

        trace = EngineTrace()
        trace.attach(llm)
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
        write_trace(trace, args.trace)
        print(f"interrupted (Ctrl-C): {len(done)} of {len(prompts)} requests finished",
              file=sys.stderr)
        return EXIT_INTERRUPTED
    if stream:
        print()
    report(args, list(enumerate(outputs)), llm.last_summary, streamed=stream)
    write_trace(trace, args.trace)
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
