"""The serving engine: `LLMEngine`, with vLLM's method names: add_request / step /
abort_request / has_unfinished_requests. (The offline `LLM` API is in refserve/llm.py;
the outputs are refserve/outputs.py.)

One `step()` is one iteration of continuous batching, six visible stages (seven when
speculating: the proposal stage first):

    engine.propose()                       # speculative only: drafts into seq.spec_token_ids
    out    = scheduler.schedule()          # admit / advance / preempt, under the budgets
    inputs = runner.prepare(out)           # flat batch + attention metadata (host scalars)
    runner.copy_blocks(out.block_copies)   # copy-on-write before anyone writes
    logits = runner.forward(inputs)        # per layer: write_kv, paged_attention
    tokens = engine.sample(out, logits)    # one token per sampling row; 1..k+1 per verify row
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
from refserve.inputs import parse_prompt
from refserve.kv_cache import KVCacheManager
from refserve.logprobs import compute_logprobs
from refserve.metrics import RequestMetrics
from refserve.model_runner import ModelRunner
from refserve.outputs import CompletionOutput, RequestOutput
from refserve.sampling import Sampler, SamplingParams, make_generator
from refserve.scheduler import SampledTokens, Scheduler, SchedulerOutput, StaticScheduler
from refserve.sequence import Sequence, SequenceStatus
from refserve.spec_decode.adaptive import AdaptiveSpeculation
from refserve.spec_decode.draft_model import DraftModelProposer, load_draft_model
from refserve.spec_decode.proposer import NgramProposer, Proposal
from refserve.spec_decode.verify import verify


class EngineStepError(RuntimeError):
    """A step failed. `request_ids` names the requests in that step's batch. The block pool
    is left consistent: the requests keep their blocks and are scheduled again by the next
    step, or can be aborted."""

    def __init__(self, message: str, request_ids: list[str]) -> None:
        super().__init__(message)
        self.request_ids = request_ids


@dataclass
class _Request:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seed: int | None = None  # its own seed, else one drawn from the engine's seed
    seqs: list[Sequence] = field(default_factory=list)
    generators: dict[int, np.random.Generator] = field(default_factory=dict)
    stop_text_len: dict[int, int] = field(default_factory=dict)  # seq_id → text cut at stop
    stop_reason: dict[int, int | str] = field(default_factory=dict)  # seq_id → string / id
    logprobs: dict[int, list] = field(default_factory=dict)  # seq_id → one dict per token
    prompt_logprobs: list | None = None
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

        # --- speculative decoding: the draft model (if any) shares the KV memory below.
        spec = self.speculative_config = config.speculative_config
        draft_model, draft_cost, draft_bytes_per_token = None, 0.0, 0
        if spec is not None and spec.method == "draft_model":
            draft_model, draft_cost = load_draft_model(
                spec, self.model, self.backend, self.dtype, self.tokenizer, load_tokenizer,
                self.max_model_len)
            dc = draft_model.config
            draft_bytes_per_token = capacity.kv_bytes_per_token(
                dc.num_hidden_layers, dc.num_key_value_heads, dc.head_dim,
                capacity.DTYPE_BYTES[self.dtype.name])

        # --- KV pool sizing: the blocks, not the weights, decide how many sequences fit.
        # All arithmetic is refserve/capacity.py's; this only picks its inputs.
        contiguous = config.kv_cache_layout == "contiguous"
        self.block_size = self.max_model_len if contiguous else config.block_size
        bytes_per_token = capacity.kv_bytes_per_token(
            mc.num_hidden_layers, mc.num_key_value_heads, mc.head_dim,
            capacity.DTYPE_BYTES[self.dtype.name])
        bytes_per_block = capacity.kv_bytes_per_block(bytes_per_token, self.block_size)
        # With a draft model both caches get num_blocks blocks: the memory is split between
        # them by bytes per token.
        draft_bytes_per_block = (capacity.kv_bytes_per_block(draft_bytes_per_token,
                                                             self.block_size)
                                 if draft_bytes_per_token else 0)
        if config.num_gpu_blocks_override is not None:
            num_blocks = config.num_gpu_blocks_override
            knob = f"num_gpu_blocks_override={num_blocks}"
        else:
            free_device = self.backend.free_device_memory()
            if free_device is not None:
                memory, knob = self._kv_budget_on_device(free_device)
                utilization = 1.0
            else:
                memory, utilization = config.kv_cache_memory_bytes, 1.0
                knob = f"kv_cache_memory_bytes={memory}"
            num_blocks = capacity.num_blocks_for_memory(
                memory, utilization, 0, bytes_per_block + draft_bytes_per_block)
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
        self.runner = ModelRunner(self.model, self.backend, num_blocks, self.block_size,
                                  enforce_eager=config.enforce_eager)
        self.sampler = Sampler()
        self.proposer = None
        if spec is not None:
            self.proposer = (NgramProposer(spec.prompt_lookup_min, spec.prompt_lookup_max)
                             if spec.method == "ngram" else
                             DraftModelProposer(draft_model, self.backend, num_blocks,
                                                self.block_size, draft_cost))
        self.adaptive = AdaptiveSpeculation(spec.k if spec else 0, draft_cost,
                                            enabled=spec is not None and spec.adaptive)
        self._proposals: dict[int, Proposal] = {}  # this step's drafts, by seq_id
        self.requests: dict[str, _Request] = {}
        self._request_counter = itertools.count()
        # vLLM's engine-level seed: an unseeded request gets its seed from this stream, so
        # the same engine seed and the same requests give the same outputs.
        self._seed_stream = np.random.default_rng(config.seed)
        self._new_logprobs: dict = {}  # this step's sampled logprobs, by seq_id
        self.kv_blocks_peak = 0             # since start-up
        self.kv_blocks_peak_since_reset = 0  # since reset_kv_blocks_peak (one generate call)
        self.time_in_step = 0.0  # seconds inside step(); runner.time_in_forward is the model
        if progress:
            tokens = num_blocks * self.block_size
            print(f"refserve: {config.backend}→{self.backend.name} backend, model "
                  f"{self.model_path.name} ({mc.num_parameters() / 1e6:.0f}M params) | KV cache "
                  f"{num_blocks} blocks × {self.block_size} tokens = {tokens} tokens, "
                  f"{num_blocks * bytes_per_block / 1024**3:.2f} GiB | max concurrency at "
                  f"max_model_len {self.max_model_len}: {tokens / self.max_model_len:.2f}x"
                  f" | sized by {knob}", file=sys.stderr, flush=True)
            if spec is not None:
                draft = ""
                if draft_bytes_per_token:
                    draft = (f"; KV memory split by bytes per token: target {bytes_per_token}"
                             f" B, draft {draft_bytes_per_token} B -> draft cache "
                             f"{num_blocks * draft_bytes_per_block / 1024**3:.2f} GiB")
                method = (f"draft_model self ({spec.num_draft_layers} layers)"
                          if spec.is_self_draft else spec.method)
                print(f"refserve: speculative decoding {method}, k = {spec.k}, adaptive "
                      f"{'on' if spec.adaptive else 'off'}{draft}", file=sys.stderr,
                      flush=True)

    # ------------------------------------------------------------------ requests
    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer; pass prompt token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def _kv_budget_on_device(self, free: int) -> tuple[int, str]:
        """Bytes the KV pool may take on a GPU, vLLM's rule: the whole instance may use
        gpu_memory_utilization × the device's TOTAL memory; what is already in use (weights,
        CUDA context: total - free) and an estimate of one step's activations come off."""
        util = self.config.gpu_memory_utilization
        total = self.backend.total_device_memory()
        mc, item = self.model.config, self.dtype.itemsize
        # Activations of one step at the token budget: hidden states, q/k/v, MLP, logits.
        tokens = self.config.max_num_batched_tokens
        activations = (tokens * (4 * mc.hidden_size + 2 * mc.intermediate_size) * item
                       + min(tokens, self.config.max_num_seqs) * mc.vocab_size * 4)
        in_use = total - free
        budget = int(total * util) - in_use - activations
        if budget <= 0:
            raise ValueError(
                f"gpu_memory_utilization={util}: the instance may use "
                f"{capacity.format_bytes(total * util)} of the device's "
                f"{capacity.format_bytes(total)}, but {capacity.format_bytes(in_use)} is in "
                f"use already (weights, other processes) and one step's activations need "
                f"{capacity.format_bytes(activations)}; raise gpu_memory_utilization")
        return budget, (f"gpu_memory_utilization={util} of the device's total "
                        f"{capacity.format_bytes(total)} (weights + activations + KV)")

    def apply_chat_template(self, conversation, chat_template: str | None = None,
                            add_generation_prompt: bool = True,
                            continue_final_message: bool = False) -> str:
        """The prompt text of a conversation (a list of {"role", "content"} dicts; a plain
        string is one user message), rendered with the model's chat template."""
        if isinstance(conversation, str):
            conversation = [{"role": "user", "content": conversation}]
        if self.tokenizer is None or not (chat_template or getattr(
                self.tokenizer, "chat_template", None)):
            raise ValueError(f"{self.model_path} has no chat template; use generate() with a "
                             "plain prompt, or pass chat_template=")
        return self.tokenizer.apply_chat_template(
            conversation, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message)

    def validate_request(self, prompt, sampling_params: SamplingParams) -> list[int]:
        """Check one request before anything is allocated; returns its prompt token ids.
        `prompt`: any single-prompt form of refserve/inputs.py. Raises ValueError naming the
        problem (TypeError for a prompt of no accepted form)."""
        if not isinstance(sampling_params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got "
                             f"{type(sampling_params).__name__}")
        sampling_params.validate()
        if prompt is not None and not isinstance(prompt, list):
            prompt = parse_prompt(prompt)
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

    def add_request(self, request_id: str | None, prompt,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> str:
        """vLLM's `add_request(request_id, prompt, params)`: queue one request; its outputs
        come from `step()`. `prompt`: text, token ids or a prompt dict (refserve/inputs.py);
        request_id None picks a fresh one (refserve's extra). Returns the request id."""
        params = params or SamplingParams()
        if request_id is None:
            request_id = str(next(self._request_counter))
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if prompt is not None and not isinstance(prompt, list):
            prompt = parse_prompt(prompt)
        token_ids = self.validate_request(prompt, params)
        now = time.perf_counter() if arrival_time is None else arrival_time
        seed = params.seed
        if seed is None and self.config.seed is not None:
            seed = int(self._seed_stream.integers(2**31))
        req = _Request(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                       params, RequestMetrics(arrival_time=now,
                                              num_prompt_tokens=len(token_ids)), seed)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = self.score_prompt(token_ids, params.prompt_logprobs)
        seq = Sequence(request_id, token_ids, params, now)
        self.scheduler.add_sequence(seq)  # gives the sequence its id
        req.seqs.append(seq)
        req.generators[seq.seq_id] = make_generator(seed, 0)
        self.requests[request_id] = req
        return request_id

    def abort_request(self, request_id) -> bool:
        """vLLM's name: stop a waiting, running or preempted request (or each of an
        iterable of ids); its blocks are freed at once. True if any was still live."""
        if not isinstance(request_id, str) and hasattr(request_id, "__iter__"):
            return any([self.abort_request(r) for r in request_id])
        req = self.requests.get(request_id)
        if req is None:
            return False
        for seq in req.seqs:
            if not seq.is_finished:
                self.scheduler.abort(seq.seq_id)  # frees its blocks, marks it aborted
        del self.requests[request_id]
        return True

    abort = abort_request  # refserve's older name

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    has_unfinished = has_unfinished_requests  # refserve's older name

    def score_prompt(self, token_ids: list[int], num_logprobs: int) -> list:
        """vLLM's prompt_logprobs: entry j is {token_id: Logprob} for prompt token j given
        tokens 0..j-1 (entry 0 is None), from one extra forward of the prompt through a
        scratch KV cache of its own (so the serving pool and prefix cache are untouched),
        in chunks of max_num_batched_tokens so the logits stay [chunk, vocab]."""
        from refserve.scheduler.output import ScheduledSequence

        n, bs = len(token_ids), self.block_size
        num_blocks = capacity.blocks_for_tokens(n, bs)
        runner = ModelRunner(self.model, self.backend, num_blocks, bs)
        seq = Sequence("prompt-logprobs", token_ids, SamplingParams())
        chunk = self.config.max_num_batched_tokens
        result: list = [None]
        for start in range(0, n, chunk):
            size = min(chunk, n - start)
            seq.num_computed_tokens = start
            out = SchedulerOutput(step=0, scheduled=[ScheduledSequence(
                seq, size, start, size, block_ids=list(range(num_blocks)))])
            logits = runner.forward(runner.prepare(out))
            # Row i predicts prompt token start + i + 1 (the prompt's last row predicts none).
            targets = token_ids[start + 1:start + size + 1]
            result += compute_logprobs(logits[:len(targets)], targets, num_logprobs,
                                       self._decode_token)
        return result

    def _decode_token(self, token_id: int) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode([token_id])

    # ------------------------------------------------------------------ one iteration
    def step(self) -> list[RequestOutput]:
        """One iteration of continuous batching, as six visible stages (a notebook can run
        each one in its own cell, exactly like this), plus the proposal stage when
        speculating:

            engine.propose()                       drafts into seq.spec_token_ids
            out    = scheduler.schedule()          who computes which tokens
            inputs = runner.prepare(out)           the flat batch + attention metadata
            runner.copy_blocks(out.block_copies)   copy-on-write before anyone writes
            logits = runner.forward(inputs)        per layer: write_kv, paged_attention
            tokens = engine.sample(out, logits)    one token per sampling row, or the
                                                   accept / residual step of a verify row
            scheduler.update(out, tokens)          append, fork, roll back, retire, free

        If any stage before `update` fails, nothing of the step has been applied: the
        scheduler redoes the same work on the next step (or the failing request is aborted)
        and seeded requests draw the same random numbers again.
        """
        t_step = time.perf_counter()
        try:
            self.propose()
        except Exception as e:
            # Speculation is optional: forget the drafts, leave every sequence as it was.
            for seq in self.scheduler.running:
                seq.spec_token_ids.clear()
            ids = sorted({seq.request_id for seq in self.scheduler.running})
            raise EngineStepError(f"the proposal stage failed for request(s) {ids}: {e!r}. "
                                  "Nothing was scheduled; call step() again or abort these "
                                  "requests.", ids) from e
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
        in_use = kv.num_blocks - kv.num_free_blocks
        self.kv_blocks_peak = max(self.kv_blocks_peak, in_use)
        self.kv_blocks_peak_since_reset = max(self.kv_blocks_peak_since_reset, in_use)
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
        self._count_passes(out, sampled)
        outputs = self._postprocess(out, sampled, time.perf_counter())
        self.time_in_step += time.perf_counter() - t_step
        return outputs

    def sample(self, out: SchedulerOutput, logits: np.ndarray) -> SampledTokens:
        """The sampling stage: one token per sampling row of `out`, from its logits row;
        1..k+1 tokens per speculative verify row (num_logits = k + 1), from its k + 1 logits
        rows by the accept / residual-resample step (`spec_decode/verify.py`, which states the
        order in which a verify row draws its uniforms from the sequence's generator).

        A parent of a parallel-sampling request (n > 1) that samples its first token also
        draws the first token of each child 1..n-1 from the same logits row, each with the
        child's own generator (seed + i). The children themselves are forked by
        `scheduler.update`, only once the step is applied. Changes no engine state: if it
        raises, the generators it advanced are put back where they were.
        """
        rows = [s for s in out.scheduled if s.num_logits > 0]
        self._new_logprobs = {}
        first = np.cumsum([0] + [s.num_logits for s in rows])  # row i: logits[first[i]:...]
        assert first[-1] == len(logits), f"{len(logits)} logits rows for {first[-1]} needed"
        reqs = [self.requests[s.seq.request_id] for s in rows]
        generators = [r.generators[s.seq.seq_id] for s, r in zip(rows, reqs)]
        states = [g.bit_generator.state for g in generators]
        plain = [i for i, s in enumerate(rows) if s.num_logits == 1]
        verifying = [i for i, s in enumerate(rows) if s.num_logits > 1]
        result = SampledTokens()
        try:
            tokens = self._sample_rows(logits[first[plain]], [rows[i].seq for i in plain],
                                       [generators[i] for i in plain]) if plain else []
            for i, token in zip(plain, tokens):
                s, req = rows[i], reqs[i]
                result.token_ids[s.seq.seq_id] = [token]
                if s.seq.awaiting_fork:
                    firsts = []
                    for child in range(1, req.params.n):
                        gen = make_generator(req.seed, child)
                        result.generators[(s.seq.seq_id, child)] = gen
                        firsts += self._sample_rows(logits[first[i]:first[i] + 1],
                                                    [s.seq], [gen], [(s.seq.seq_id, child)])
                    result.fork_token_ids[s.seq.seq_id] = firsts
            if verifying:
                drafts = [rows[i].seq.spec_token_ids for i in verifying]
                for i, d in zip(verifying, drafts):
                    assert len(d) == rows[i].num_logits - 1, "a verify row is k drafts + 1"
                emitted, _ = verify(
                    [logits[first[i]:first[i + 1]] for i in verifying], drafts,
                    [self._proposals[rows[i].seq.seq_id].truncated(len(d)).draft_probs
                     for i, d in zip(verifying, drafts)],
                    [rows[i].seq.sampling_params for i in verifying],
                    [generators[i] for i in verifying], self.backend)
                for i, toks in zip(verifying, emitted):
                    result.token_ids[rows[i].seq.seq_id] = toks
        except BaseException:
            for g, state in zip(generators, states):
                g.bit_generator.state = state
            raise
        return result

    # ------------------------------------------------------------------ speculation
    def propose(self) -> dict[int, Proposal]:
        """The proposal stage (speculative decoding only; a no-op otherwise): fill
        `seq.spec_token_ids` of every running, decode-ready sequence (num_computed_tokens ==
        num_tokens - 1) with the proposer's drafts; returns them by seq_id. How many: see
        `num_drafts`. The scheduler then schedules them after the real token (a verify
        row), or drops those that do not fit the step's token budget or the pool; drafts of
        preempted or retired sequences are dropped by the scheduler, and their proposer
        state (a draft model's shadow sequence) is released here, on the next call."""
        self._proposals = {}
        if self.proposer is None:
            return {}
        running = self.scheduler.running
        live = {seq.seq_id for seq in running}
        self.proposer.release(live)
        self.adaptive.forget_all_but(live)
        seqs, counts = [], []
        for seq in running:
            seq.spec_token_ids.clear()  # drafts a step never scheduled are stale
            n = self.num_drafts(seq)
            if n > 0:
                seqs.append(seq)
                counts.append(n)
        if not seqs:
            return {}
        for seq, proposal in zip(seqs, self.proposer.propose(seqs, counts)):
            if proposal.token_ids:
                seq.spec_token_ids.extend(proposal.token_ids)
                self._proposals[seq.seq_id] = proposal
        return self._proposals

    def num_drafts(self, seq: Sequence) -> int:
        """How many drafts `seq` may get now: 0 unless it is decode-ready and its params
        allow speculation (no penalties, no logprobs, min_tokens already reached: those
        need per-position logits processing the verify step does not do; a parent about to
        fork samples its first token plainly). Otherwise the adaptive rule's k' (at most k),
        capped so that the k' drafts and the recovered or bonus token exceed neither the
        remaining max_tokens nor max_model_len: k' <= remaining - 1."""
        sp = seq.sampling_params
        if (seq.num_computed_tokens != seq.num_tokens - 1 or seq.awaiting_fork
                or sp.has_penalties or sp.logprobs is not None
                or seq.num_output_tokens < sp.min_tokens):
            return 0
        max_tokens = sp.max_tokens if sp.max_tokens is not None else self.max_model_len
        room = min(max_tokens - seq.num_output_tokens,
                   self.max_model_len - seq.num_tokens) - 1
        if room < 1:
            return 0
        return min(self.adaptive.num_drafts(seq.seq_id), room)

    def _count_passes(self, out: SchedulerOutput, sampled: SampledTokens) -> None:
        """Per-request metrics of the step just applied: one target pass per sampling row;
        for a verify row, drafts proposed (num_logits - 1) and accepted (tokens emitted - 1),
        which also feed the adaptive rule."""
        for row in out.scheduled:
            seq = row.seq
            tokens = sampled.token_ids.get(seq.seq_id)
            req = self.requests.get(seq.request_id)
            if row.is_padding or not row.samples or tokens is None or req is None:
                continue
            m = req.metrics
            m.num_target_passes += 1
            if row.num_logits > 1:
                proposed, accepted = row.num_logits - 1, len(tokens) - 1
                m.num_spec_verify_steps += 1
                m.num_spec_proposed += proposed
                m.num_spec_accepted += accepted
                self.adaptive.observe(seq.seq_id, proposed, accepted)

    def _sample_rows(self, logits: np.ndarray, seqs: list[Sequence],
                     generators: list[np.random.Generator], keys: list | None = None
                     ) -> list[int]:
        """The Sampler on one logits row per sequence, given what its logits processors
        read (each sequence's prompt and output ids, EOS: min_tokens and penalties). Rows
        asking for logprobs leave theirs in `self._new_logprobs[key]` (key: seq_id, or
        (parent seq_id, child index) for a child's first token) for `_postprocess`."""
        params = [s.sampling_params for s in seqs]
        context = dict(prompt_token_ids=[s.prompt_token_ids for s in seqs],
                       output_token_ids=[s.output_token_ids for s in seqs],
                       eos_token_id=self.eos_token_id)
        if all(p.logprobs is None for p in params):
            return self.sampler.sample(logits, params, generators, **context)
        out = self.sampler.sample_with_logprobs(logits, params, generators,
                                                decode=self._decode_token, **context)
        for key, lp in zip(keys or [s.seq_id for s in seqs], out.logprobs):
            if lp is not None:
                self._new_logprobs[key] = lp
        return out.token_ids

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
            lp = self._new_logprobs.pop((parent_id, child.child_index), None)
            if lp is not None:
                self._new_logprobs[child.seq_id] = lp
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
                # TPOT is per sequence: the n samples decode side by side, so their time
                # between tokens is each one's, not the total over n.
                decoding = [s for s in req.seqs if s.num_output_tokens > 1
                            and s.first_token_time is not None]
                m.decode_time = sum(s.finish_time - s.first_token_time for s in decoding)
                m.num_decode_tokens = sum(s.num_output_tokens - 1 for s in decoding)
                m.num_cached_tokens = req.seqs[0].num_cached_tokens
                m.num_preemptions = sum(s.num_preemptions for s in req.seqs)
        outputs = [self._output(req) for req in touched.values()]
        for req in touched.values():
            if req.finished:
                del self.requests[req.request_id]
        return outputs

    def _advance_text(self, req: _Request, seq: Sequence, now: float) -> None:
        """New tokens of `seq`: first-token time, text, stop strings, finish time.

        Stop strings are checked on every new token once min_tokens output tokens exist
        (vLLM), also on the one that finished the sequence by length (max_tokens /
        max_model_len): a stop string it completes still cuts the text and makes the finish
        reason "stop", as in vLLM. The text is cut before the stop string, or after it with
        include_stop_str_in_output; stop_reason is the matched string, or the stop token id
        that ended the sequence (None for EOS and length).
        """
        lp = self._new_logprobs.pop(seq.seq_id, None)
        if lp is not None:
            req.logprobs.setdefault(seq.seq_id, []).append(lp)
        if seq.first_token_time is None and seq.num_output_tokens > 0:
            seq.first_token_time = now
            if req.metrics.first_token_time is None:
                req.metrics.first_token_time = now
        detok = req.detokenizers.get(seq.seq_id)
        if detok is None:
            detok = req.detokenizers[seq.seq_id] = IncrementalDetokenizer(self.tokenizer)
        old_len = len(detok.text)
        detok.update(seq.output_token_ids)
        params = req.params
        stops = params.stop
        if (stops and seq.seq_id not in req.stop_text_len
                and seq.num_output_tokens >= params.min_tokens):
            text = detok.text
            # Only a match that ends in the new text is new: start the search far enough
            # back for the longest stop string to straddle the old/new boundary.
            since = max(0, old_len - max(map(len, stops)) + 1)
            hits = [(i, st) for i, st in ((text.find(st, since), st) for st in stops)
                    if i >= 0]
            if hits:
                at, stop = min(hits)
                keep = len(stop) if params.include_stop_str_in_output else 0
                req.stop_text_len[seq.seq_id] = at + keep
                req.stop_reason[seq.seq_id] = stop
                if seq.is_finished:  # finished by length on this very token
                    seq.status = SequenceStatus.FINISHED_STOPPED
                else:
                    self.scheduler.finish(seq.seq_id, SequenceStatus.FINISHED_STOPPED)
        if (seq.status == SequenceStatus.FINISHED_STOPPED and seq.seq_id not in req.stop_reason
                and seq.output_token_ids):
            last = seq.output_token_ids[-1]
            eos = last == self.eos_token_id and not params.ignore_eos
            if not eos and last in params.stop_token_ids:
                req.stop_reason[seq.seq_id] = last
        if seq.is_finished and seq.finish_time is None:
            seq.finish_time = now

    def _output(self, req: _Request) -> RequestOutput:
        """The request's outputs so far (cumulative, as vLLM's default output kind).

        While a sequence runs, the text holds back the last len(longest stop string) - 1
        characters (as vLLM's detokenizer does): a stop string still being completed may
        cut them, and a streamed prefix must never show text the final output drops."""
        params = req.params
        hold = (max(map(len, params.stop)) - 1
                if params.stop and not params.include_stop_str_in_output else 0)
        completions = []
        for i, seq in enumerate(sorted(req.seqs, key=lambda s: s.child_index)):
            detok = req.detokenizers.get(seq.seq_id)
            text = detok.text if detok is not None else ""
            if seq.seq_id in req.stop_text_len:
                text = text[:req.stop_text_len[seq.seq_id]]
            elif hold and not seq.is_finished:
                text = text[:max(0, len(text) - hold)]
            lps = req.logprobs.get(seq.seq_id) if params.logprobs is not None else None
            if params.logprobs is not None:
                lps = lps or []
            cumulative = (None if lps is None else float(sum(
                d[t].logprob for d, t in zip(lps, seq.output_token_ids))))
            completions.append(CompletionOutput(
                i, text, list(seq.output_token_ids), cumulative, lps,
                seq.status.finish_reason, req.stop_reason.get(seq.seq_id)))
        return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids,
                             req.prompt_logprobs, completions, req.finished, req.metrics,
                             req.seqs[0].num_cached_tokens)

    def stats(self) -> dict:
        kv = self.kv_cache_manager
        return {
            "num_steps": self.scheduler.num_steps,
            "slot_steps_used": self.scheduler.slot_steps_used,
            "slot_steps_wasted": self.scheduler.slot_steps_wasted,
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_blocks_peak": self.kv_blocks_peak,
            "kv_blocks_peak_since_reset": self.kv_blocks_peak_since_reset,
            "kv_blocks_total": kv.num_blocks,
            "prefix_cache_queried_tokens": kv.prefix_cache_queried_tokens,
            "prefix_cache_hit_tokens": kv.prefix_cache_hit_tokens,
            "time_in_forward": self.runner.time_in_forward,
            "time_in_step": self.time_in_step,
        }


    def reset_kv_blocks_peak(self) -> None:
        """Start a new window for `kv_blocks_peak_since_reset` (one generate() call); the
        cumulative `kv_blocks_peak` is kept."""
        kv = self.kv_cache_manager
        self.kv_blocks_peak_since_reset = kv.num_blocks - kv.num_free_blocks

