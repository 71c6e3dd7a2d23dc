"""Plausible wrong answers to each exercise: the mistakes a student makes, written as region
bodies (indented as if the region's BEGIN line were at column 0; the grader moves them to
the region's depth). tests/test_course.py grades copies holding them and requires each to
fail its own exercise's row, with a plain line, and no other row.

A body uses the names the reference's region uses; one that stops compiling or names
something gone (NameError, AttributeError, ...) is stale, not a caught mistake, and the
test says so.
"""

MUTANTS: dict[str, list[tuple[str, str]]] = {
    "blocks_for_tokens": [
        ("float ceil", """\
import math
return math.ceil(num_tokens / block_size)
"""),
        ("one block too many at an exact multiple", """\
return num_tokens // block_size + 1
"""),
    ],
    "append_rule": [
        ("no max(0, .): negative when the table holds spare blocks", """\
return blocks_for_tokens(num_tokens, self.block_size) - self._len
"""),
        ("off by one: a new block when the last is exactly full", """\
return max(0, num_tokens // self.block_size + 1 - self._len)
"""),
    ],
    "allocator_decref": [
        ("decref below zero: no double-release check", """\
self._ref_counts[block_id] -= 1
if self._ref_counts[block_id] > 0:
    return False
self._available[block_id] = None
if to_front:
    self._available.move_to_end(block_id, last=False)
return True
"""),
        ("freed blocks join the head of the queue (reused first)", """\
if self._ref_counts[block_id] == 0:
    raise ValueError(f"block {block_id} is not held (ref count 0): a double release")
self._ref_counts[block_id] -= 1
if self._ref_counts[block_id] > 0:
    return False
self._available[block_id] = None
self._available.move_to_end(block_id, last=False)
return True
"""),
    ],
    "copy_on_write": [
        ("the shared block keeps the writer's reference (a leak)", """\
new_block = self._take_block()
old_block = table.replace(logical, new_block)
copies.append((old_block, new_block))
"""),
        ("the copy goes the wrong way (dst, src)", """\
new_block = self._take_block()
old_block = table.replace(logical, new_block)
self.allocator.decref(old_block)
copies.append((new_block, old_block))
"""),
    ],
    "prefix_cache_lookup": [
        ("a hit may include the block holding the last prompt token", """\
bs = self.block_size
blocks: list[int] = []
parent: BlockKey | None = None
for i in range(len(token_ids) // bs):
    key = BlockKey(parent, tuple(token_ids[i * bs:(i + 1) * bs]))
    block_id = self._block_of_key.get(key)
    if block_id is None:
        break
    blocks.append(block_id)
    parent = self._key_of_block[block_id]
return blocks
"""),
        ("keys not chained: a block matches whatever came before it", """\
bs = self.block_size
max_hit_blocks = max(0, len(token_ids) - 1) // bs
blocks: list[int] = []
for i in range(max_hit_blocks):
    key = BlockKey(None, tuple(token_ids[i * bs:(i + 1) * bs]))
    block_id = self._block_of_key.get(key)
    if block_id is None:
        break
    blocks.append(block_id)
return blocks
"""),
    ],
    "paged_attention_gather": [
        ("offset n instead of n % bs", """\
block_size = cache.shape[1]
positions = np.arange(num_keys)
blocks = block_table[positions // block_size].astype(np.int64)
slots = blocks * block_size + positions
return cache.reshape(-1, *cache.shape[2:])[slots]
"""),
        ("logical block index used as the physical block", """\
block_size = cache.shape[1]
positions = np.arange(num_keys)
return cache.reshape(-1, *cache.shape[2:])[positions]
"""),
    ],
    "runner_prepare": [
        ("context length without the tokens written this step", """\
input_ids += (s.seq.token_ids[s.start:] + list(s.draft_token_ids))[:s.num_tokens]
positions += range(s.start, s.start + s.num_tokens)
slots += compute_slots(s.block_ids, positions[-s.num_tokens:],
                       self.block_size).tolist()
context_lens.append(s.start)
"""),
        ("positions restart at 0 in every row", """\
input_ids += (s.seq.token_ids[s.start:] + list(s.draft_token_ids))[:s.num_tokens]
positions += range(s.num_tokens)
slots += compute_slots(s.block_ids, positions[-s.num_tokens:],
                       self.block_size).tolist()
context_lens.append(s.start + s.num_tokens)
"""),
    ],
    "scheduler_admit": [
        ("skips a sequence that does not fit and admits later ones (not FCFS)", """\
seats_used = self.num_seats_used
for seq in order:
    if budget <= 0 or seats_used + seq.num_seats > self.max_num_seqs:
        continue
    plan = self._plan_row(seq, budget)
    copies = self._allocate_admitted(seq, plan, out)
    if copies is None:
        continue
    self._add_row(seq, plan, copies, out)
    admitted.append(seq)
    seq.status = SequenceStatus.RUNNING
    self.running.insert(self.policy.running_index(self.running, seq), seq)
    seats_used += seq.num_seats
    out.admitted.append(seq.seq_id)
    budget -= plan.num_tokens
"""),
        ("one seat short: max_num_seqs - 1 running at most", """\
seats_used = self.num_seats_used
for seq in order:
    if budget <= 0 or seats_used + seq.num_seats >= self.max_num_seqs:
        break
    plan = self._plan_row(seq, budget)
    copies = self._allocate_admitted(seq, plan, out)
    if copies is None:
        break
    self._add_row(seq, plan, copies, out)
    admitted.append(seq)
    seq.status = SequenceStatus.RUNNING
    self.running.insert(self.policy.running_index(self.running, seq), seq)
    seats_used += seq.num_seats
    out.admitted.append(seq.seq_id)
    budget -= plan.num_tokens
"""),
    ],
    "scheduler_preempt": [
        ("preempts the oldest running sequence", """\
victim = self.running[0]
if victim is seq and len(self.running) == 1:
    raise RuntimeError(f"sequence {seq.seq_id} alone cannot fit in the KV pool")
self._preempt(victim, out)
if victim is seq:
    return budget
"""),
        ("always preempts the sequence that needs the blocks", """\
victim = seq
if len(self.running) == 1:
    raise RuntimeError(f"sequence {seq.seq_id} alone cannot fit in the KV pool")
self._preempt(victim, out)
return budget
"""),
    ],
    "stop_rules": [
        ("EOS stops even with ignore_eos", """\
if token_id in params.stop_token_ids or token_id == eos_token_id:
    if token_id != eos_token_id:
        seq.stop_reason = token_id
    if detok is not None and not params.include_stop_str_in_output:
        seq.output_text_end = text_before
    return SequenceStatus.FINISHED_STOPPED
if params.stop and detok is not None:
    match = find_stop_string(detok.text, text_before, params.stop)
    if match is not None:
        at, stop = match
        seq.stop_reason = stop
        seq.output_text_end = (at + len(stop) if params.include_stop_str_in_output
                               else at)
        return SequenceStatus.FINISHED_STOPPED
"""),
        ("the stop string stays in the output", """\
if token_id in params.stop_token_ids or (
        token_id == eos_token_id and not params.ignore_eos):
    if token_id != eos_token_id or params.ignore_eos:
        seq.stop_reason = token_id
    if detok is not None and not params.include_stop_str_in_output:
        seq.output_text_end = text_before
    return SequenceStatus.FINISHED_STOPPED
if params.stop and detok is not None:
    match = find_stop_string(detok.text, text_before, params.stop)
    if match is not None:
        at, stop = match
        seq.stop_reason = stop
        seq.output_text_end = at + len(stop)
        return SequenceStatus.FINISHED_STOPPED
"""),
    ],
    "accept_residual": [
        ("accept iff u*p < q (p and q swapped)", """\
p_x = np.take_along_axis(target_probs[:, :k], x[..., None], axis=-1)[..., 0]
if draft_probs is None:
    q_x = np.ones((batch, k))
else:
    q_x = np.take_along_axis(draft_probs, x[..., None], axis=-1)[..., 0]
u = np.asarray(accept_uniforms, dtype=np.float64)
passes = (u * p_x.astype(np.float64) < q_x.astype(np.float64)) & is_draft
num_accepted = np.cumprod(passes, axis=1).sum(axis=1).astype(np.int64)
j = num_accepted
weights = target_probs[rows, j].astype(np.float64)
rejected = np.flatnonzero(num_accepted < num_draft)
if len(rejected) > 0:
    jr = j[rejected]
    p_j = weights[rejected]
    if draft_probs is None:
        q_j = np.zeros_like(p_j)
        q_j[np.arange(len(rejected)), draft_token_ids[rejected, jr]] = 1.0
    else:
        q_j = draft_probs[rejected, jr]
    weights[rejected] = residual_weights(p_j, q_j)
"""),
        ("a rejected position resamples p, not the residual max(0, p - q)", """\
p_x = np.take_along_axis(target_probs[:, :k], x[..., None], axis=-1)[..., 0]
if draft_probs is None:
    q_x = np.ones((batch, k))
else:
    q_x = np.take_along_axis(draft_probs, x[..., None], axis=-1)[..., 0]
u = np.asarray(accept_uniforms, dtype=np.float64)
passes = (u * q_x.astype(np.float64) < p_x.astype(np.float64)) & is_draft
num_accepted = np.cumprod(passes, axis=1).sum(axis=1).astype(np.int64)
j = num_accepted
weights = target_probs[rows, j].astype(np.float64)
"""),
        ("every passing draft counts, not only the leading run", """\
p_x = np.take_along_axis(target_probs[:, :k], x[..., None], axis=-1)[..., 0]
if draft_probs is None:
    q_x = np.ones((batch, k))
else:
    q_x = np.take_along_axis(draft_probs, x[..., None], axis=-1)[..., 0]
u = np.asarray(accept_uniforms, dtype=np.float64)
passes = (u * q_x.astype(np.float64) < p_x.astype(np.float64)) & is_draft
num_accepted = passes.sum(axis=1).astype(np.int64)
j = num_accepted
weights = target_probs[rows, j].astype(np.float64)
rejected = np.flatnonzero(num_accepted < num_draft)
if len(rejected) > 0:
    jr = j[rejected]
    p_j = weights[rejected]
    if draft_probs is None:
        q_j = np.zeros_like(p_j)
        q_j[np.arange(len(rejected)), draft_token_ids[rejected, jr]] = 1.0
    else:
        q_j = draft_probs[rejected, jr]
    weights[rejected] = residual_weights(p_j, q_j)
"""),
        ("the residual p - q without max(0, .): negative weights", """\
p_x = np.take_along_axis(target_probs[:, :k], x[..., None], axis=-1)[..., 0]
if draft_probs is None:
    q_x = np.ones((batch, k))
else:
    q_x = np.take_along_axis(draft_probs, x[..., None], axis=-1)[..., 0]
u = np.asarray(accept_uniforms, dtype=np.float64)
passes = (u * q_x.astype(np.float64) < p_x.astype(np.float64)) & is_draft
num_accepted = np.cumprod(passes, axis=1).sum(axis=1).astype(np.int64)
j = num_accepted
weights = target_probs[rows, j].astype(np.float64)
rejected = np.flatnonzero(num_accepted < num_draft)
if len(rejected) > 0:
    jr = j[rejected]
    p_j = weights[rejected]
    if draft_probs is None:
        q_j = np.zeros_like(p_j)
        q_j[np.arange(len(rejected)), draft_token_ids[rejected, jr]] = 1.0
    else:
        q_j = draft_probs[rejected, jr]
    weights[rejected] = p_j - q_j
"""),
    ],
    "ngram_proposal": [
        ("the oldest match instead of the most recent", """\
tokens = np.asarray(token_ids, dtype=np.int64)
length = len(tokens)
if length < 2:
    return []
ends = np.arange(length - 1)
match = np.ones(length - 1, dtype=bool)
best_end = None
for n in range(1, min(max_n, length - 1) + 1):
    start = ends - (n - 1)
    valid = start >= 0
    match &= valid & (tokens[np.maximum(start, 0)] == tokens[length - n])
    if not match.any():
        break
    if n >= min_n:
        best_end = int(np.flatnonzero(match)[0])
if best_end is None:
    return []
return tokens[best_end + 1 : best_end + 1 + k].tolist()
"""),
        ("the shortest suffix that matches, not the longest", """\
tokens = np.asarray(token_ids, dtype=np.int64)
length = len(tokens)
if length < 2:
    return []
ends = np.arange(length - 1)
match = np.ones(length - 1, dtype=bool)
best_end = None
for n in range(1, min(max_n, length - 1) + 1):
    start = ends - (n - 1)
    valid = start >= 0
    match &= valid & (tokens[np.maximum(start, 0)] == tokens[length - n])
    if not match.any():
        break
    if n >= min_n:
        best_end = int(np.flatnonzero(match)[-1])
        break
if best_end is None:
    return []
return tokens[best_end + 1 : best_end + 1 + k].tolist()
"""),
    ],
}
