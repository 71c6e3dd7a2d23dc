"""Prompts in every form vLLM's `LLM.generate` and `LLMEngine.add_request` take.

    "text"                                   one text prompt
    {"prompt": "text"}                       vLLM's TextPrompt
    {"prompt_token_ids": [1, 2, 3]}          vLLM's TokensPrompt
    [1, 2, 3], (1, 2, 3), np.array([1, 2])   one prompt of token ids (any flat integer sequence)
    a list / tuple of any of those, or a 2-D integer NumPy array: a batch

`parse_prompt` turns one prompt into its text or its token ids; `parse_prompts` a batch into
a list of those. Anything else is a TypeError naming the accepted forms.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypedDict

import numpy as np


class TextPrompt(TypedDict):
    """vLLM's TextPrompt: {"prompt": "text"}."""

    prompt: str


class TokensPrompt(TypedDict):
    """vLLM's TokensPrompt: {"prompt_token_ids": [ids]}."""

    prompt_token_ids: list[int]

PROMPT_FORMS = ("a string, a list of strings, a sequence of token ids (list, tuple or NumPy "
                "array), {'prompt': str}, {'prompt_token_ids': [...]}, or a list of these")

def _is_token_ids(x) -> bool:
    """A flat sequence of integers (list, tuple, 1-D NumPy integer array)."""
    if isinstance(x, np.ndarray):
        return x.ndim == 1 and np.issubdtype(x.dtype, np.integer) and x.size > 0
    return (isinstance(x, (list, tuple)) and len(x) > 0
            and all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) for t in x))


def parse_prompt(prompt) -> str | list[int]:
    """One prompt in any of vLLM's single-prompt forms -> its text, or its token ids."""
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, dict):
        keys = set(prompt)
        if keys == {"prompt"} and isinstance(prompt["prompt"], str):
            return prompt["prompt"]
        if keys == {"prompt_token_ids"} and _is_token_ids(prompt["prompt_token_ids"]):
            return [int(t) for t in prompt["prompt_token_ids"]]
        raise TypeError(f"prompt dict with keys {sorted(keys)}: expected {{'prompt': str}} or "
                        "{'prompt_token_ids': [int, ...]} (no other keys: refserve is "
                        "text-only)")
    if _is_token_ids(prompt):
        return [int(t) for t in prompt]
    raise TypeError(f"prompt of type {type(prompt).__name__}: accepted forms are {PROMPT_FORMS}")


def parse_prompts(prompts) -> list[str | list[int]]:
    """vLLM's prompt forms -> a list of single prompts (text or token ids).

    A string, a dict or a flat sequence of ints is ONE prompt; any other sequence (a list,
    a tuple, a 2-D NumPy array) is a batch of prompts. Raises TypeError naming the forms.
    """
    if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
        return [parse_prompt(prompts)]
    if isinstance(prompts, np.ndarray) and prompts.ndim == 2:
        return [parse_prompt(row) for row in prompts]
    if isinstance(prompts, Sequence) and not isinstance(prompts, (bytes, bytearray)):
        if not len(prompts):
            raise ValueError("prompts is empty; give at least one prompt")
        batch = []
        for i, p in enumerate(prompts):
            try:
                batch.append(parse_prompt(p))
            except TypeError as e:
                raise TypeError(f"prompt {i}: {e}") from None
        return batch
    raise TypeError(f"prompts of type {type(prompts).__name__}: accepted forms are "
                    f"{PROMPT_FORMS}")
