"""The request lengths of vLLM's benchmark datasets: one description of a workload for the
simulator (`python -m refserve.simulate --workload random ...`) and for a load test of a
real server (`python -m refserve.bench loadtest --workload random ...`).

Only lengths: (prompt tokens, output tokens) per request, drawn from a numpy Generator. The
caller makes the token ids (the simulator draws ids; the load test sends them as a
token-id prompt) and the arrival times. Three sources:

    random     vLLM's random dataset: prompt lengths uniform on the integers of
               [floor(I (1 - r)), ceil(I (1 + r))], outputs likewise around O
               (`--input-len I --output-len O --range-ratio r`, 0 <= r < 1; r = 0: every
               request exactly I and O tokens)
    sharegpt   a built-in ShareGPT-like distribution (no download): lognormal prompt and
               output lengths, clipped as vLLM's ShareGPT sampler filters them (prompt in
               [4, 1024], output >= 4, prompt + output <= 2048). The means are the
               published ones, the spread an assumption (SHAREGPT below)
    a file     `--dataset-path FILE` on disk: a ShareGPT-format JSON (a list of
               {"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}]}:
               the first human turn is the prompt, the reply after it the output; vLLM's
               filter applied), or a vLLM benchmark result JSON (`--save-result`, whose
               "input_lens" and "output_lens" are the lengths it sent)

A ShareGPT file holds text, so its lengths need a tokenizer: `count_tokens(text) -> int`
(e.g. a Hugging Face tokenizer's); without one a token is taken as 4 characters (the usual
rule of thumb for English text; say so when you quote the result).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

DATASETS = ("random", "sharegpt")

# vLLM's ShareGPT sampler keeps a conversation when 4 <= prompt <= 1024, output >= 4 and
# prompt + output <= 2048 tokens.
SHAREGPT_MIN, SHAREGPT_MAX_PROMPT, SHAREGPT_MAX_TOTAL = 4, 1024, 2048
CHARS_PER_TOKEN = 4


@dataclass(frozen=True)
class LogNormalLengths:
    """Lengths exp(N(mu, sigma^2)) rounded, clipped to [low, high]; `mean` is the mean
    after clipping that `mu` was solved for (`solve_mu`)."""

    mean: float
    sigma: float
    low: int
    high: int

    @property
    def mu(self) -> float:
        return solve_mu(self.mean, self.sigma, self.low, self.high)

    def draw(self, rng: np.random.Generator, n: int) -> np.ndarray:
        return np.clip(np.round(rng.lognormal(self.mu, self.sigma, n)), self.low,
                       self.high).astype(int)


# The built-in ShareGPT-like lengths. Means from published runs on ShareGPT V3 with the
# Llama 3 tokenizer: 215 prompt tokens per request (vLLM's benchmark_serving, 1000
# prompts: 215,196 input tokens; github.com/vllm-project/vllm/issues/7567) and 194 output
# tokens (SGLang's benchmark_vllm_060 README: 4,132 output tok/s at 21.27 req/s over 5000
# prompts). sigma = 1.0 (lengths from a few tokens to the filter's limits) is assumed.
SHAREGPT = (LogNormalLengths(215.0, 1.0, SHAREGPT_MIN, SHAREGPT_MAX_PROMPT),
            LogNormalLengths(194.0, 1.0, SHAREGPT_MIN, SHAREGPT_MAX_TOTAL - SHAREGPT_MIN))


def clipped_lognormal_mean(mu: float, sigma: float, low: float, high: float) -> float:
    """E[clip(exp(X), low, high)], X ~ N(mu, sigma^2), from the lognormal's partial
    expectations (Phi the standard normal CDF):

        low P(Y < low) + high P(Y > high)
        + exp(mu + sigma^2 / 2) [Phi((ln high - mu - sigma^2) / sigma)
                                 - Phi((ln low - mu - sigma^2) / sigma)]"""
    def phi(x: float) -> float:
        return 0.5 * (1 + math.erf(x / math.sqrt(2)))

    a, b = math.log(low), math.log(high)
    inside = math.exp(mu + sigma**2 / 2) * (phi((b - mu - sigma**2) / sigma)
                                            - phi((a - mu - sigma**2) / sigma))
    return low * phi((a - mu) / sigma) + high * (1 - phi((b - mu) / sigma)) + inside


def solve_mu(mean: float, sigma: float, low: float, high: float) -> float:
    """The mu whose clipped lognormal has this mean (bisection: the mean rises with mu)."""
    if not low < mean < high:
        raise ValueError(f"a mean of {mean} cannot be reached inside [{low}, {high}]")
    lo, hi = math.log(low) - 10 * sigma, math.log(high) + 10 * sigma
    for _ in range(100):
        mid = (lo + hi) / 2
        if clipped_lognormal_mean(mid, sigma, low, high) < mean:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def random_lengths(rng: np.random.Generator, n: int, input_len: int, output_len: int,
                   range_ratio: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """vLLM's random dataset (module docstring): n (prompt, output) lengths."""
    for name, value in (("input_len", input_len), ("output_len", output_len)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r}: must be an integer >= 1")
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"range_ratio={range_ratio!r}: must be in [0, 1)")

    def around(length: int) -> np.ndarray:
        low = max(1, math.floor(length * (1 - range_ratio)))
        high = max(low, math.ceil(length * (1 + range_ratio)))
        return rng.integers(low, high + 1, n)

    return around(input_len), around(output_len)


# The flags (argparse dests) that describe the random dataset, with their defaults.
RANDOM_FLAGS = {"input_len": 1024, "output_len": 128, "range_ratio": 0.0}


def add_random_arguments(group) -> None:
    """vLLM's random-dataset flags on an argparse parser or group. Each defaults to None, so
    that a flag given implies the random workload (`resolve_workload`); RANDOM_FLAGS holds
    the values they take when not given."""
    group.add_argument("--input-len", "--random-input-len", type=int, default=None,
                       help="random workload: prompt tokens per request (default "
                       f"{RANDOM_FLAGS['input_len']})")
    group.add_argument("--output-len", "--random-output-len", type=int, default=None,
                       help="random workload: output tokens per request (default "
                       f"{RANDOM_FLAGS['output_len']})")
    group.add_argument("--range-ratio", "--random-range-ratio", type=float, default=None,
                       help="random workload: lengths uniform in [len (1 - r), len (1 + r)] "
                       f"(default {RANDOM_FLAGS['range_ratio']:g})")


def resolve_workload(chosen: str | None, default: str, given: dict,
                     flags_of: dict[str, tuple[str, ...]]) -> str:
    """The workload a command line asks for; no flag is silently ignored.

    chosen    --workload as given (None: not given)
    default   the command's workload when nothing asks for another
    given     {flag: value} of the workload flags the user gave
    flags_of  {workload: its flags}, e.g. {"random": ("input_len", ...)}

    A flag of a workload implies it when --workload is not given, as vLLM's throughput
    benchmark takes --input-len to mean its random dataset. A flag of another workload
    than the chosen or implied one raises ValueError (it would change nothing)."""
    implied = sorted({w for w, flags in flags_of.items() if any(f in given for f in flags)})
    if chosen is None and len(implied) > 1:
        raise ValueError(f"{_flags(given, flags_of, implied)} describe different workloads "
                         f"({', '.join(implied)}); give the flags of one")
    workload = chosen if chosen is not None else (implied[0] if implied else default)
    for other, flags in flags_of.items():
        stray = [f for f in flags if f in given]
        if other != workload and stray:
            verb = "describes" if len(stray) == 1 else "describe"
            raise ValueError(f"{_flags(given, {other: tuple(stray)}, [other])} {verb} the "
                             f"{other} workload, not {workload}: drop "
                             f"{'them' if len(stray) > 1 else 'it'} or choose "
                             f"--workload {other}")
    return workload


def _flags(given: dict, flags_of: dict, workloads: list[str]) -> str:
    names = [f for w in workloads for f in flags_of[w] if f in given]
    return " and ".join("--" + f.replace("_", "-") for f in names)


def sharegpt_lengths(rng: np.random.Generator, n: int) -> tuple[np.ndarray, np.ndarray]:
    """The built-in ShareGPT-like lengths (SHAREGPT); prompt + output <= 2048."""
    prompt_spec, output_spec = SHAREGPT
    prompts = prompt_spec.draw(rng, n)
    outputs = np.minimum(output_spec.draw(rng, n), SHAREGPT_MAX_TOTAL - prompts)
    return prompts, outputs


def file_lengths(path: Path, rng: np.random.Generator, n: int,
                 count_tokens=None) -> tuple[np.ndarray, np.ndarray]:
    """n (prompt, output) lengths from a ShareGPT JSON or a vLLM result JSON (module
    docstring), shuffled by `rng`; the file's requests are reused in the same order when
    it holds fewer than n."""
    pairs = read_length_file(Path(path), count_tokens)
    order = rng.permutation(len(pairs))
    picked = [pairs[order[i % len(pairs)]] for i in range(n)]
    return (np.array([p for p, _ in picked], dtype=int),
            np.array([o for _, o in picked], dtype=int))


def read_length_file(path: Path, count_tokens=None) -> list[tuple[int, int]]:
    """Every usable (prompt, output) length pair of the file, in its order."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise ValueError(f"cannot read dataset {path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"dataset {path}: not JSON ({e})") from None
    if isinstance(data, dict) and "input_lens" in data and "output_lens" in data:
        if count_tokens is not None:
            raise ValueError(f"dataset {path} is a vLLM result: it holds token counts, so a "
                             "tokenizer would change nothing; drop --tokenizer")
        ins, outs = data["input_lens"], data["output_lens"]
        if not (isinstance(ins, list) and isinstance(outs, list) and len(ins) == len(outs)
                and all(_positive_int(x) for x in ins + outs) and ins):
            raise ValueError(f"dataset {path}: a vLLM result's input_lens and output_lens "
                             "must be equally long lists of integers >= 1")
        return list(zip(ins, outs))
    if not isinstance(data, list):
        raise ValueError(f"dataset {path}: expected a ShareGPT list of conversations or a "
                         "vLLM benchmark result (a JSON object with input_lens and "
                         "output_lens)")
    count = count_tokens or (lambda text: max(1, math.ceil(len(text) / CHARS_PER_TOKEN)))
    pairs = []
    for entry in data:
        turns = entry.get("conversations") if isinstance(entry, dict) else None
        if not isinstance(turns, list) or len(turns) < 2:
            continue
        if not all(isinstance(t, dict) and isinstance(t.get("value"), str)
                   for t in turns[:2]):
            continue
        prompt, output = count(turns[0]["value"]), count(turns[1]["value"])
        if (prompt < SHAREGPT_MIN or output < SHAREGPT_MIN or prompt > SHAREGPT_MAX_PROMPT
                or prompt + output > SHAREGPT_MAX_TOTAL):
            continue  # vLLM's filter
        pairs.append((prompt, output))
    if not pairs:
        raise ValueError(f"dataset {path}: no conversation with a prompt and a reply within "
                         f"vLLM's ShareGPT limits (prompt {SHAREGPT_MIN}..{SHAREGPT_MAX_PROMPT}"
                         f" tokens, prompt + output <= {SHAREGPT_MAX_TOTAL})")
    return pairs


def _positive_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 1
