"""OpenAI's request and response shapes, mapped one to one onto refserve's `SamplingParams`.

    request field          SamplingParams      notes
    max_tokens             max_tokens          chat also takes max_completion_tokens;
                                               default 16 (completions) or what the context
                                               has left (chat), as OpenAI and vLLM do
    temperature            temperature         default 1.0; 0 = greedy
    top_p, n, seed, stop   same names          stop: a string or a list of strings
    top_k, ignore_eos,     same names          extras (vLLM accepts them too)
    stop_token_ids, min_p, min_tokens,
    presence_penalty, frequency_penalty,
    repetition_penalty, include_stop_str_in_output,
    skip_special_tokens, spaces_between_special_tokens,
    allowed_token_ids, bad_words,
    truncate_prompt_tokens                     the prompt's last k tokens (k >= 1, or -1:
                                               the last max_model_len), before every
                                               length check
    priority               (add_request's)     vLLM's: lower runs first; only with
                                               --scheduling-policy priority
    logit_bias             logit_bias          OpenAI's {"token id": bias}: keys are token
                                               ids written as strings, biases clamped to
                                               [-100, 100] as OpenAI and vLLM do
    logprobs (completions) logprobs            the top N per token, N <= max_logprobs
    logprobs + top_logprobs logprobs           chat: logprobs true, top_logprobs N
      (chat)
    echo (completions)     prompt_logprobs     the prompt is sent back before the text
                                               (with its logprobs when logprobs is set)
    stream_options                             {include_usage, continuous_usage_stats};
                                               include_usage defaults to true once the
                                               object is given, as in vLLM

Every check raises `APIError` naming the offending field (`param`), which the server
returns as OpenAI's error body with HTTP 400:

    {"error": {"message": "...", "type": "invalid_request_error", "param": "top_p",
               "code": null}}

Not over HTTP: `detokenize` (a response is text) and logprobs = -1 (the whole vocabulary:
offline only, as vLLM's server caps logprobs at --max-logprobs). Fields OpenAI defines
that refserve does not implement (best_of, suffix, tools, ...) are refused with 400 when
set to anything but their neutral value, never silently ignored. Text that no tokenizer
can read (a lone surrogate such as "\ud800", which JSON can spell) is refused with 400
naming its field. Response shapes are in responses.py.
"""

from __future__ import annotations

import dataclasses
import math
import uuid
from dataclasses import dataclass, field

from refserve.sampling import SamplingParams
from refserve.sampling_params import MAX_LOGPROBS


class APIError(Exception):
    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = (
            message, param, status, type, code)
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None,
               code: str | int | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


# Optional SamplingParams fields passed through when the request sets them; SamplingParams
# checks their ranges and its error names the field.
EXTRA_FIELDS = {"min_p": ((int, float), "a number"), "min_tokens": ((int,), "an integer"),
                "presence_penalty": ((int, float), "a number"),
                "frequency_penalty": ((int, float), "a number"),
                "repetition_penalty": ((int, float), "a number"),
                "include_stop_str_in_output": ((bool,), "true or false"),
                "skip_special_tokens": ((bool,), "true or false"),
                "spaces_between_special_tokens": ((bool,), "true or false"),
                "truncate_prompt_tokens": ((int,), "an integer >= 1, or -1")}
LOGIT_BIAS_LIMIT = 100.0      # OpenAI's range for one bias; vLLM clamps to it too

# Unsupported OpenAI fields and the value that means "off".
UNSUPPORTED_NEUTRAL = {"best_of": (None, 1), "suffix": (None, ""), "tools": (None, []),
                       "response_format": (None, {"type": "text"})}


@dataclass
class GenerationRequest:
    """One parsed request: what to generate and how. `prompts` holds strings or token-id
    lists (completions may batch several prompts; chat has exactly one)."""
    kind: str                          # "completion" | "chat"
    model: str | None
    prompts: list[str | list[int]]
    sampling: dict                     # SamplingParams fields except max_tokens
    max_tokens: int | None             # None: the default, resolved once the prompt is known
    stream: bool = False
    include_usage: bool = False
    messages: list[dict] = field(default_factory=list)
    continuous_usage: bool = False     # stream_options.continuous_usage_stats
    logprobs: int | None = None        # top N per token, None: no logprobs
    echo: bool = False                 # completions: the prompt comes back first
    priority: int = 0                  # vLLM's: lower runs first (scheduling_policy)

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except ValueError as e:
            # SamplingParams names the field as "SamplingParams.<name>=<value>: why".
            text = str(e)
            name = text.split("=", 1)[0].removeprefix("SamplingParams.") if "=" in text else None
            raise APIError(text, name) from e


def _get(body: dict, name: str, kinds: tuple[type, ...], what: str, default=None):
    """body[name] if present and of one of `kinds` (bool is never an int or a number)."""
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in kinds:
        raise APIError(f"'{name}' must be {what}, got {value!r}", name)
    if not isinstance(value, kinds):
        raise APIError(f"'{name}' must be {what}, got {type(value).__name__} {value!r}", name)
    if isinstance(value, float) and not math.isfinite(value):
        raise APIError(f"'{name}' must be a finite number, got {value!r}", name)
    return value


def _text(value: str, name: str) -> str:
    """`value` if a tokenizer can read it: JSON may spell a lone surrogate ("\ud800"), which
    is no character at all and makes the tokenizer raise."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:
        raise APIError(f"'{name}' holds {value[e.start]!r} at position {e.start}, a lone "
                       "surrogate: not text (send it as UTF-8)", name.split("[")[0]) from None
    return value


def _common(body: dict, kind: str, max_tokens_names: tuple[str, ...],
            max_logprobs: int) -> GenerationRequest:
    """The fields completions and chat share; the caller fills in its prompt."""
    if not isinstance(body, dict):
        raise APIError("the request body must be a JSON object")
    for name, neutral in UNSUPPORTED_NEUTRAL.items():
        if name in body and body[name] not in neutral:
            raise APIError(f"'{name}' is not supported by refserve; leave it out", name)
    model = _get(body, "model", (str,), "a string")
    max_tokens = None
    for name in max_tokens_names:
        value = _get(body, name, (int,), "an integer >= 1")
        if value is not None:
            if value < 1:
                raise APIError(f"'{name}' must be an integer >= 1, got {value}", name)
            max_tokens = value
    n = _get(body, "n", (int,), "an integer >= 1", 1)
    if n < 1:
        raise APIError(f"'n' must be an integer >= 1, got {n}", "n")
    temperature = float(_get(body, "temperature", (int, float), "a number >= 0", 1.0))
    if temperature < 0:
        raise APIError(f"'temperature' must be >= 0 (0 = greedy), got {temperature}",
                       "temperature")
    top_p = float(_get(body, "top_p", (int, float), "a number in (0, 1]", 1.0))
    if not 0.0 < top_p <= 1.0:
        raise APIError(f"'top_p' must be in (0, 1], got {top_p}", "top_p")
    top_k = _get(body, "top_k", (int,), "-1 (off) or an integer >= 1", -1)
    top_k = -1 if top_k == 0 else top_k          # vLLM reads 0 as "off" too
    if top_k < -1:
        raise APIError(f"'top_k' must be -1 (off) or an integer >= 1, got {top_k}", "top_k")
    seed = _get(body, "seed", (int,), "a non-negative integer")
    if seed is not None and not 0 <= seed < 2**64:
        raise APIError(f"'seed' must be an integer in 0..2**64-1, got {seed}", "seed")
    stop = body.get("stop")
    if isinstance(stop, str):
        stop = [stop]
    if stop is not None and (not isinstance(stop, list)
                             or any(not isinstance(s, str) or not s for s in stop)):
        raise APIError("'stop' must be a non-empty string or a list of non-empty strings",
                       "stop")
    for s in stop or []:
        _text(s, "stop")
    stop_token_ids = body.get("stop_token_ids") or []
    if (not isinstance(stop_token_ids, list)
            or any(isinstance(t, bool) or not isinstance(t, int) or t < 0
                   for t in stop_token_ids)):
        raise APIError("'stop_token_ids' must be a list of non-negative integers",
                       "stop_token_ids")
    ignore_eos = _get(body, "ignore_eos", (bool,), "true or false", False)
    stream = _get(body, "stream", (bool,), "true or false", False)
    options = body.get("stream_options")
    include_usage = continuous = False
    if options is not None:
        if not isinstance(options, dict):
            raise APIError("'stream_options' must be an object", "stream_options")
        if not stream:
            raise APIError("'stream_options' is only allowed with 'stream': true",
                           "stream_options")
        # vLLM's StreamOptions: include_usage defaults to true once the object is given.
        include_usage = _get(options, "include_usage", (bool,), "true or false", True)
        continuous = _get(options, "continuous_usage_stats", (bool,), "true or false", False)
    sampling = dict(n=n, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                    stop=stop or [], stop_token_ids=stop_token_ids, ignore_eos=ignore_eos)
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    for name, (kinds, what) in EXTRA_FIELDS.items():
        value = _get(body, name, kinds, what)
        if value is not None:
            if name not in known:
                raise APIError(f"'{name}' is not supported by this refserve version", name)
            sampling[name] = value
    _token_constraints(body, sampling)
    req = GenerationRequest(kind, model, [], sampling, max_tokens, stream, include_usage,
                            continuous_usage=continuous)
    req.logprobs = _logprobs(body, kind, max_logprobs)
    if req.logprobs is not None:
        sampling["logprobs"] = req.logprobs
    # vLLM's extra: lower runs first; the engine refuses it unless scheduling_policy is
    # "priority" (a 400 naming the field).
    req.priority = _get(body, "priority", (int,), "an integer (lower runs first)", 0)
    return req


def _token_constraints(body: dict, sampling: dict) -> None:
    """logit_bias (OpenAI's), allowed_token_ids and bad_words (vLLM's) into `sampling`;
    the token ids are checked against the vocabulary when the engine takes the request."""
    bias = body.get("logit_bias")
    if bias is not None:
        what = ("'logit_bias' must be an object mapping token ids (as strings, e.g. "
                "\"50256\") to numbers in -100..100")
        if not isinstance(bias, dict):
            raise APIError(what, "logit_bias")
        parsed = {}
        for key, value in bias.items():
            token = key.strip() if isinstance(key, str) else ""
            if not token.isdecimal() or isinstance(value, bool) or not isinstance(
                    value, (int, float)) or not math.isfinite(value):
                raise APIError(f"{what}; got {key!r}: {value!r}", "logit_bias")
            parsed[int(token)] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
        if parsed:
            sampling["logit_bias"] = parsed
    allowed = body.get("allowed_token_ids")
    if allowed is not None:
        if (not isinstance(allowed, list) or not allowed
                or any(not _is_token_id(t) or t < 0 for t in allowed)):
            raise APIError("'allowed_token_ids' must be a non-empty list of non-negative "
                           "integers", "allowed_token_ids")
        sampling["allowed_token_ids"] = allowed
    words = body.get("bad_words")
    if words is not None:
        if not isinstance(words, list) or any(not isinstance(w, str) or not w.strip()
                                              for w in words):
            raise APIError("'bad_words' must be a list of non-blank strings", "bad_words")
        sampling["bad_words"] = [_text(w, "bad_words") for w in words]


def _logprobs(body: dict, kind: str, max_logprobs: int) -> int | None:
    """How many top tokens per position to report, or None. Completions: `logprobs` is
    that number. Chat: `logprobs` is true or false and `top_logprobs` the number."""
    cap = f"an integer in 0..{max_logprobs} (the server's --max-logprobs)"
    name = "top_logprobs" if kind == "chat" else "logprobs"
    if kind == "chat":
        wanted = _get(body, "logprobs", (bool,), "true or false", False)
        top = _get(body, "top_logprobs", (int,), cap)
        if top is not None and not wanted:
            raise APIError("'top_logprobs' needs 'logprobs': true", "top_logprobs")
        if not wanted:
            return None
        top = 0 if top is None else top
    else:
        top = _get(body, "logprobs", (int,), cap)
        if top is None:
            return None
    if not 0 <= top <= max_logprobs:
        raise APIError(f"'{name}' must be {cap}, got {top}", name)
    return top


def parse_completion_request(body: dict, max_logprobs: int = MAX_LOGPROBS
                             ) -> GenerationRequest:
    req = _common(body, "completion", ("max_tokens",), max_logprobs)
    prompt = body.get("prompt")
    what = ("'prompt' must be a non-empty string, a list of strings, a list of token ids or "
            "a list of token-id lists")
    if isinstance(prompt, str):
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        prompts = [list(prompt)]
    elif isinstance(prompt, list) and prompt and all(
            isinstance(p, str) or (isinstance(p, list) and all(_is_token_id(t) for t in p))
            for p in prompt):
        prompts = list(prompt)
    else:
        raise APIError(what, "prompt")
    if any(len(p) == 0 for p in prompts):
        raise APIError(what + "; got an empty prompt", "prompt")
    for p in prompts:
        if isinstance(p, str):
            _text(p, "prompt")
    req.prompts = prompts
    req.echo = _get(body, "echo", (bool,), "true or false", False)
    if req.echo and req.logprobs is not None:
        req.sampling["prompt_logprobs"] = req.logprobs   # the prompt's own logprobs too
    return req


def parse_chat_request(body: dict, max_logprobs: int = MAX_LOGPROBS) -> GenerationRequest:
    req = _common(body, "chat", ("max_tokens", "max_completion_tokens"), max_logprobs)
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError("'messages' must be a non-empty list of {role, content} objects",
                       "messages")
    clean = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or m["role"] not in (
                "system", "user", "assistant", "developer"):
            raise APIError(f"'{where}' must be an object whose role is system, developer, "
                           "user or assistant", "messages")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": "..."}]
            if not all(isinstance(p, dict) and p.get("type") == "text"
                       and isinstance(p.get("text"), str) for p in content):
                raise APIError(f"'{where}.content' parts must be text parts; refserve reads "
                               "text only", "messages")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise APIError(f"'{where}.content' must be a string", "messages")
        role = "system" if m["role"] == "developer" else m["role"]
        clean.append({"role": role, "content": _text(content, f"messages[{i}].content")})
    req.messages = clean
    return req


def _is_token_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def new_id(kind: str) -> str:
    return ("chatcmpl-" if kind == "chat" else "cmpl-") + uuid.uuid4().hex
