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
| method | the proposer: "ngram" (prompt lookup) or "draft_model" (spec_decode/registry.py) |
| num_speculative_tokens | k, the most draft tokens proposed per verify step (>= 1) |
| adaptive | (refserve) True: a request whose acceptance is too low stops speculating |
| any other key | an option of the method, kept in `options` and checked by its proposer |

The keys every method shares are checked here, when the EngineConfig is made; the method and
its options are checked by spec_decode/registry.py (`resolve`) when an engine or a simulation
is built, before anything is loaded. Every mistake is a ValueError naming the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    adaptive: bool = True
    options: dict = field(default_factory=dict)  # the method's own keys

    @property
    def k(self) -> int:
        return self.num_speculative_tokens

    @classmethod
    def from_dict(cls, raw) -> SpeculativeConfig:
        """Check a user's dict (or pass a SpeculativeConfig through)."""
        if isinstance(raw, SpeculativeConfig):
            return raw
        where = "speculative_config"
        if not isinstance(raw, dict):
            raise ValueError(f"{where} must be a dict such as {{\"method\": \"ngram\", "
                             f"\"num_speculative_tokens\": 4}}, got {type(raw).__name__}")
        method = raw.get("method")
        if not isinstance(method, str) or not method:
            raise ValueError(f"{where}.method={method!r}: name the proposer, e.g. \"ngram\" "
                             "or \"draft_model\"")
        k = raw.get("num_speculative_tokens")
        if not _is_int(k) or k < 1:
            raise ValueError(f"{where}.num_speculative_tokens={k!r}: must be an integer >= 1 "
                             "(the number of draft tokens per verify step)")
        adaptive = raw.get("adaptive", True)
        if not isinstance(adaptive, bool):
            raise ValueError(f"{where}.adaptive={adaptive!r}: must be true or false")
        options = {key: value for key, value in raw.items()
                   if key not in ("method", "num_speculative_tokens", "adaptive")
                   and value is not None}
        return cls(method, k, adaptive, options)
