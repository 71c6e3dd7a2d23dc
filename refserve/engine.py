"""The serving engine: `LLMEngine` (add_request / step / abort) and the offline `LLM` API.

One `step()` is one iteration of continuous batching, six visible stages:

    out    = scheduler.schedule()          # admit / advance / preempt, under the budgets
    inputs = runner.prepare(out)           # flat batch + attention metadata (host scalars)
    runner.copy_blocks(out.block_copies)   # copy-on-write before anyone writes
    logits = runner.forward(inputs)        # per layer: write_kv, paged_attention
    tokens = engine.sample(out, logits)    # one token per sampling row
    scheduler.update(out, tokens)          # append, fork, hash full blocks, retire, free

The public API mirrors vLLM's offline API, so code written against refserve moves to vLLM by
changing one import:

    from refserve import LLM, SamplingParams
    llm = LLM()                                   # the embedded SmolLM2-135M-Instruct
    outs = llm.generate(["Hello"], SamplingParams(max_tokens=32, temperature=0.0))
    outs[0].outputs[0].text
"""

from __future__ import annotations

import itertools
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from refserve import capacity
from refserve.backends import get_backend
from refserve.config import EngineConfig
from refserve.detokenizer import IncrementalDetokenizer
from refserve.kv_cache import KVCacheManager
from refserve.metrics import RequestMetrics, RunSummary, summarize
from refserve.model_runner import ModelRunner
from refserve.sampling import Sampler, SamplingParams, make_generator
from refserve.scheduler import SampledTokens, Scheduler, SchedulerOutput, StaticScheduler
from refserve.sequence import Sequence, SequenceStatus


class EngineStepError(RuntimeError):
    """A step failed. `request_ids` names the requests in that step's batch. The block pool
    is left consistent: the requests keep their blocks and are scheduled again by the next
    step, or can be aborted."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length", "abort" or None while running


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    generators: dict[int, np.random.Generator] = field(default_factory=dict)
    stop_text_len: dict[int, int] = field(default_factory=dict)  # seq_id → text cut at stop
    detokenizers: dict[int, IncrementalDetokenizer] = field(default_factory=dict)

    @property
    def finished(self) -> bool:
        return (len(self.seqs) == self.params.n or self.seqs[0].is_finished) and all(
            s.is_finished for s in self.seqs)


def resolve_model_path(model: str | None, progress: bool = True) -> Path:
    if model is None:
        from refserve.models.default_model import ensure_default_model
        return ensure_default_model(progress=progress)
    return Path(model).expanduser()


def load_tokenizer(path: Path):
    """The HF fast tokenizer of a model folder, or None when the folder has none (then only
    token-id prompts are accepted). transformers works without torch for this."""
    if not (path / "tokenizer.json").is_file() and not (path / "tokenizer_config.json").is_file():
        return None
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(path))


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None, progress: bool = True,
                 **kwargs) -> None:
        from refserve.models.loader import load_model

        self.config = config = config or EngineConfig(**kwargs)
        self.progress = progress
        self.model_path = resolve_model_path(config.model, progress)
        self.backend = get_backend(config.backend)
        # Weights and KV cache dtype; refused here (before loading) if the backend lacks it.
        self.dtype = self.backend.resolve_dtype(config.dtype)
        self.model = load_model(self.model_path, self.backend, self.dtype)
        self.tokenizer = load_tokenizer(self.model_path)
        mc = self.model.config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        if self.max_model_len > mc.max_position_embeddings:
            raise ValueError(f"max_model_len={self.max_model_len} exceeds the model's "
                             f"max_position_embeddings={mc.max_position_embeddings}")
        self.eos_token_id = mc.eos_token_id

        # --- KV pool sizing: the blocks, not the weights, decide how many sequences fit.
        # All arithmetic is refserve/capacity.py's; this only picks its inputs.
        contiguous = config.kv_cache_layout == "contiguous"
        self.block_size = self.max_model_len if contiguous else config.block_size
        bytes_per_token = capacity.kv_bytes_per_token(
            mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
            capacity.DTYPE_BYTES[self.dtype.name])
        bytes_per_block = capacity.kv_bytes_per_block(bytes_per_token, self.block_size)
        if config.num_gpu_blocks is not None:
            num_blocks = config.num_gpu_blocks
            knob = f"num_gpu_blocks={num_blocks}"
        else:
            free_device = self.backend.free_device_memory()
            if free_device is not None:
                # GPU: the weights are already on the device, so what is free is what the KV
                # pool may take, times the headroom factor gpu_memory_utilization.
                memory, utilization = free_device, config.gpu_memory_utilization
                knob = f"gpu_memory_utilization={utilization} of {free_device} free bytes"
            else:
                memory, utilization = config.kv_cache_memory, 1.0
                knob = f"kv_cache_memory={memory} bytes"
            num_blocks = capacity.num_blocks_for_memory(memory, utilization, 0, bytes_per_block)
            # More blocks than max_num_seqs full-length sequences can use is wasted memory.
            num_blocks = min(num_blocks, config.max_num_seqs * capacity.blocks_for_tokens(
                self.max_model_len, self.block_size))
        # A pool that cannot hold one max_model_len sequence would fail mid-run: refuse now.
        capacity.check_pool_holds_one_sequence(num_blocks, self.block_size, self.max_model_len,
                                               knob)
        self.num_blocks = num_blocks
        self.kv_cache_manager = KVCacheManager(
            num_blocks, self.block_size,
            enable_prefix_caching=config.enable_prefix_caching and not contiguous)
        scheduler_cls = StaticScheduler if config.batching == "static" else Scheduler
        self.scheduler = scheduler_cls(config.max_num_seqs, config.max_num_batched_tokens,
                                       self.kv_cache_manager, self.max_model_len,
                                       eos_token_id=self.eos_token_id)
        self.runner = ModelRunner(self.model, self.backend, num_blocks, self.block_size)
        self.sampler = Sampler()
        self.requests: dict[str, _Request] = {}
        self._request_counter = itertools.count()
        self.kv_blocks_peak = 0
        self.time_in_step = 0.0  # seconds inside step(); runner.time_in_forward is the model
        if progress:
            tokens = num_blocks * self.block_size
            print(f"refserve: {config.backend}→{self.backend.name} backend, model "
                  f"{self.model_path.name} ({mc.num_parameters() / 1e6:.0f}M params) | KV cache "
                  f"{num_blocks} blocks × {self.block_size} tokens = {tokens} tokens, "
                  f"{num_blocks * bytes_per_block / 1024**3:.2f} GiB | max concurrency at "
                  f"max_model_len {self.max_model_len}: {tokens / self.max_model_len:.2f}x",
                  file=sys.stderr, flush=True)

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer; pass prompt token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def apply_chat_template(self, user_message: str) -> str:
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise ValueError(f"{self.model_path} has no chat template")
        return self.tokenizer.apply_chat_template(
            [{"role": "user", "content": user_message}], tokenize=False,
            add_generation_prompt=True)

    def validate_request(self, prompt: str | list[int] | None,
                         sampling_params: SamplingParams) -> list[int]:
        """Check one request before anything is allocated; returns its prompt token ids.
        Raises ValueError naming the problem."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(sampling_params).__name__}")
        sampling_params.validate()
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is empty; give at least one token")
            token_ids = self.encode(prompt)
        elif prompt is None:
            raise ValueError("prompt is None; give a string or a list of token ids")
        else:
            token_ids = list(prompt)
        if not token_ids:
            raise ValueError("prompt is empty; give at least one token")
        vocab = self.model.config.vocab_size
        bad = [t for t in token_ids if not isinstance(t, (int, np.integer)) or not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt_token_ids contains {len(bad)} unknown token id(s), "
                             f"e.g. {bad[0]!r}; valid ids are 0..{vocab - 1}")
        self.scheduler.check_fits(len(token_ids), sampling_params.n)
        return [int(t) for t in token_ids]

    def add_request(self, request_id: str | None, prompt: str | list[int],
                    sampling_params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        sampling_params = sampling_params or SamplingParams()
        if request_id is None:
            request_id = str(next(self._request_counter))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.validate_request(prompt, sampling_params)
        now = time.perf_counter() if arrival_time is None else arrival_time
        req = _Request(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                       sampling_params, RequestMetrics(arrival_time=now,
                                                       num_prompt_tokens=len(token_ids)))
        seq = Sequence(request_id, token_ids, sampling_params, now)
        self.scheduler.add_sequence(seq)  # gives the sequence its id
        req.seqs.append(seq)
        req.generators[seq.seq_id] = make_generator(sampling_params.seed, 0)
        self.requests[request_id] = req
        return request_id

    def abort(self, request_id: str) -> bool:
        """Stop a waiting, running or preempted request; its blocks are freed at once."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq.seq_id)  # frees its blocks, marks it aborted
        del self.requests[request_id]
        return True

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching, as six visible stages (a notebook can run
        each one in its own cell, exactly like this):

            out    = scheduler.schedule()          who computes which tokens
            inputs = runner.prepare(out)           the flat batch + attention metadata
            runner.copy_blocks(out.block_copies)   copy-on-write before anyone writes
            logits = runner.forward(inputs)        per layer: write_kv, paged_attention
            tokens = engine.sample(out, logits)    one token per sampling row
            scheduler.update(out, tokens)          append, fork, retire, free

        If any stage before `update` fails, nothing of the step has been applied: the
        scheduler redoes the same work on the next step (or the failing request is aborted)
        and seeded requests draw the same random numbers again.
        """
        t_step = time.perf_counter()
        out = self.scheduler.schedule()
        if not out.scheduled:
            if self.scheduler.has_unfinished():
                # Cannot happen while add_request keeps every prompt within the pool; fail
                # loudly rather than let a caller's `while has_unfinished()` spin forever.
                raise RuntimeError(
                    f"the scheduler could schedule nothing with {self.scheduler.num_waiting} "
                    f"waiting and {self.scheduler.num_running} running sequences "
                    f"({self.kv_cache_manager.num_free_blocks} free blocks)")
            return []
        # The pool is at its fullest now: this step's blocks are allocated and nothing has
        # been retired yet (retiring frees blocks in update()).
        kv = self.kv_cache_manager
        self.kv_blocks_peak = max(self.kv_blocks_peak, kv.num_blocks - kv.num_free_blocks)
        try:
            inputs = self.runner.prepare(out)
            self.runner.copy_blocks(out.block_copies)
            logits = self.runner.forward(inputs)
            sampled = self.sample(out, logits)
        except Exception as e:
            ids = sorted({s.seq.request_id for s in out.scheduled})
            raise EngineStepError(
                f"step {out.step} failed in the model forward or sampling for request(s) "
                f"{ids}: {e!r}. The KV pool is consistent; call step() again or abort "
                "these requests.", ids) from e
        self.scheduler.update(out, sampled)  # retired sequences' blocks are freed here
        outputs = self._postprocess(out, sampled, time.perf_counter())
        self.time_in_step += time.perf_counter() - t_step
        return outputs

    def sample(self, out: SchedulerOutput, logits: np.ndarray) -> SampledTokens:
        """The sampling stage: one token per sampling row of `out`, from its logits row.

        A parent of a parallel-sampling request (n > 1) that samples its first token also
        draws the first token of each child 1..n-1 from the same logits row, each with the
        child's own generator (seed + i). The children themselves are forked by
        `scheduler.update`, only once the step is applied. Changes no engine state: if it
        raises, the generators it advanced are put back where they were.
        """
        rows = [s for s in out.scheduled if s.num_logits > 0]
        assert all(s.num_logits == 1 for s in rows), \
            "verify rows (num_logits > 1) go through the speculative accept step"
        assert len(logits) == len(rows), f"{len(logits)} logits rows for {len(rows)} rows"
        reqs = [self.requests[s.seq.request_id] for s in rows]
        generators = [r.generators[s.seq.seq_id] for s, r in zip(rows, reqs)]
        states = [g.bit_generator.state for g in generators]
        result = SampledTokens()
        try:
            tokens = self.sampler.sample(logits, [s.seq.sampling_params for s in rows],
                                         generators)
            for i, (s, req, token) in enumerate(zip(rows, reqs, tokens)):
                result.token_ids[s.seq.seq_id] = [token]
                if s.seq.awaiting_fork:
                    firsts = []
                    for child in range(1, req.params.n):
                        gen = make_generator(req.params.seed, child)
                        result.generators[(s.seq.seq_id, child)] = gen
                        firsts += self.sampler.sample(logits[i:i + 1], [req.params], [gen])
                    result.fork_token_ids[s.seq.seq_id] = firsts
        except BaseException:
            for g, state in zip(generators, states):
                g.bit_generator.state = state
            raise
        return result

    def _postprocess(self, out: SchedulerOutput, sampled: SampledTokens,
                     now: float) -> list[RequestOutput]:
        """After update: register forked children, extend each sequence's text by its new
        tokens (incremental detokenization), apply stop strings, stamp times; return one
        RequestOutput per request that got tokens, and forget finished requests."""
        for child in out.forked:
            req = self.requests[child.request_id]
            req.seqs.append(child)
            parent_id = req.seqs[0].seq_id
            req.generators[child.seq_id] = sampled.generators[(parent_id, child.child_index)]
        touched: dict[str, _Request] = {}
        got_tokens = [row.seq for row in out.scheduled if row.seq.seq_id in sampled.token_ids]
        for seq in got_tokens + out.forked:
            req = self.requests.get(seq.request_id)
            if req is None:
                continue  # aborted since schedule()
            touched[req.request_id] = req
            self._advance_text(req, seq, now)
        for req in touched.values():
            if req.finished:
                m = req.metrics
                m.finish_time = max(s.finish_time or now for s in req.seqs)
                m.num_output_tokens = sum(s.num_output_tokens for s in req.seqs)
                m.num_cached_tokens = req.seqs[0].num_cached_tokens
                m.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        outputs = [self._output(req) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                del self.requests[req.request_id]
        return outputs

    def _advance_text(self, req: _Request, seq: Sequence, now: float) -> None:
        """New tokens of `seq`: first-token time, text, stop strings, finish time.

        Stop strings are checked on every new token, also on the one that finished the
        sequence by length (max_tokens / max_model_len): a stop string it completes still
        cuts the text and makes the finish reason "stop", as in vLLM.
        """
        if seq.first_token_time is None and seq.num_output_tokens > 0:
            seq.first_token_time = now
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        detok = req.detokenizers.get(seq.seq_id)
        if detok is None:
            detok = req.detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer)
        old_len = len(detok.text)
        detok.update(seq.output_token_ids)
        stops = req.params.stop
        if stops and seq.seq_id not in req.stop_text_len:
            text = detok.text
            # Only a match that ends in the new text is new: start the search far enough
            # back for the longest stop string to straddle the old/new boundary.
            since = max(0, old_len - max(map(len, stops)) + 1)
            hits = [i for i in (text.find(st, since) for st in stops) if i >= 0]
            if hits:
                req.stop_text_len[seq.seq_id] = min(hits)
                if seq.is_finished:  # finished by length on this very token
                    seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
        if seq.is_finished and seq.finish_time is None:
            seq.finish_time = now

    def _output(self, req: _Request) -> RequestOutput:
        completions = []
        for i, seq in enumerate(sorted(req.seqs, key=lambda s: s.child_index)):
            detok = req.detokenizers.get(seq.seq_id)
            text = detok.text if detok is not None else ""
            if seq.seq_id in req.stop_text_len:
                text = text[:req.stop_text_len[seq.seq_id]]
            completions.append(CompletionOutput(i, text, list(seq.output_token_ids),
                                                seq.status.finish_reason))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, completions,
                             req.finished, req.metrics)

    def stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_steps": self.scheduler.num_steps,
            "slot_steps_used": self.scheduler.slot_steps_used,
            "slot_steps_wasted": self.scheduler.slot_steps_wasted,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_peak": self.kv_blocks_peak,
            "kv_blocks_total": kv.num_blocks,
            "prefix_cache_queried_tokens": kv.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": kv.prefix_cache_hit_tokens,
            "time_in_forward": self.runner.time_in_forward,
            "time_in_step": self.time_in_step,
        }


class LLM:
    """Offline batch generation, vLLM-shaped: `LLM(...).generate(prompts, params)`."""

    def __init__(self, model: str | None = None, backend: str = "auto", block_size: int = 16,
                 num_gpu_blocks: int | None = None, gpu_memory_utilization: float = 0.9,
                 max_num_seqs: int = 256, max_num_batched_tokens: int = 8192,
                 enable_prefix_caching: bool = True, speculative_config: dict | None = None,
                 progress: bool = True, **kwargs) -> None:
        config = EngineConfig(model=model, backend=backend, block_size=block_size,
                              num_gpu_blocks=num_gpu_blocks,
                              gpu_memory_utilization=gpu_memory_utilization,
                              max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens,
                              enable_prefix_caching=enable_prefix_caching,
                              speculative_config=speculative_config, **kwargs)
        self.engine = LLMEngine(config, progress=progress)
        self.last_summary: RunSummary | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> LLM:
        llm = cls.__new__(cls)
        llm.engine = LLMEngine(config, progress=progress)
        llm.last_summary = None
        return llm

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params=None, use_tqdm: bool = True,
                 on_step=None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        prompts: a string, a list of strings, a list of token-id lists, or dicts
        {"prompt_token_ids": [...]}. sampling_params: one for all or a list, one per prompt.
        Every prompt is validated before any is queued: a bad one raises ValueError naming
        its index and nothing is left behind.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = [p["prompt_token_ids"] if isinstance(p, dict) else p for p in prompts]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = (list(sampling_params) if isinstance(sampling_params, (list, tuple))
                  else [sampling_params] * len(prompts))
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        engine = self.engine
        for i, (p, sp) in enumerate(zip(prompts, params)):
            try:
                engine.validate_request(p, sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        stats_before = engine.stats()
        start = time.perf_counter()
        ids = [engine.add_request(None, p, sp) for p, sp in zip(prompts, params)]
        results: dict[str, RequestOutput] = {}
        from tqdm import tqdm
        bar = tqdm(total=len(ids), desc="generate", unit="req",
                   disable=not use_tqdm or len(ids) < 2)
        try:
            while len(results) < len(ids):
                for o in engine.step():
                    if on_step is not None:
                        on_step(o)
                    if o.finished:
                        results[o.request_id] = o
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort(rid)
            raise
        finally:
            bar.close()
        elapsed = time.perf_counter() - start
        outputs = [results[r] for r in ids]
        stats = engine.stats()
        delta = {k: stats[k] - stats_before.get(k, 0) for k in stats}
        delta["kv_blocks_peak"] = stats["kv_blocks_peak"]
        delta["kv_blocks_total"] = stats["kv_blocks_total"]
        self.last_summary = summarize([o.metrics for o in outputs], elapsed, delta)
        return outputs
