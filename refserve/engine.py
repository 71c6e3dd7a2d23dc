"""The serving engine: `LLMEngine`, with vLLM's method names: add_request / step /
abort_request / has_unfinished_requests. (The offline `LLM` API is in refserve/llm.py;
the outputs are refserve/outputs.py.)

One `step()` is one iteration of continuous batching, eight public stages (listed in
`LLMEngine.step`'s docstring, their one listing), each a call a notebook can make in its own
cell.

`engine.observer` (refserve's, default None) watches a run without being part of it:
anything with `arrive(request_id, t)`, called by add_request with the arrival time,
`step(t_start, t_end, out, update, outputs)`, called after each step with its
time.perf_counter() bounds, and `abort(request_id, t)`, called by abort_request. The
`--trace` timeline (refserve/simulator/trace.py, `EngineTrace`) is one; the engine never imports it.
"""

from __future__ import annotations

import itertools
import sys
import time

import numpy as np

from refserve.backends import get_backend
from refserve.config import EngineConfig
from refserve.engine_setup import plan_kv_pool, resolve_token_budget, startup_lines
from refserve.kv_cache import KVCacheManager
from refserve.kv_cache.host_pool import HostBlockPool
from refserve.logprobs import sampled_logprobs
from refserve.model_runner import ModelRunner
from refserve.models.loader import load_tokenizer, resolve_model_path
from refserve.output_processor import RequestState, make_outputs
from refserve.outputs import RequestOutput
from refserve.request_intake import RequestIntake
from refserve.sampling import Sampler, make_generator
from refserve.sampling.verify import verify
from refserve.scheduler import ChildDraw, SampledTokens, SchedulerOutput, StepUpdate
from refserve.scheduler.drafts import Proposals, verify_inputs
from refserve.scheduler.factory import make_scheduler
from refserve.scheduler.swapping import swap_stats
from refserve.sequence import Sequence
from refserve.spec_decode.registry import resolve as resolve_proposer
from refserve.spec_decode.speculator import Speculator
from refserve.static_runner import StaticBatchRunner


class EngineStepError(RuntimeError):
    """A step failed. `request_ids` names the requests in that step's batch. The block pool
    is left consistent: the requests keep their blocks and are scheduled again by the next
    step, or can be aborted."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


class LLMEngine(RequestIntake):
    def __init__(self, config: EngineConfig | None = None, progress: bool = True,
                 **kwargs) -> None:
        from refserve.models.loader import load_model  # lazily: numpy-only until here

        config = config or EngineConfig(**kwargs)
        self.config = config
        self.progress = progress
        # Speculative decoding's proposer and its options, checked before anything loads.
        proposer_cls, spec = None, config.speculative_config
        if spec is not None:
            proposer_cls, spec = resolve_proposer(spec, config)
        self.speculative_config = spec
        self.model_path = resolve_model_path(config.model, progress)
        self.backend = get_backend(config.backend, enforce_eager=config.enforce_eager)
        # None means the backend's default token budget (config.py), resolved once, here.
        config, budget_source = resolve_token_budget(config, self.backend.name)
        self.config = config
        # Weights and KV cache dtype; refused here (before loading) if the backend lacks it.
        self.dtype = self.backend.resolve_dtype(config.dtype)
        self.model = load_model(self.model_path, self.backend, self.dtype)
        self.tokenizer = load_tokenizer(self.model_path)
        self._token_text: dict[int, str] = {}
        mc = self.model.config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        self.eos_token_id = mc.eos_token_id

        # --- speculative decoding: (draft model or None, its cost per token); a draft
        # model shares the KV memory below.
        loaded = (None, 0.0) if spec is None else proposer_cls.load(
            spec, self.model, self.backend, self.dtype, self.tokenizer, self.max_model_len)
        draft_model = loaded[0]

        # --- the KV pool: the blocks, not the weights, decide how many sequences fit.
        plan = plan_kv_pool(config, mc, self.backend, self.dtype, self.max_model_len,
                            draft_model.config if draft_model is not None else None)
        self.kv_pool_plan = plan
        num_blocks = plan.num_blocks
        self.num_blocks = num_blocks
        self.block_size = plan.block_size
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size,
            enable_prefix_caching=config.enable_prefix_caching
            and config.kv_cache_layout != "contiguous",
            prefix_caching_policy=config.prefix_caching_policy)
        self.num_host_blocks = plan.num_host_blocks
        self.bytes_per_block = plan.bytes_per_block
        self.scheduler = make_scheduler(
            config, self.kv_cache_manager, self.max_model_len, self.eos_token_id,
            HostBlockPool(self.num_host_blocks) if config.preemption_mode == "swap" else None)
        # Static batching's runner also computes its padding rows (static_runner.py).
        runner = StaticBatchRunner if config.batching == "static" else ModelRunner
        self.runner = runner(self.model, self.backend, num_blocks, self.block_size,
                             num_host_blocks=self.num_host_blocks)
        self.sampler = Sampler(self.backend)
        # Speculative decoding: the propose stage (None: every row samples one token).
        self.speculator = None if spec is None else Speculator.create(
            proposer_cls, spec, loaded, self.model, self.backend, num_blocks,
            self.block_size, self.max_model_len, config.max_num_batched_tokens)
        self.requests: dict[str, RequestState] = {}
        self._request_counter = itertools.count()
        # vLLM's engine-level seed: an unseeded request gets its seed from this stream, so
        # the same engine seed and the same requests give the same outputs.
        self._seed_stream = np.random.default_rng(config.seed)
        self.time_in_step = 0.0  # seconds inside step(); runner.time_in_forward is the model
        self.observer = None     # see the module docstring
        if progress:
            for line in startup_lines(config, self.backend.name, self.model_path.name,
                                      mc.num_parameters(), self.max_model_len, plan,
                                      budget_source,
                                      proposer_cls.describe(spec) if spec else "",
                                      self.backend.startup_note()):
                print(line, file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching: exactly these eight public stages, in
        order (a notebook runs each one in its own cell; values flow from one to the next,
        nothing is stashed):

            proposals = engine.propose()                 # speculative drafts ({} without)
            out       = scheduler.schedule(proposals)    # admit / advance / preempt
            inputs    = runner.prepare(out)              # flat batch + attention metadata
            runner.copy_blocks(out.block_copies, out.swap_out, out.swap_in)  # swaps, CoW
            logits    = runner.forward(inputs)           # per layer: write_kv, attention
            sampled   = engine.sample(out, logits, proposals)  # 1 token a row, 1..k+1 a
                                                         # verify row
            update    = scheduler.update(out, sampled)   # append under the stop rules,
                                                         # roll back, hash, retire, release
            outputs   = engine.finish_step(out, sampled, update)  # metrics, RequestOutputs

        If any stage before `update` fails, nothing of the step has been applied: the
        engine raises EngineStepError naming the requests, the scheduler redoes the same
        work on the next step (or the failing request is aborted), and seeded requests draw
        the same random numbers again.
        """
        t_step = time.perf_counter()
        try:
            proposals = self.propose()
        except Exception as e:
            # Speculation is optional, and drafts are values: nothing is left behind.
            ids = sorted({seq.request_id for seq in self.scheduler.running})
            raise EngineStepError(f"the proposal stage failed for request(s) {ids}: {e!r}. "
                                  "Nothing was scheduled; call step() again or abort these "
                                  "requests.", ids) from e
        out = self.scheduler.schedule(proposals)
        try:
            inputs = self.runner.prepare(out)
            self.runner.copy_blocks(out.block_copies, out.swap_out, out.swap_in)
            logits = self.runner.forward(inputs)
            sampled = self.sample(out, logits, proposals)
        except Exception as e:
            ids = sorted({s.seq.request_id for s in out.scheduled})
            raise EngineStepError(
                f"step {out.step} failed in the model forward or sampling for request(s) "
                f"{ids}: {e!r}. The KV pool is consistent; call step() again or abort "
                "these requests.", ids) from e
        update = self.scheduler.update(out, sampled)
        outputs = self.finish_step(out, sampled, update)
        t_end = time.perf_counter()
        self.time_in_step += t_end - t_step
        if self.observer is not None:
            self.observer.step(t_step, t_end, out, update, outputs)
        return outputs

    def propose(self) -> Proposals:
        """The proposal stage: this step's drafts by seq_id, for the running sequences that
        may speculate (spec_decode/speculator.py); {} without speculative decoding. The
        drafts are values: they live until this step's update (scheduler/drafts.py)."""
        return {} if self.speculator is None else self.speculator.propose(self.scheduler.running)

    def sample(self, out: SchedulerOutput, logits: np.ndarray,
               proposals: Proposals | None = None) -> SampledTokens:
        """The sampling stage: one token per sampling row of `out`, from its logits row;
        1..k+1 tokens per speculative verify row (num_logits = k + 1), from its k + 1 logits
        rows by the accept / residual-resample step (sampling/verify.py, which states the
        order in which a verify row draws its uniforms from the sequence's generator), with
        the drafts' q from `proposals` (the propose stage's result).

        A parent of a parallel-sampling request (n > 1) that samples its first token also
        draws the first token of each child 1..n-1 from the same logits row, each with the
        child's own generator (seed + i). The children themselves are forked by
        `scheduler.update`, only once the step is applied. Changes no engine state: if it
        raises, the generators it advanced are put back where they were.
        """
        rows = [s for s in out.scheduled if s.num_logits > 0]
        first = np.cumsum([0] + [s.num_logits for s in rows])  # row i: logits[first[i]:...]
        assert first[-1] == len(logits), f"{len(logits)} logits rows for {first[-1]} needed"
        states = [s.seq.generator.bit_generator.state for s in rows]
        plain = [i for i, s in enumerate(rows) if not s.draft_token_ids]
        result = SampledTokens()
        try:
            seqs = [rows[i].seq for i in plain]
            tokens, logprobs = self._sample_rows(logits[first[plain]], seqs,
                                                 [s.generator for s in seqs])
            for i, seq, token, lp in zip(plain, seqs, tokens, logprobs):
                result.token_ids[seq.seq_id] = [token]
                result.logprobs[seq.seq_id] = lp
                if seq.awaiting_fork:
                    result.children[seq.seq_id] = self._draw_children(
                        logits[first[i]:first[i] + 1], seq)
            if len(plain) < len(rows):
                verifying = [i for i, s in enumerate(rows) if s.draft_token_ids]
                drafts, q = zip(*(verify_inputs(rows[i], proposals or {}) for i in verifying))
                emitted, _ = verify(
                    [logits[first[i]:first[i + 1]] for i in verifying], drafts, q,
                    [rows[i].seq.sampling_params for i in verifying],
                    [rows[i].seq.generator for i in verifying], self.backend)
                for i, toks in zip(verifying, emitted):
                    result.token_ids[rows[i].seq.seq_id] = toks
        except BaseException:
            for row, state in zip(rows, states):
                row.seq.generator.bit_generator.state = state
            raise
        return result

    def _draw_children(self, logits: np.ndarray, parent: Sequence) -> list[ChildDraw]:
        """The first token of each child 1..n-1 of `parent`'s request, from the parent's
        logits row, each with the child's own new generator (seed + i)."""
        seed = self.requests[parent.request_id].seed
        draws = []
        for index in range(1, parent.sampling_params.n):
            generator = make_generator(seed, index)
            (token,), (lp,) = self._sample_rows(logits, [parent], [generator])
            draws.append(ChildDraw(token, generator, lp))
        return draws

    def finish_step(self, out: SchedulerOutput, sampled: SampledTokens,
                    update: StepUpdate) -> list[RequestOutput]:
        """The last stage, after `scheduler.update` decided everything: the adaptive rule
        learns from this step's verify rows, forked children join their request, every
        request that got tokens gets its cumulative RequestOutput (output_processor.py:
        metrics, times, text as the stop rules cut it), and finished requests are
        forgotten."""
        if self.speculator is not None:
            self.speculator.observe(update)
        for child in update.forked:
            req = self.requests.get(child.request_id)
            if req is not None:
                req.seqs.append(child)
        outputs = make_outputs(self.requests, out, update, time.perf_counter())
        for finished in [o.request_id for o in outputs if o.finished]:
            del self.requests[finished]
        return outputs

    def _sample_rows(self, logits: np.ndarray, seqs: list[Sequence],
                     generators: list[np.random.Generator]
                     ) -> tuple[list[int], list[dict | None]]:
        """The Sampler on one logits row per sequence, given what its logits processors
        read (each sequence's prompt and output ids, EOS, bad-word tokens). Returns the
        tokens and, per row, the sampled token's logprobs (None unless asked for)."""
        params = [s.sampling_params for s in seqs]
        context = dict(prompt_token_ids=[s.prompt_token_ids for s in seqs],
                       output_token_ids=[s.output_token_ids for s in seqs],
                       eos_token_id=self.eos_token_id,
                       bad_words_token_ids=[s.bad_words_token_ids for s in seqs])
        tokens = self.sampler.sample(logits, params, generators, **context)
        if all(p.logprobs is None for p in params):
            return tokens, [None] * len(seqs)
        return tokens, sampled_logprobs(logits, tokens, params, self.decode_token)

    def stats(self) -> dict:
        """The engine's counters since start-up (LLM.generate reports one call's share)."""
        sched, kv = self.scheduler, self.kv_cache_manager
        return {
            "num_steps": sched.num_steps,
            "slot_steps_used": sched.slot_steps_used,
            "slot_steps_wasted": sched.slot_steps_wasted,
            "num_preemptions": sched.num_preemptions,
            "recomputed_tokens": sched.num_recomputed_tokens,
            **swap_stats(sched.swapper, self.bytes_per_block),
            "kv_blocks_peak": kv.num_held_blocks_peak,
            "kv_blocks_peak_since_reset": kv.num_held_blocks_peak_since_reset,
            "kv_blocks_total": kv.num_blocks,
            "prefix_cache_queried_tokens": kv.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": kv.prefix_cache_hit_tokens,
            "prefix_cache_evictions": kv.num_evictions,
            "time_in_forward": self.runner.time_in_forward,
            "time_in_step": self.time_in_step,
        }
