"""`LLM`: vLLM's offline API. Code written for `vllm.LLM` runs with only the import changed:

    from refserve import LLM, SamplingParams       # vLLM: from vllm import LLM, SamplingParams
    llm = LLM(model="path/to/hf-folder", seed=0)   # model=None: the embedded SmolLM2 (refserve's)
    outs = llm.generate(["Hello, my name is"], SamplingParams(temperature=0.8, top_p=0.95))
    outs[0].outputs[0].text
    llm.chat([{"role": "user", "content": "Hi"}], SamplingParams(max_tokens=32))
    llm.llm_engine.add_request("0", "Hi", SamplingParams()); llm.llm_engine.step()

Prompts come in every form vLLM's `generate` takes (see `parse_prompts`); keywords are
vLLM's names (see `LLM.__init__`), plus refserve's own: `backend`, `batching`,
`kv_cache_layout`, `kv_cache_memory_bytes` (the CPU backends' pool size), `progress`.

`llm.last_summary` is refserve's: the run summary (TTFT / TPOT percentiles, KV blocks at
peak, prefix hit rate, steps) of the latest `generate` call only. The engine's cumulative
counters since start-up are `llm.llm_engine.stats()`, and `llm.get_metrics()` is vLLM's
(refserve/entrypoints/metrics_reader.py): the same list of Counter / Gauge / Histogram
vLLM returns, by vLLM's names.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable, Sequence

from refserve.config import EngineConfig
from refserve.engine import LLMEngine
from refserve.entrypoints.metrics_reader import Metric, metrics_snapshot
from refserve.entrypoints.prometheus import ServerMetrics, engine_gauges
from refserve.inputs import parse_prompts
from refserve.metrics import RunSummary, summarize
from refserve.outputs import RequestOutput
from refserve.sampling_params import SamplingParams

# LLM(...) keywords of vLLM that refserve accepts only with one value; others are errors.
_VLLM_FIXED = {"tensor_parallel_size": 1, "pipeline_parallel_size": 1}


class LLM:
    """Offline batch generation, vLLM-shaped: `LLM(...).generate(prompts, params)`."""

    def __init__(self, model: str | None = None, *, dtype: str = "auto", seed: int | None = 0,
                 gpu_memory_utilization: float = 0.9, enforce_eager: bool = False,
                 trust_remote_code: bool = False, tensor_parallel_size: int = 1,
                 disable_log_stats: bool = True, max_logprobs: int | None = None,
                 progress: bool = True, **kwargs) -> None:
        """vLLM's keywords: model (None: the embedded SmolLM2, refserve's extra), dtype,
        seed (engine-level default: unseeded requests draw from it, so a run is
        reproducible), gpu_memory_utilization (fraction of the device's TOTAL memory the
        whole instance may use), enforce_eager (no CUDA graphs), tensor_parallel_size (1 only:
        refserve runs on one device; use vLLM to scale out), trust_remote_code (ignored:
        refserve runs its own model code, never a checkpoint's), disable_log_stats (accepted;
        refserve always keeps the counters `get_metrics` reads, which vLLM keeps only with
        disable_log_stats=False), max_logprobs (the most logprobs / prompt_logprobs one
        request may ask for, -1 meaning the whole vocabulary; None, refserve's default, sets
        no cap, where vLLM's default is 20 and refuses logprobs=-1), and every `EngineConfig`
        knob (block_size, num_gpu_blocks_override, max_model_len, max_num_seqs,
        max_num_batched_tokens, enable_prefix_caching, speculative_config, ...)."""
        for name, only in _VLLM_FIXED.items():
            value = tensor_parallel_size if name == "tensor_parallel_size" else kwargs.pop(
                name, only)
            if value != only:
                raise ValueError(f"{name}={value!r}: refserve runs on one device, so only "
                                 f"{only} is supported; to scale out, use vLLM (same API)")
        if trust_remote_code:
            warnings.warn("trust_remote_code=True is ignored: refserve runs its own "
                          "Llama-family model code, never code shipped with a checkpoint",
                          UserWarning, stacklevel=2)
        known = EngineConfig.keyword_names()
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"LLM() got unknown keyword(s) {unknown}; accepted: model, dtype, "
                            "seed, gpu_memory_utilization, enforce_eager, trust_remote_code, "
                            "tensor_parallel_size, disable_log_stats, max_logprobs, progress, "
                            f"{', '.join(sorted(known))}")
        config = EngineConfig(model=model, dtype=dtype, seed=seed,
                              gpu_memory_utilization=gpu_memory_utilization,
                              enforce_eager=enforce_eager, **kwargs)
        if max_logprobs is not None and (isinstance(max_logprobs, bool) or not isinstance(
                max_logprobs, int) or max_logprobs < -1):
            raise ValueError(f"max_logprobs={max_logprobs!r}: must be None (no cap), -1 (the "
                             "whole vocabulary) or an integer >= 0")
        self.llm_engine = LLMEngine(config, progress=progress)
        self.last_summary: RunSummary | None = None
        self._requests_seen = ServerMetrics()
        self.max_logprobs = max_logprobs

    @classmethod
    def from_config(cls, config: EngineConfig, progress: bool = True) -> LLM:
        llm = cls.__new__(cls)
        llm.llm_engine = LLMEngine(config, progress=progress)
        llm.last_summary = None
        llm._requests_seen = ServerMetrics()
        llm.max_logprobs = None
        return llm

    def get_tokenizer(self):
        """The model's tokenizer as transformers loads it (vLLM's returns one, and code
        written for vLLM may call any of its methods), loaded on first call; None for a
        folder without one. The engine itself tokenizes with the same tokenizer.json read
        straight through `tokenizers` (models/tokenizer.py): the same token ids."""
        if self.llm_engine.tokenizer is None:
            return None
        from refserve.models.loader import load_hf_tokenizer

        return load_hf_tokenizer(self.llm_engine.model_path)

    def get_metrics(self) -> list[Metric]:
        """vLLM's `LLM.get_metrics()`: the metrics now, as Counter / Gauge / Histogram objects
        with vLLM's names and labels (refserve/entrypoints/metrics_reader.py lists them).
        Engine counters (preemptions, prefix cache, KV usage) count every request; the
        per-request ones (tokens, finish reasons, TTFT / TPOT / latency) count those that
        finished through `generate` and `chat`."""
        engine = self.llm_engine
        return metrics_snapshot(self._requests_seen, engine_gauges(engine),
                                str(engine.model_path))

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams]
                 | None = None, use_tqdm: bool = True,
                 on_step: Callable[[RequestOutput], None] | None = None,
                 priority: Sequence[int] | None = None,
                 tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """Generate for every prompt; outputs come back in prompt order.

        prompts: any of vLLM's forms (`parse_prompts`). sampling_params: one for all, or a
        sequence with one per prompt (None: `SamplingParams()`). Every prompt is validated
        before any is queued: a bad one raises ValueError naming its index and nothing is
        left behind. `on_step` (refserve's) sees every step's RequestOutput: streaming.
        `priority` (vLLM's): one per prompt, lower runs first; needs
        scheduling_policy="priority". `tokenization_kwargs` (vLLM's): only
        {"truncate_prompt_tokens": k}, keep each prompt's last k tokens (what
        SamplingParams.truncate_prompt_tokens, refserve's, does per request).
        """
        batch = parse_prompts(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(batch)
        elif isinstance(sampling_params, Sequence):
            params = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(sampling_params).__name__}")
        if len(params) != len(batch):
            raise ValueError(f"got {len(params)} sampling_params for {len(batch)} prompts")
        params = _with_tokenization(params, tokenization_kwargs)
        priorities = [0] * len(batch) if priority is None else list(priority)
        if len(priorities) != len(batch):
            raise ValueError(f"got {len(priorities)} priorities for {len(batch)} prompts")
        engine = self.llm_engine
        for i, (p, sp, prio) in enumerate(zip(batch, params, priorities)):
            try:
                engine.validate_request(p, sp)
                engine.check_priority(prio)
                self._check_logprobs(sp)
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from e
        return self._run(batch, params, use_tqdm, on_step, priorities)

    def chat(self, messages, sampling_params: SamplingParams | Sequence[SamplingParams]
             | None = None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             on_step: Callable[[RequestOutput], None] | None = None,
             tokenization_kwargs: dict | None = None) -> list[RequestOutput]:
        """vLLM's `LLM.chat`: one conversation (a list of {"role", "content"} dicts) or a
        list of conversations, each rendered with the model's chat template and generated.
        Raises ValueError when the model has no chat template (and none is given)."""
        if not isinstance(messages, Sequence) or isinstance(messages, str) or not messages:
            raise TypeError("messages must be a conversation (a list of {'role': ..., "
                            "'content': ...} dicts) or a list of conversations")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.llm_engine.apply_chat_template(
            conv, chat_template=chat_template, add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message) for conv in conversations]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, on_step=on_step,
                             tokenization_kwargs=tokenization_kwargs)

    def _check_logprobs(self, sp: SamplingParams) -> None:
        """logprobs and prompt_logprobs within max_logprobs (-1 counts as the vocabulary),
        with vLLM's rule and a message that says how to allow more."""
        cap = self.max_logprobs
        if cap is None:
            return
        vocab = self.llm_engine.model.config.vocab_size
        for name in ("logprobs", "prompt_logprobs"):
            asked = getattr(sp, name)
            wanted = vocab if asked == -1 else asked
            if asked is not None and wanted > (vocab if cap == -1 else cap):
                raise ValueError(f"SamplingParams.{name}={asked}: asks for {wanted} logprobs, "
                                 f"more than max_logprobs={cap} (LLM(max_logprobs=-1) allows "
                                 "the whole vocabulary)")

    def _run(self, batch, params, use_tqdm, on_step, priorities) -> list[RequestOutput]:
        """Queue the (validated) requests and step until all finish; on any exception
        (Ctrl-C included) abort what is left, so the engine is reusable."""
        engine = self.llm_engine
        stats_before = engine.stats()
        engine.kv_cache_manager.reset_peak()   # this call's peak, apart from the cumulative one
        start = time.perf_counter()
        ids = [engine.add_request(None, p, sp, priority=prio)
               for p, sp, prio in zip(batch, params, priorities)]
        results: dict[str, RequestOutput] = {}
        index = {rid: i for i, rid in enumerate(ids)}
        # Finished outputs in prompt order, None while running: what a Ctrl-C leaves.
        self.partial_outputs: list[RequestOutput | None] = [None] * len(ids)
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
                        self._requests_seen.count_prompt_tokens(len(o.prompt_token_ids))
                        self._requests_seen.observe_finished(o)
                        self.partial_outputs[index[o.request_id]] = o
                        bar.update(1)
        except BaseException:
            for rid in ids:
                if rid not in results:
                    engine.abort_request(rid)
            self.last_summary = self._summary(
                [results[r] for r in ids if r in results], start, stats_before)
            raise
        finally:
            bar.close()
        outputs = [results[r] for r in ids]
        self.last_summary = self._summary(outputs, start, stats_before)
        return outputs

    def _summary(self, outputs, start, stats_before) -> RunSummary:
        """Per-call figures: counters as differences over this call, the KV peak of this
        call (reset at its start)."""
        elapsed = time.perf_counter() - start
        stats = self.llm_engine.stats()
        delta = {k: stats[k] - stats_before.get(k, 0) for k in stats}
        delta["kv_blocks_peak"] = stats["kv_blocks_peak_since_reset"]
        delta["kv_blocks_total"] = stats["kv_blocks_total"]
        summary = summarize([o.metrics for o in outputs], elapsed, delta)
        spec = getattr(self.llm_engine, "speculative_config", None)
        if spec is not None:
            summary.speculative_method = spec.method
        return summary


def _with_tokenization(params: list[SamplingParams], kwargs: dict | None) -> list[SamplingParams]:
    """vLLM's `tokenization_kwargs` onto each request's params: refserve takes only
    truncate_prompt_tokens (keep the prompt's last k tokens, as vLLM does)."""
    if kwargs is None:
        return params
    if not isinstance(kwargs, dict) or set(kwargs) - {"truncate_prompt_tokens"}:
        raise ValueError(f"tokenization_kwargs={kwargs!r}: refserve takes only "
                         "{'truncate_prompt_tokens': k} here")
    k = kwargs.get("truncate_prompt_tokens")
    return [dataclasses.replace(sp, truncate_prompt_tokens=k) for sp in params]
