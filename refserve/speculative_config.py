"""`SpeculativeConfig`: the `speculative_config={...}` dict of `LLM(...)`, with vLLM's names.

    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_min": 2, "prompt_lookup_max": 4}                  # prompt lookup
    {"method": "draft_model", "num_speculative_tokens": 4,
     "model": "/path/to/small-llama"}                                  # a smaller model
    {"method": "draft_model", "num_speculative_tokens": 4,
     "model": "self", "num_draft_layers": 8}                           # the target's first
                                                                       # 8 layers (refserve)

| key | meaning |
| --- | --- |
| method | "ngram" (prompt lookup) or "draft_model" |
| num_speculative_tokens | k, the most draft tokens proposed per verify step (>= 1) |
| prompt_lookup_min / _max | n-gram only: suffix lengths searched, longest first |
| model | draft_model only: an HF folder with the target's vocabulary, or "self" |
| num_draft_layers | model "self" only: how many leading layers of the target the draft runs |
| adaptive | (refserve) True: a request whose acceptance is too low stops speculating |

Every mistake is a ValueError naming the key and what to write instead.
"""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("ngram", "draft_model")
DEFAULT_PROMPT_LOOKUP_MIN = 2
DEFAULT_PROMPT_LOOKUP_MAX = 4
_KEYS = ("method", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
         "model", "num_draft_layers", "adaptive")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = DEFAULT_PROMPT_LOOKUP_MIN
    prompt_lookup_max: int = DEFAULT_PROMPT_LOOKUP_MAX
    model: str | None = None
    num_draft_layers: int | None = None
    adaptive: bool = True

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @property
    def is_self_draft(self) -> bool:
        return self.method == "draft_model" and self.model == "self"

    @classmethod
    def from_dict(cls, raw) -> SpeculativeConfig:
        """Validate a user's dict (or pass a SpeculativeConfig through)."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        where = "speculative_config"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a dict such as {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {type(raw).__name__}")
        unknown = sorted(set(raw) - set(_KEYS))
        if unknown:
            raise ValueError(f"{where}: unknown key(s) {unknown}; known keys: "
                             f"{', '.join(_KEYS)}")
        method = raw.get("method")
        if method not in METHODS:
            raise ValueError(f"{where}.method={method!r}: choose one of {', '.join(METHODS)}")
        k = raw.get("num_speculative_tokens")
        if not _is_int(k) or k < 1:
            raise ValueError(f"{where}.num_speculative_tokens={k!r}: must be an integer >= 1 "
                             "(the number of draft tokens per verify step)")
        for key, (needs_method, needs_self, what) in _ONLY_FOR.items():
            if raw.get(key) is None:
                continue
            if method != needs_method or (needs_self and raw.get("model") != "self"):
                raise ValueError(f"{where}.{key} applies only to {what}")
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"{where}.adaptive={adaptive!r}: must be true or false")
        if method == "ngram":
            lo = raw.get("prompt_lookup_min")
            hi = raw.get("prompt_lookup_max")
            if lo is None and hi is None:
                lo, hi = DEFAULT_PROMPT_LOOKUP_MIN, DEFAULT_PROMPT_LOOKUP_MAX
            elif lo is None:
                lo = min(DEFAULT_PROMPT_LOOKUP_MIN, hi) if _is_int(hi) else hi
            elif hi is None:
                hi = max(DEFAULT_PROMPT_LOOKUP_MAX, lo) if _is_int(lo) else lo
            if not _is_int(lo) or lo < 1:
                raise ValueError(f"{where}.prompt_lookup_min={lo!r}: must be an integer >= 1")
            if not _is_int(hi) or hi < lo:
                raise ValueError(f"{where}.prompt_lookup_max={hi!r}: must be an integer >= "
                                 f"prompt_lookup_min={lo}")
            return cls(method, k, prompt_lookup_min=lo, prompt_lookup_max=hi,
                       adaptive=adaptive)
        model = raw.get("model")
        if not isinstance(model, str) or not model:
            raise ValueError(f"{where}.model is required for method 'draft_model': an HF "
                             "folder with the target's vocabulary, or \"self\" for the "
                             "target's first num_draft_layers layers")
        layers = raw.get("num_draft_layers")
        if model == "self":
            if not _is_int(layers) or layers < 1:
                raise ValueError(f"{where}.num_draft_layers={layers!r}: model \"self\" needs "
                                 "an integer >= 1 (the draft runs the target's first N "
                                 "layers)")
        return cls(method, k, model=model, num_draft_layers=layers, adaptive=adaptive)


# key -> (the method it belongs to, whether it needs model "self", how to say so)
_ONLY_FOR = {
    "prompt_lookup_min": ("ngram", False, "method 'ngram'"),
    "prompt_lookup_max": ("ngram", False, "method 'ngram'"),
    "model": ("draft_model", False, "method 'draft_model'"),
    "num_draft_layers": ("draft_model", True, "method 'draft_model' with model \"self\""),
}
