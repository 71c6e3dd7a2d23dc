"""`python -m refserve`: the command-line entry points, each with its own --help."""

import sys

ENTRY_POINTS = (
    ("python -m refserve.generate", "generate text for prompts (streams one; --file for many)"),
    ("python -m refserve.serve", "OpenAI-compatible HTTP server (completions, chat, SSE)"),
    ("python -m refserve.bench", "benchmarks: batching, paged KV, prefix cache, chunking, ..."),
    ("python -m refserve.capacity", "KV-cache capacity math for a model, memory and context"),
    ("python -m refserve.simulate", "one serving configuration at GPU scale, simulated"),
    ("python -m refserve.plan", "search configurations under SLOs; prints the vllm serve line"),
    ("python -m refserve.course", "the course: student copy and grading report"),
    ("python -m refserve.tour", "one engine step traced: the files and lines a student reads"),
    ("python -m refserve.war_stories", "the course's war stories, one command each"),
    ("python -m refserve.selfcheck", "the one GPU check: kernel tests, then the numbers"),
)


def main() -> int:
    print("refserve: a readable reference implementation of LLM inference serving.\n"
          "Python API (vLLM's names): from refserve import LLM, SamplingParams\n\n"
          "Entry points (each takes --help):")
    width = max(len(cmd) for cmd, _ in ENTRY_POINTS)
    for cmd, what in ENTRY_POINTS:
        print(f"  {cmd:<{width}}  {what}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
