"""Where `python -m refserve.generate` gets its requests: arguments, a file, or stdin.

    --file prompts.txt    one prompt per non-blank line
    --file requests.jsonl one JSON object per line: {"prompt": "..."} or
                          {"prompt_token_ids": [...]}, plus any SamplingParams field for that
                          request ({"prompt": "Hi", "max_tokens": 8, "temperature": 0.7});
                          logit_bias keys are token ids as JSON strings ({"13": -100})
    --file -              the same, read from stdin
    (piped stdin)         the whole of stdin is ONE prompt (it may span lines)

A file is JSONL when its name ends in .jsonl, or when every non-blank line is a JSON
object; a plain-text prompt that merely starts with "{" (not valid JSON) is still plain
text. A file that mixes the two (some lines JSON objects, others not) is refused with the
line numbers of each kind: read as plain text, the JSON lines would become literal prompts
and their SamplingParams would be silently ignored.

Prompts are checked here, before any model loads: an empty prompt is refused at once.
Every problem is a `PromptFileError` (a ValueError) naming the file, the line and the fix.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass, field

from refserve.sampling_params import SamplingParams

SAMPLING_KEYS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


class PromptFileError(ValueError):
    """A prompt source the user gave cannot be read; the message says where and why."""


@dataclass
class PromptSpec:
    """One request from the command line: its prompt and its own SamplingParams fields."""

    prompt: str | list[int]
    overrides: dict = field(default_factory=dict)


def read_text(path: str) -> str:
    """The file's text (or stdin's for "-"), as UTF-8; PromptFileError if it is not."""
    try:
        data = sys.stdin.buffer.read() if path == "-" else open(path, "rb").read()
    except FileNotFoundError:
        raise PromptFileError(f"--file {path}: no such file") from None
    except IsADirectoryError:
        raise PromptFileError(f"--file {path}: is a folder; give a file") from None
    except OSError as e:
        raise PromptFileError(f"--file {path}: cannot read it ({e.strerror})") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise PromptFileError(
            f"--file {path}: not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            "save it as UTF-8") from None


def _json_object(line: str):
    try:
        value = json.loads(line)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _line_list(numbers: list[int], most: int = 5) -> str:
    shown = ", ".join(map(str, numbers[:most]))
    return shown + (f" and {len(numbers) - most} more" if len(numbers) > most else "")


def is_jsonl(path: str, numbered: list[tuple[int, str]]) -> bool:
    """JSONL by name (.jsonl), or because every non-blank line is a JSON object; plain text
    when none is. A mix raises PromptFileError with the line numbers of both kinds."""
    if path.endswith(".jsonl"):
        return True
    json_lines = [i for i, ln in numbered if _json_object(ln) is not None]
    if not json_lines:
        return False
    if len(json_lines) == len(numbered):
        return True
    text_lines = [i for i, ln in numbered if _json_object(ln) is None]
    raise PromptFileError(
        f"--file {path}: mixes JSON and plain text: line(s) {_line_list(json_lines)} are JSON "
        f"objects, line(s) {_line_list(text_lines)} are not; write every line as "
        '{"prompt": "..."} (JSONL), or every line as plain text')


def parse_jsonl_line(path: str, number: int, line: str) -> PromptSpec:
    obj = _json_object(line)
    where = f"--file {path} line {number}"
    if obj is None:
        raise PromptFileError(f"{where}: not a JSON object ({line[:40]!r})")
    has_text, has_ids = "prompt" in obj, "prompt_token_ids" in obj
    if has_text == has_ids:
        raise PromptFileError(f"{where}: give exactly one of 'prompt' (a string) or "
                              "'prompt_token_ids' (a list of integers)")
    prompt = obj.pop("prompt") if has_text else obj.pop("prompt_token_ids")
    if has_text and not isinstance(prompt, str):
        raise PromptFileError(f"{where}: 'prompt' must be a string")
    if has_text and not prompt:
        raise PromptFileError(f"{where}: 'prompt' is empty")
    if has_ids and not (isinstance(prompt, list) and prompt and all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt)):
        raise PromptFileError(f"{where}: 'prompt_token_ids' must be a non-empty list of "
                              "integers")
    unknown = sorted(set(obj) - SAMPLING_KEYS)
    if unknown:
        raise PromptFileError(f"{where}: unknown key(s) {unknown}; a line holds 'prompt' or "
                              f"'prompt_token_ids' plus SamplingParams fields: "
                              f"{', '.join(sorted(SAMPLING_KEYS))}")
    bias = obj.get("logit_bias")
    if isinstance(bias, dict):
        # JSON object keys are strings: {"13": -100} means token 13, as in OpenAI's API.
        bad = [k for k in bias if not (isinstance(k, str) and k.strip().isdecimal())]
        if bad:
            raise PromptFileError(f"{where}: 'logit_bias' keys must be token ids, e.g. "
                                  f'{{"13": -100}}; got {bad[0]!r}')
        obj["logit_bias"] = {int(k): v for k, v in bias.items()}
    return PromptSpec(prompt, obj)


def read_prompt_file(path: str) -> list[PromptSpec]:
    """The requests of a prompt file (see the module docstring); "-" reads stdin."""
    text = read_text(path)
    numbered = [(i, ln) for i, ln in enumerate(text.splitlines(), 1) if ln.strip()]
    if not numbered:
        raise PromptFileError(f"--file {path}: no prompts in it")
    if is_jsonl(path, numbered):
        return [parse_jsonl_line(path, i, ln) for i, ln in numbered]
    return [PromptSpec(ln) for _, ln in numbered]


def read_prompts(prompts: list[str], file: str | None, stdin=None) -> list[PromptSpec]:
    """Prompt arguments, or --file, or piped stdin as one prompt; exactly one source."""
    if prompts and file is not None:
        raise PromptFileError("give prompts as arguments or with --file, not both")
    if prompts:
        empty = [i for i, p in enumerate(prompts, 1) if not p]
        if empty:
            raise PromptFileError(f"prompt argument {_line_list(empty)} is empty; give some "
                                  "text (a model needs at least one prompt token)")
        return [PromptSpec(p) for p in prompts]
    if file is not None:
        return read_prompt_file(file)
    stdin = sys.stdin if stdin is None else stdin
    if stdin is not None and not stdin.isatty():
        text = read_text("-").strip()
        if text:
            return [PromptSpec(text)]
    raise PromptFileError("no prompt given: pass a prompt, --file FILE (--file - reads one "
                          "prompt per line from stdin), or pipe one prompt on stdin")
