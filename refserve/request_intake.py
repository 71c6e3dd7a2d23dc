"""Requests in and out of the engine: vLLM's add_request / abort_request, what a request
must satisfy before the engine takes it, and the text <-> token helpers the requests use.
`LLMEngine` inherits these methods (refserve/engine.py), which read and write only its
requests, tokenizer, model config, max_model_len, config, scheduler and observer.

Every check runs before anything is allocated (no block, no sequence), so a bad request is
one ValueError naming the problem and nothing else changes: one bad request never takes
down the engine or another request. The checks, in order (validate_request):

    params        a SamplingParams whose fields are valid (SamplingParams.validate)
    prompt        one of refserve/inputs.py's forms; not empty; every id in 0..vocab-1
    params' ids   logit_bias / allowed_token_ids / stop_token_ids inside the vocabulary;
                  bad_words need a tokenizer
    truncation    truncate_prompt_tokens keeps the last N prompt tokens (vLLM's rule)
    fit           the prompt is at most max_model_len, its blocks (with the first
                  sampled token) fit the whole pool, n <= max_num_seqs (check_fits)
"""

from __future__ import annotations

import time

import numpy as np

from refserve.inputs import parse_prompt
from refserve.logits_processors import bad_words_token_ids
from refserve.metrics import RequestMetrics
from refserve.output_processor import RequestState
from refserve.prompt_logprobs import score_prompt
from refserve.sampling import make_generator
from refserve.sampling_params import SamplingParams
from refserve.sequence import IncrementalDetokenizer, Sequence


class RequestIntake:
    """The request-side methods of LLMEngine (see the module docstring)."""

    # ---- requests in and out (vLLM's names) --------------------------------------------

    def add_request(self, request_id: str | None, prompt,
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> str:
        """vLLM's `add_request(request_id, prompt, params, arrival_time, priority)`: queue
        one request; its outputs come from `step()`. `prompt`: text, token ids or a prompt
        dict (refserve/inputs.py); request_id None picks a fresh one (refserve's extra).
        `priority` (vLLM's): lower runs first, only with scheduling_policy="priority".
        Returns the request id."""
        params = params or SamplingParams()
        self.check_priority(priority)
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
        req = RequestState(
            request_id=request_id, prompt=prompt if isinstance(prompt, str) else None,
            prompt_token_ids=token_ids, params=params,
            metrics=RequestMetrics(arrival_time=now, num_prompt_tokens=len(token_ids)),
            seed=seed)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = score_prompt(self, token_ids, params.prompt_logprobs)
        seq = Sequence(request_id, token_ids, params, now)
        seq.bad_words_token_ids = self.bad_words_token_ids(params)
        # The stop rules grow the text token by token (refserve/sequence.py).
        if self.tokenizer is not None and params.detokenize:
            seq.detokenizer = IncrementalDetokenizer(self.tokenizer, params.skip_special_tokens,
                                                     params.spaces_between_special_tokens)
        seq.priority = priority
        seq.generator = make_generator(seed, 0)
        self.scheduler.add_sequence(seq)  # gives the sequence its id
        req.seqs.append(seq)
        self.requests[request_id] = req
        if self.observer is not None:
            self.observer.arrive(request_id, now)
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
        if self.observer is not None:
            self.observer.abort(request_id, time.perf_counter())
        return True

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"{self.model_path} has no tokenizer; pass prompt token ids")
        return self.tokenizer.encode(prompt, add_special_tokens=False)

    def decode_token(self, token_id: int) -> str | None:
        """One token's text (Logprob.decoded_token), remembered: logprobs=-1 asks for every
        token of the vocabulary at every step."""
        if self.tokenizer is None:
            return None
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = self.tokenizer.decode([token_id])
        return text

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
        sampling_params.check_vocab(vocab)
        self.bad_words_token_ids(sampling_params)          # refused now, not mid-run
        keep = sampling_params.truncate_prompt_tokens
        if keep is not None:        # vLLM's left truncation; -1: the last max_model_len
            token_ids = token_ids[-(self.max_model_len if keep == -1 else keep):]
        self.scheduler.check_fits(len(token_ids), sampling_params.n)
        return [int(t) for t in token_ids]

    def bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        """`params.bad_words` as token sequences (logits_processors.py, rule b); ValueError
        naming the field when there is no tokenizer to read them."""
        if not params.bad_words:
            return []
        if self.tokenizer is None:
            raise ValueError(f"SamplingParams.bad_words={params.bad_words!r}: the model "
                             f"{self.model_path} has no tokenizer to turn words into tokens")
        return bad_words_token_ids(params.bad_words, self.tokenizer)

    def check_priority(self, priority) -> None:
        """vLLM's rule: a priority other than 0 needs scheduling_policy="priority"."""
        if isinstance(priority, bool) or not isinstance(priority, (int, np.integer)):
            raise ValueError(f"priority={priority!r}: must be an integer (lower runs first)")
        if priority != 0 and self.config.scheduling_policy != "priority":
            raise ValueError(f"priority={priority} given, but scheduling_policy is "
                             f"{self.config.scheduling_policy!r}; use "
                             "scheduling_policy='priority'")
