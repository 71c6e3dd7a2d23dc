"""Incremental detokenization: turn a growing list of output token ids into text in O(new
tokens) per step, instead of decoding the whole output again every step (O(L²) per request).

A token is not always a whole character: byte-level BPE splits an emoji or a CJK character
across several tokens, and a lone piece decodes to the replacement character U+FFFD. And
some tokenizers decide a token's leading space from its left neighbour. So each step decodes
a short window that starts a few tokens back (`prefix_offset`):

    prefix = decode(ids[prefix_offset:read_offset])   text already emitted for this window
    full   = decode(ids[prefix_offset:])              the same window plus the new tokens
    if full is longer and does not end in U+FFFD:  emit full[len(prefix):], slide the window

Tokens whose text is still incomplete stay unread until a later token completes them.

vLLM's three text options (SamplingParams):
  skip_special_tokens (True)   special tokens (EOS, chat markers) decode to nothing; False:
                               to their text ("<|im_end|>")
  spaces_between_special_tokens (True)  with skip_special_tokens=False, whether two ADJACENT
                               special (added) tokens may be separated the way the
                               tokenizer's own decode separates them (some decoders, e.g.
                               WordPiece, put a space between any two tokens). False: the
                               second one's text follows the first with no space (vLLM's
                               fast-tokenizer rule). A byte-level BPE tokenizer (SmolLM2's)
                               puts no space there, so both give the same text for it.
  detokenize (True)            False: the engine gives the sequence no detokenizer at all.
Special tokens never count toward "there is new text": a window that adds only skipped
special tokens emits nothing.

The stop rules (refserve/scheduler/stop_rules.py) call `update` after every appended token,
so `text` grows token by token and a stop string is found at the token that completes it.
"""

from __future__ import annotations

# How many already-emitted tokens the window keeps on its left: enough context for the
# tokenizer to place spaces the way a full decode would.
_CONTEXT_TOKENS = 5


class IncrementalDetokenizer:
    """The text of one sequence's output tokens, grown a few tokens at a time.

    Invariant: `text` == decode(ids[:read_offset]) for the tokenizers refserve loads
    (tested against a full decode), and `update` only ever appends to it.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.spaces_between_special_tokens = spaces_between_special_tokens
        # Added-token ids (chat markers, EOS...), read only for the no-spaces rule.
        self._added: frozenset[int] = frozenset()
        if not skip_special_tokens and not spaces_between_special_tokens:
            self._added = frozenset(getattr(tokenizer, "added_tokens_decoder", {}) or {})
        self.text = ""
        self.prefix_offset = 0  # first token of the decode window
        self.read_offset = 0  # tokens before this one are in `text`

    def copy(self) -> IncrementalDetokenizer:
        """An independent detokenizer in the same state (a forked child's text)."""
        other = IncrementalDetokenizer(self.tokenizer, self.skip_special_tokens,
                                       self.spaces_between_special_tokens)
        other.text, other.prefix_offset, other.read_offset = (
            self.text, self.prefix_offset, self.read_offset)
        return other

    def decode(self, token_ids: list[int]) -> str:
        """The text of `token_ids` under this detokenizer's options. No-spaces rule: the ids
        are cut between every two adjacent added tokens, each piece decoded alone and the
        pieces joined with nothing, so no separator can appear between those two."""
        decode = self.tokenizer.decode
        skip = self.skip_special_tokens
        if not self._added:
            return decode(token_ids, skip_special_tokens=skip)
        pieces, start = [], 0
        for i in range(1, len(token_ids)):
            if token_ids[i] in self._added and token_ids[i - 1] in self._added:
                pieces.append(decode(token_ids[start:i], skip_special_tokens=skip))
                start = i
        pieces.append(decode(token_ids[start:], skip_special_tokens=skip))
        return "".join(pieces)

    def update(self, token_ids: list[int]) -> str:
        """Bring `text` up to date with `token_ids` (the whole output so far, of which only
        the tail after `read_offset` is new); returns the newly emitted text."""
        if self.tokenizer is None or len(token_ids) <= self.read_offset:
            return ""
        prefix = self.decode(token_ids[self.prefix_offset:self.read_offset])
        full = self.decode(token_ids[self.prefix_offset:])
        if len(full) <= len(prefix) or full.endswith("\ufffd"):
            return ""  # an incomplete character (or only special tokens): wait
        delta = full[len(prefix):]
        self.text += delta
        self.read_offset = len(token_ids)
        self.prefix_offset = max(0, self.read_offset - _CONTEXT_TOKENS)
        return delta
