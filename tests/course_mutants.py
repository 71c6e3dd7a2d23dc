"""Plausible wrong answers to each exercise: the mistakes a student makes, each written as
an edit of the reference's region body, `(what, old, new)`: every `old` in the body
(indented as if the region's BEGIN line were at column 0) becomes `new`. tests/test_course.py
grades copies holding them and requires each to fail its own exercise's row, with a plain
line, and no other row.

An edit whose `old` is no longer in the body, or a body that then fails with a NameError,
AttributeError, ..., is stale (the reference changed under it), not a caught mistake, and
the test says so.
"""

MUTANTS: dict[str, list[tuple[str, str, str]]] = {
    "blocks_for_tokens": [
        ("float ceil",
         "return -(-num_tokens // block_size)",
         "import math\nreturn math.ceil(num_tokens / block_size)"),
        ("one block too many at an exact multiple",
         "return -(-num_tokens // block_size)",
         "return num_tokens // block_size + 1"),
    ],
    "append_rule": [
        ("no max(0, .): negative when the table holds spare blocks",
         "max(0, blocks_for_tokens(num_tokens, self.block_size) - len(self._ids))",
         "blocks_for_tokens(num_tokens, self.block_size) - len(self._ids)"),
        ("off by one: a new block when the last is exactly full",
         "blocks_for_tokens(num_tokens, self.block_size)",
         "num_tokens // self.block_size + 1"),
    ],
    "allocator_decref": [
        ("decref below zero: no double-release check",
         "if self._ref_counts[block_id] == 0:\n    raise",
         "if False:\n    raise"),
        ("freed blocks join the head of the queue (reused first)",
         "if to_front:\n    self._available.move_to_end",
         "if True:\n    self._available.move_to_end"),
    ],
    "copy_on_write": [
        ("the shared block keeps the writer's reference (a leak)",
         "self.allocator.decref(old_block)",
         "pass"),
        ("the copy goes the wrong way (dst, src)",
         "copies.append((old_block, new_block))",
         "copies.append((new_block, old_block))"),
    ],
    "prefix_cache_lookup": [
        ("a hit may include the block holding the last prompt token",
         "max(0, len(token_ids) - 1) // bs",
         "len(token_ids) // bs"),
        ("keys not chained: a block matches whatever came before it",
         "BlockKey(parent, ",
         "BlockKey(None, "),
    ],
    "paged_attention_gather": [
        ("offset n instead of n % bs",
         "blocks * block_size + positions % block_size",
         "blocks * block_size + positions"),
        ("logical block index used as the physical block",
         "block_table[positions // block_size].astype(np.int64)",
         "positions // block_size"),
    ],
    "runner_prepare": [
        ("context length without the tokens written this step",
         "context_lens.append(s.start + n)",
         "context_lens.append(s.start)"),
        ("positions restart at 0 in every row",
         "range(s.start, s.start + n)",
         "range(n)"),
    ],
    "scheduler_admit": [
        ("skips a sequence that does not fit and admits later ones (not FCFS)",
         "break",
         "continue"),
        ("one seat short: max_num_seqs - 1 running at most",
         "> self.max_num_seqs",
         ">= self.max_num_seqs"),
    ],
    "scheduler_preempt": [
        ("preempts the oldest running sequence",
         "victim = self.running[-1]",
         "victim = self.running[0]"),
        ("always preempts the sequence that needs the blocks",
         "victim = self.running[-1]",
         "victim = seq"),
    ],
    "stop_rules": [
        ("EOS stops even with ignore_eos",
         "token_id == eos_token_id and not params.ignore_eos",
         "token_id == eos_token_id"),
        ("the stop string stays in the output",
         "else at)",
         "else at + len(stop))"),
    ],
    "accept_residual": [
        ("accept iff u*p < q (p and q swapped)",
         "u * q_x.astype(np.float64) < p_x.astype(np.float64)",
         "u * p_x.astype(np.float64) < q_x.astype(np.float64)"),
        ("a rejected position resamples p, not the residual max(0, p - q)",
         "weights[rejected] = residual_weights(p_j, q_j)",
         "weights[rejected] = p_j"),
        ("every passing draft counts, not only the leading run",
         "np.cumprod(passes, axis=1).sum(axis=1)",
         "passes.sum(axis=1)"),
        ("the residual p - q without max(0, .): negative weights",
         "residual_weights(p_j, q_j)",
         "p_j - q_j"),
    ],
    "ngram_proposal": [
        ("the oldest match instead of the most recent",
         "np.flatnonzero(match)[-1]",
         "np.flatnonzero(match)[0]"),
        ("the shortest suffix that matches, not the longest",
         "best_end = int(np.flatnonzero(match)[-1])",
         "best_end = int(np.flatnonzero(match)[-1])\n        break"),
    ],
}


def mutate(body: str, old: str, new: str) -> str:
    """`body` (a region's lines at column 0) with every `old` replaced by `new`. Raises
    ValueError when `old` is not there: the mutant is stale."""
    if old not in body:
        raise ValueError(f"stale mutant: {old!r} is not in the region body")
    return body.replace(old, new)
