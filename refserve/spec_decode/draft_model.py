"""The draft-model proposer: a smaller model (or the target's first N layers) proposes drafts.

The draft runs on the engine's own machinery (LlamaModel, ModelRunner, KVCacheManager) with
its OWN paged KV cache, sized with the target's (the engine splits the KV memory between the
two by bytes per token). It keeps one *shadow* sequence per target sequence:

    shadow.token_ids   the target's token_ids, then the drafts the shadow proposed last time
    shadow.num_computed_tokens   positions whose draft K/V is in the draft's cache

Proposing for a batch of target sequences (one batched draft forward per draft position):

    1. ROLL BACK  each shadow to the longest common prefix (LCP) of its tokens and the
                  target's: the target accepted some drafts and replaced the first rejected
                  one, so shadow K/V past the LCP is stale. num_computed_tokens =
                  min(num_computed_tokens, LCP, num_tokens - 1) un-computes it (the slots
                  are rewritten), and the shadow's tokens become the target's.
    2. DRAFT      step i = 0 computes each shadow's catch-up chunk (the tokens it has not
                  computed yet: the last accepted / recovered / bonus tokens; the whole
                  prompt for a new shadow) and samples x_1 from the last position's logits;
                  steps i = 1..n-1 decode x_i to sample x_{i+1}. Each x is drawn from the
                  draft's distribution q warped as the Sampler warps (`warping.warp`;
                  greedy: argmax) and q is recorded: the rejection test divides by exactly
                  this q.
    3. RELEASE    shadows of sequences no longer running (finished, aborted, preempted) give
                  their blocks back (`release_all_except`).

Randomness of the draft: a seeded request draws x_{i+1} with a generator seeded from
(seed, child index, position), so re-proposing from the same state proposes the same drafts
(a failed step leaves no trace); the draws never touch the target's per-sequence generator.
Any draft distribution keeps the output exact (the rejection step corrects for q); only the
acceptance rate depends on how close q is to p.

If the draft's pool is short, a shadow that cannot catch up is dropped (re-prefilled later)
and one that cannot extend stops drafting early: speculation is optional.
"""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path

import numpy as np

from refserve.kv_cache import KVCacheManager
from refserve.model_runner import ModelRunner
from refserve.sampling.rejection_sampler import inverse_cdf_draw
from refserve.sampling.warping import warp
from refserve.scheduler.drafts import Proposal
from refserve.scheduler.output import ScheduledSequence, SchedulerOutput
from refserve.sequence import Sequence
from refserve.spec_decode.proposer import Proposer

_DRAFT_STREAM = 0xD2AF7  # mixed into a seeded draft generator: apart from the target's


def truncated_model(target, num_layers: int):
    """The target's first `num_layers` layers + its final norm and lm_head, as a model.
    Shares the target's weight arrays (a shallow copy: nothing is copied)."""
    total = target.config.num_hidden_layers
    if not 1 <= num_layers <= total:
        raise ValueError(f"speculative_config.num_draft_layers={num_layers}: the target has "
                         f"{total} layers; choose 1..{total}")
    draft = copy.copy(target)
    draft.config = dataclasses.replace(target.config, num_hidden_layers=num_layers)
    draft.layers = target.layers[:num_layers]
    return draft


def load_draft_model(spec, target, backend, dtype, target_tokenizer=None,
                     load_tokenizer=None, max_model_len: int | None = None):
    """The draft model of a `SpeculativeConfig` with method 'draft_model', checked against
    the target: same vocabulary size, and the same token -> id map when both folders have a
    tokenizer (`load_tokenizer(folder)` reads one, or returns None). Returns (model,
    draft_cost_per_token)."""
    model, layers = spec.options["model"], spec.options["num_draft_layers"]
    if model == "self":
        return truncated_model(target, layers), layers / target.config.num_hidden_layers
    from refserve.models.loader import load_model

    folder = Path(model).expanduser()
    if not folder.is_dir():
        raise ValueError(f"speculative_config.model={model!r}: no such folder; give an "
                         "HF-format model folder or \"self\"")
    draft = load_model(folder, backend, dtype)
    tv, dv = target.config.vocab_size, draft.config.vocab_size
    if tv != dv:
        raise ValueError(f"speculative_config.model={model!r}: the draft's vocabulary "
                         f"has {dv} tokens, the target's {tv}; a draft must share the "
                         "target's vocabulary (same tokenizer)")
    draft_tokenizer = load_tokenizer(folder) if load_tokenizer is not None else None
    if (target_tokenizer is not None and draft_tokenizer is not None
            and target_tokenizer.get_vocab() != draft_tokenizer.get_vocab()):
        raise ValueError(f"speculative_config.model={model!r}: the draft's tokenizer "
                         "maps tokens to other ids than the target's; a draft must share "
                         "the target's vocabulary (same tokenizer)")
    if max_model_len is not None and draft.config.max_position_embeddings < max_model_len:
        raise ValueError(f"speculative_config.model={model!r}: the draft handles "
                         f"{draft.config.max_position_embeddings} positions, fewer than "
                         f"max_model_len={max_model_len}; lower max_model_len")
    cost = draft.config.num_parameters() / max(target.config.num_parameters(), 1)
    return draft, cost


class DraftModelProposer(Proposer):
    """Drafts from a model run with its own paged KV cache (see the module docstring)."""

    method = "draft_model"
    options = {"model": None, "num_draft_layers": None}
    runs_a_model = True

    @classmethod
    def check_options(cls, options: dict, config=None) -> dict:
        """model (an HF folder with the target's vocabulary, or "self"), and with "self"
        num_draft_layers (the target's first N layers). Its KV cache is not swapped, so
        preemption_mode="swap" is refused."""
        model, layers = options["model"], options["num_draft_layers"]
        if not isinstance(model, str) or not model:
            raise ValueError("speculative_config.model is required for method "
                             "'draft_model': an HF folder with the target's vocabulary, or "
                             "\"self\" for the target's first num_draft_layers layers")
        if model != "self" and layers is not None:
            raise ValueError("speculative_config.num_draft_layers applies only to method "
                             "'draft_model' with model \"self\"")
        if model == "self" and (not isinstance(layers, int) or isinstance(layers, bool)
                                or layers < 1):
            raise ValueError(f"speculative_config.num_draft_layers={layers!r}: model "
                             "\"self\" needs an integer >= 1 (the draft runs the target's "
                             "first N layers)")
        if config is not None and config.preemption_mode == "swap":
            raise ValueError("preemption_mode='swap' with a draft model: the draft's own KV "
                             "cache is not swapped; use preemption_mode='recompute' or the "
                             "ngram method")
        return {"model": model, "num_draft_layers": layers}

    @classmethod
    def load(cls, spec, target, backend, dtype, tokenizer, max_model_len: int):
        from refserve.models.loader import load_tokenizer

        return load_draft_model(spec, target, backend, dtype, tokenizer, load_tokenizer,
                                max_model_len)

    @classmethod
    def create(cls, spec, loaded, backend, num_blocks: int, block_size: int
               ) -> DraftModelProposer:
        model, cost = loaded
        return cls(model, backend, num_blocks, block_size, cost)

    @classmethod
    def describe(cls, spec) -> str:
        o = spec.options
        return (f"draft_model self ({o['num_draft_layers']} layers)" if o["model"] == "self"
                else f"draft_model {o['model']}")

    def __init__(self, model, backend, num_blocks: int, block_size: int,
                 draft_cost_per_token: float) -> None:
        self.model = model
        self.backend = backend
        self.kv_cache_manager = KVCacheManager(num_blocks, block_size,
                                               enable_prefix_caching=False)
        self.runner = ModelRunner(model, backend, num_blocks, block_size)
        self.draft_cost_per_token = draft_cost_per_token
        self.shadows: dict[int, Sequence] = {}   # target seq_id -> shadow
        self._synced: dict[int, int] = {}         # target tokens the shadow mirrored last
        self._rng = np.random.default_rng()        # unseeded requests
        self.num_forwards = 0

    # ---- 1. roll back ------------------------------------------------------------------
    def _sync(self, seq: Sequence) -> Sequence:
        """The shadow of `seq`, rolled back to the LCP and holding seq's tokens."""
        shadow = self.shadows.get(seq.seq_id)
        if shadow is None:
            shadow = Sequence(seq.request_id, seq.token_ids, seq.sampling_params,
                              seq_id=seq.seq_id)
            self.shadows[seq.seq_id] = shadow
            self._synced[seq.seq_id] = 0
        # Target tokens are append-only, so the shadow agrees with them up to what it
        # mirrored last time; past that, compare its own drafts with what the target kept.
        lcp = min(self._synced[seq.seq_id], len(shadow.token_ids))
        mine, theirs = shadow.token_ids, seq.token_ids
        while lcp < min(len(mine), len(theirs)) and mine[lcp] == theirs[lcp]:
            lcp += 1
        del mine[lcp:]
        mine.extend(theirs[lcp:])
        # The last token is always (re)computed: its logits sample the first draft. (It has
        # K/V already only when re-proposing from an unchanged state, e.g. after a failed
        # step.)
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, lcp, len(mine) - 1)
        shadow.sampling_params = seq.sampling_params
        self._synced[seq.seq_id] = len(theirs)
        if self.kv_cache_manager.has_sequence(seq.seq_id):
            # Blocks wholly past the computed positions hold only stale drafts: release them.
            self.kv_cache_manager.trim(shadow, max(shadow.num_computed_tokens, 1))
        return shadow

    # ---- 2. draft ----------------------------------------------------------------------
    def propose(self, seqs, num_drafts) -> list[Proposal]:
        drafted: list[list[int]] = [[] for _ in seqs]
        active = [i for i, n in enumerate(num_drafts) if n > 0]
        shadows = {i: self._sync(seqs[i]) for i in active}
        q_rows: dict[int, list[np.ndarray]] = {i: [] for i in active}
        kv = self.kv_cache_manager
        for step in range(max((num_drafts[i] for i in active), default=0)):
            out = SchedulerOutput(step=step)
            rows = []
            for i in active:
                if num_drafts[i] <= step or len(drafted[i]) < step:
                    continue  # done, or stopped early (pool short)
                shadow = shadows[i]
                n = shadow.num_tokens - shadow.num_computed_tokens
                if kv.allocate_slots(shadow, n) is None:
                    if step == 0:
                        self._drop(seqs[i].seq_id)
                    continue
                out.scheduled.append(ScheduledSequence(
                    seq=shadow, start=shadow.num_computed_tokens, num_scheduled_tokens=n,
                    num_logits=1, block_ids=kv.get_block_ids(shadow.seq_id)))
                rows.append(i)
            if not rows:
                break
            logits = self.runner.forward(self.runner.prepare(out))
            self.num_forwards += 1
            q = warp(logits, [seqs[i].sampling_params for i in rows], self.backend)
            uniforms = np.array([self._uniform(seqs[i], shadows[i]) for i in rows])
            tokens = inverse_cdf_draw(q, uniforms)
            for r, i in enumerate(rows):
                shadow = shadows[i]
                shadow.num_computed_tokens = shadow.num_tokens
                shadow.token_ids.append(int(tokens[r]))
                drafted[i].append(int(tokens[r]))
                q_rows[i].append(q[r])
        return [Proposal(drafted[i], np.stack(q_rows[i]) if q_rows.get(i) else None)
                for i in range(len(seqs))]

    def _uniform(self, seq: Sequence, shadow: Sequence) -> float:
        """The draw for the draft token at position shadow.num_tokens (0 for greedy: the
        warped q is one-hot, any u picks its argmax)."""
        params = seq.sampling_params
        if params.greedy:
            return 0.0
        if params.seed is None:
            return float(self._rng.random())
        gen = np.random.default_rng([params.seed, seq.child_index, shadow.num_tokens,
                                     _DRAFT_STREAM])
        return float(gen.random())

    # ---- 3. release --------------------------------------------------------------------
    def release_all_except(self, live_seq_ids: set[int]) -> None:
        """Drop every shadow but those of `live_seq_ids`; theirs give their blocks back."""
        for seq_id in [s for s in self.shadows if s not in live_seq_ids]:
            self._drop(seq_id)

    def _drop(self, seq_id: int) -> None:
        shadow = self.shadows.pop(seq_id, None)
        self._synced.pop(seq_id, None)
        if shadow is not None:
            self.kv_cache_manager.release(shadow)
