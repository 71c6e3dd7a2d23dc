"""A model folder's tokenizer read straight through `tokenizers`, with the methods refserve calls.

WHY. transformers' AutoTokenizer imports much of transformers, and torch where it is
installed, before it reads a file: 2 s on an idle 2-core machine and about 10 s on a busy
one, most of a warm start. The `tokenizers` library, which transformers' fast tokenizers
wrap, reads the same tokenizer.json in 0.2 s. So a folder whose tokenizer is a plain fast
one (tokenizer.json, a class below in FAST_CLASSES, no clean-up of spaces) is read here,
and any other through AutoTokenizer (models/loader.py, `load_tokenizer`).

WHAT IT ANSWERS, as transformers' fast tokenizer does for these folders (the same Rust
tokenizer underneath; tests/test_loader_tokenizer.py compares every method on the embedded
model and a tiny test model):

    encode(text, add_special_tokens)      token ids (the post-processor adds special tokens)
    decode(ids, skip_special_tokens)      text
    convert_ids_to_tokens, get_vocab, len, added_tokens_decoder, eos/bos/pad/unk tokens
    apply_chat_template(conversation, tokenize, add_generation_prompt,
                        continue_final_message, chat_template)

The chat template is rendered as transformers renders it: jinja2's sandboxed environment
with trim_blocks and lstrip_blocks, loop controls, `tojson` (non-ASCII kept),
`raise_exception`, `strftime_now`, the special tokens as variables; continuing the final
message cuts the text right after it.

`LLM.get_tokenizer()` still returns transformers' own tokenizer (vLLM's returns one, and
code written for vLLM may call any of its methods); it is loaded on first call.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from pathlib import Path

from tokenizers import Tokenizer

# tokenizer_config.json classes whose tokenizer is tokenizer.json as it is
FAST_CLASSES = {None, "PreTrainedTokenizerFast", "TokenizersBackend", "GPT2Tokenizer",
                "GPT2TokenizerFast", "Qwen2Tokenizer", "Qwen2TokenizerFast"}
SPECIAL = ("bos_token", "eos_token", "unk_token", "pad_token")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "   # marks the end of the message continued


def fast_tokenizer_config(folder: Path) -> dict | None:
    """tokenizer_config.json of `folder` ({} without one) when its tokenizer can be read
    here (module docstring), else None."""
    if not (folder / "tokenizer.json").is_file():
        return None
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if config.get("tokenizer_class") not in FAST_CLASSES or \
            config.get("clean_up_tokenization_spaces"):
        return None
    return config


def _content(token) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    return token.get("content") if isinstance(token, dict) else token


class FastTokenizer:
    """The tokenizer of a model folder (module docstring); `config` from
    `fast_tokenizer_config`."""

    def __init__(self, folder: Path, config: dict) -> None:
        self.name_or_path = str(folder)
        self._tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        template = config.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        self.chat_template = template
        for name in SPECIAL:
            setattr(self, name, _content(config.get(name)))
        self.added_tokens_decoder = {
            int(i): t.content for i, t in self._tokenizer.get_added_tokens_decoder().items()}
        self._compiled = {}
        # decode(ids, skip_special_tokens=False) is tokenizers' own, bound here rather than
        # wrapped in a method: the engine decodes at every step (IncrementalDetokenizer), and
        # with no Python frame between the two a step runs no line of this file.
        self.decode = functools.partial(self._tokenizer.decode, skip_special_tokens=False)

    # ------------------------------------------------------------------ tokens

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def convert_ids_to_tokens(self, ids):
        if isinstance(ids, int):
            return self._tokenizer.id_to_token(ids)
        return [self._tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def get_vocab(self) -> dict[str, int]:
        return self._tokenizer.get_vocab(with_added_tokens=True)

    def __len__(self) -> int:
        return self._tokenizer.get_vocab_size(with_added_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        return None if self.eos_token is None else self._tokenizer.token_to_id(self.eos_token)

    @property
    def bos_token_id(self) -> int | None:
        return None if self.bos_token is None else self._tokenizer.token_to_id(self.bos_token)

    @property
    def pad_token_id(self) -> int | None:
        return None if self.pad_token is None else self._tokenizer.token_to_id(self.pad_token)

    def __repr__(self) -> str:
        return f"FastTokenizer({self.name_or_path!r}, vocab {len(self)})"

    # ------------------------------------------------------------------ chat

    def apply_chat_template(self, conversation, chat_template: str | None = None,
                            tokenize: bool = True, add_generation_prompt: bool = False,
                            continue_final_message: bool = False, **kwargs):
        """The conversation (a list of {"role", "content"} dicts) rendered with the chat
        template (module docstring); token ids when `tokenize`. Continuing the final
        message ends the text with that message's content, no end-of-turn after it."""
        template = chat_template or self.chat_template
        if template is None:
            raise ValueError(f"{self.name_or_path} has no chat template")
        messages = [dict(m) for m in conversation]
        if continue_final_message:
            if not messages or not isinstance(messages[-1].get("content"), str):
                raise ValueError("continue_final_message needs a final message with text")
            messages[-1]["content"] += _CONTINUE_TAG
        special = {name: getattr(self, name) for name in SPECIAL}
        text = self._template(template).render(
            messages=messages, tools=None, documents=None,
            add_generation_prompt=add_generation_prompt, **special, **kwargs)
        if continue_final_message:
            tag = text.rfind(_CONTINUE_TAG.strip())
            if tag < 0:
                raise ValueError("continue_final_message: the chat template dropped the "
                                 "final message")
            # The tag's space survives where the template keeps spacing; else it trimmed
            # the message, and the text before the tag is trimmed too.
            keeps = text[tag:tag + len(_CONTINUE_TAG)] == _CONTINUE_TAG
            text = text[:tag] if keeps else text[:tag].rstrip()
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self, source: str):
        if source not in self._compiled:
            import jinja2.ext
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._compiled[source] = env.from_string(source)
        return self._compiled[source]


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message):
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)
