"""The stop rules, decided token by token in `Scheduler.update` (refserve/sequence.py).

Two layers: `append_tokens` on one sequence with a one-letter-per-token tokenizer (so each
test says exactly which token completes a stop string), and the engine with speculative
decoding, where a verify step emits up to k + 1 tokens at once and must stop exactly where a
plain run stops: same token ids, text, finish and stop reasons, usage, and counters that add
up (output tokens = target passes + accepted drafts)."""

from __future__ import annotations

import numpy as np
import pytest
from model_utils import LetterTokenizer, save_numpy_llama

from refserve import LLM, SamplingParams
from refserve.kv_cache.kv_cache_manager import KVCacheManager
from refserve.scheduler import Proposal, Scheduler
from refserve.sequence import (
    IncrementalDetokenizer,
    Sequence,
    SequenceStatus,
    append_tokens,
    find_stop_string,
)
from refserve.spec_decode.proposer import Proposer

STOPPED, LENGTH = SequenceStatus.FINISHED_STOPPED, SequenceStatus.FINISHED_LENGTH
EOS = 25  # "Z" in the letter tokenizer's alphabet, but a special token: decodes to nothing


def ids(text: str) -> list[int]:
    return [ord(c) - ord("A") for c in text]


def letter_seq(**params) -> Sequence:
    seq = Sequence("r", [0, 1, 2], SamplingParams(**params), seq_id=0)
    seq.detokenizer = IncrementalDetokenizer(LetterTokenizer(eos_token_id=EOS))
    return seq


def visible(seq: Sequence) -> str:
    text = seq.detokenizer.text
    return text if seq.output_text_end is None else text[:seq.output_text_end]


# ---- one sequence, token by token -------------------------------------------------------

@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_stops_at_the_token_that_completes_it(include):
    seq = letter_seq(max_tokens=50, stop=["CD"], include_stop_str_in_output=include)
    status = append_tokens(seq, ids("ABCDEF"), EOS, 100)
    assert status is STOPPED, f"appending ABCDEF with stop 'CD' returned {status}"
    assert seq.stop_reason == "CD", f"stop_reason {seq.stop_reason!r}"
    assert seq.output_token_ids == ids("ABCD"), \
        f"output tokens {seq.output_token_ids}: D completes 'CD', so E and F are never appended"
    want = "ABCD" if include else "AB"
    assert visible(seq) == want, \
        f"visible text {visible(seq)!r} with include_stop_str_in_output={include}"


def test_a_stop_string_straddling_two_appends_is_found():
    seq = letter_seq(max_tokens=50, stop=["BCD"])
    assert append_tokens(seq, ids("AB"), EOS, 100) is None, "AB alone completes no 'BCD'"
    assert append_tokens(seq, ids("CDE"), EOS, 100) is STOPPED, \
        "'BCD' straddles the two appends: D completes it"
    assert seq.output_token_ids == ids("ABCD"), f"output tokens {seq.output_token_ids}"
    assert visible(seq) == "A", f"visible text {visible(seq)!r}"


def test_the_earliest_match_wins_not_the_first_listed():
    # Token C completes both strings; "ABC" starts earlier in the text than "BC".
    seq = letter_seq(max_tokens=50, stop=["BC", "ABC"])
    assert append_tokens(seq, ids("ABCD"), EOS, 100) is STOPPED, "C completes both strings"
    assert seq.stop_reason == "ABC", f"stop_reason {seq.stop_reason!r}: 'ABC' starts earlier"
    assert visible(seq) == "", f"visible text {visible(seq)!r}"
    # ... and a string completed by an earlier token wins over one completed later.
    seq = letter_seq(max_tokens=50, stop=["CDE", "B"])
    append_tokens(seq, ids("ABCDE"), EOS, 100)
    assert seq.stop_reason == "B", f"stop_reason {seq.stop_reason!r}: B is completed first"
    assert seq.output_token_ids == ids("AB"), f"output tokens {seq.output_token_ids}"


def test_find_stop_string_searches_only_what_the_new_text_can_complete():
    assert find_stop_string("XXABC", 4, ["ABC", "C"]) == (2, "ABC"), "the earliest start"
    assert find_stop_string("ABCXX", 4, ["ABC"]) is None, "'ABC' ended before the new text"
    assert find_stop_string("AB", 1, ["ABC"]) is None, "'ABC' is not complete"


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_token_id_stops_and_its_text_is_left_out(include):
    seq = letter_seq(max_tokens=50, stop_token_ids=[ids("C")[0]],
                     include_stop_str_in_output=include)
    assert append_tokens(seq, ids("ABCD"), EOS, 100) is STOPPED, "C is a stop token id"
    assert seq.output_token_ids == ids("ABC"), f"output tokens {seq.output_token_ids}"
    assert seq.stop_reason == ids("C")[0], f"stop_reason {seq.stop_reason!r}: the stop id"
    want = "ABC" if include else "AB"
    assert visible(seq) == want, \
        f"visible text {visible(seq)!r} with include_stop_str_in_output={include}"


def test_eos_stops_with_no_stop_reason_unless_ignored():
    seq = letter_seq(max_tokens=50)
    assert append_tokens(seq, [0, 1, EOS, 2], EOS, 100) is STOPPED, "EOS stops"
    assert seq.output_token_ids == [0, 1, EOS], f"output tokens {seq.output_token_ids}"
    assert seq.stop_reason is None, f"stop_reason {seq.stop_reason!r}: EOS leaves it None"
    seq = letter_seq(max_tokens=4, ignore_eos=True)
    status = append_tokens(seq, [0, EOS, 1, 2, 3], EOS, 100)
    assert status is LENGTH, f"ignore_eos: {status}, want the length limit"
    assert seq.num_output_tokens == 4, f"{seq.num_output_tokens} output tokens, max_tokens 4"


@pytest.mark.parametrize("rule, tokens, stopped_at", [
    (dict(stop=["AB"]), ids("ABAB"), 4),
    (dict(stop_token_ids=[1]), ids("ABAB"), 4),
    (dict(), [0, EOS, 0, EOS], 4),
    (dict(stop=["BC"]), ids("ABCD"), 3),  # may START in the first min_tokens tokens
])
def test_nothing_stops_before_min_tokens(rule, tokens, stopped_at):
    """vLLM checks no stop condition until min_tokens tokens exist: output token i may stop
    the sequence only when i > min_tokens (here 2: the stop at token 2 is ignored)."""
    seq = letter_seq(max_tokens=50, min_tokens=2, **rule)
    assert append_tokens(seq, tokens, EOS, 100) is STOPPED, f"{rule} never stopped"
    assert seq.num_output_tokens == stopped_at, \
        f"{rule}, min_tokens 2: stopped after {seq.num_output_tokens} tokens, not {stopped_at}"


def test_length_limits_cut_a_run_and_a_stop_on_that_token_wins():
    seq = letter_seq(max_tokens=3)
    assert append_tokens(seq, ids("ABCDE"), EOS, 100) is LENGTH, "max_tokens 3 stops it"
    assert seq.output_token_ids == ids("ABC"), f"output tokens {seq.output_token_ids}"
    assert seq.stop_reason is None, f"stop_reason {seq.stop_reason!r} at the length limit"
    seq = letter_seq(max_tokens=3, stop=["BC"])
    status = append_tokens(seq, ids("ABCDE"), EOS, 100)
    assert status is STOPPED, f"{status}: the 3rd token completes 'BC' and a stop wins"
    assert seq.stop_reason == "BC", f"stop_reason {seq.stop_reason!r}"
    assert visible(seq) == "A", f"visible text {visible(seq)!r}"
    seq = letter_seq(max_tokens=None)  # prompt 3 + 4 outputs reach max_model_len 7
    assert append_tokens(seq, ids("ABCDE"), EOS, 7) is LENGTH, "max_model_len 7 stops it"
    assert seq.num_tokens == 7, f"{seq.num_tokens} tokens, max_model_len 7"


# ---- through the scheduler: a verify row cut by a stop ----------------------------------

def test_update_keeps_only_the_tokens_before_the_stop_and_rolls_back_the_rest():
    kv = KVCacheManager(num_blocks=16, block_size=2)
    sched = Scheduler(4, 64, kv, max_model_len=64, eos_token_id=EOS)
    seq = letter_seq(max_tokens=30, stop=["CD"])
    seq.seq_id = None
    sched.add_sequence(seq)
    out = sched.schedule()
    sched.update(out, {seq.seq_id: ids("A")})  # prefill samples A
    out = sched.schedule({seq.seq_id: Proposal(ids("BCDE"))})
    (row,) = out.scheduled
    assert row.draft_token_ids == tuple(ids("BCDE")), "the row verifies all four drafts"
    update = sched.update(out, {seq.seq_id: ids("BCDEF")})  # all accepted + bonus F
    assert update.appended[seq.seq_id] == ids("BCD"), \
        f"appended {update.appended[seq.seq_id]}: D completes 'CD', so E and F are dropped"
    assert update.retired == [seq], "the stop retires the sequence in this update"
    assert seq.status is STOPPED, f"status {seq.status}"
    # the row kept 3 tokens: a pass plus 2 accepted drafts (the rest were never needed)
    assert update.verified[seq.seq_id] == (2, 2), \
        f"verified (proposed, accepted) {update.verified[seq.seq_id]}"
    assert kv.num_held_blocks == 0, f"{kv.num_held_blocks} blocks held after the retirement"
    kv.check_invariants()


# ---- the engine: speculation stops where a plain run stops ------------------------------

class OracleProposer(Proposer):
    """Proposes the plain run's own continuation: every draft is accepted."""

    def __init__(self, continuation: list[int]):
        self.continuation = continuation
        self.asked: list[int] = []  # num_output_tokens of each sequence asked

    def propose(self, seqs, num_drafts):
        self.asked += [s.num_output_tokens for s in seqs]
        return [Proposal(self.continuation[s.num_output_tokens:s.num_output_tokens + n])
                for s, n in zip(seqs, num_drafts)]


PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama whose greedy output is varied (written with NumPy: no torch)."""
    return save_numpy_llama(tmp_path_factory.mktemp("stops"), vocab_size=320,
                            hidden_size=32, intermediate_size=64, init_std=0.3)


def letter_llm(folder, k: int | None = None, continuation=None):
    spec = None if k is None else {"method": "ngram", "num_speculative_tokens": k,
                                   "adaptive": False}
    llm = LLM(model=str(folder), backend="numpy", progress=False, block_size=2,
              speculative_config=spec)
    llm.llm_engine.tokenizer = LetterTokenizer()
    if k is not None:
        llm.llm_engine.speculator.proposer = OracleProposer(continuation)
    return llm


@pytest.fixture(scope="module")
def plain_tokens(tiny):
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    (out,) = letter_llm(tiny).generate([PROMPT], params, use_tqdm=False)
    return out.outputs[0].token_ids


def first_end_at_or_after(text: str, e: int, length: int) -> int:
    """The first index >= e where text[i - length + 1 : i + 1] occurs nowhere earlier."""
    for i in range(max(e, length - 1), len(text)):
        piece = text[i - length + 1:i + 1]
        if text.find(piece) == i - length + 1:
            return i
    raise AssertionError(f"no stop string of {length} letters ends at or after {e} in {text}")


def verify_offset(i: int, k: int) -> int:
    """Where output token i sits in its verify step (token 0 comes from the prefill; with
    every draft accepted, step j emits tokens 1 + j(k+1) .. (j+1)(k+1)): 0 = first draft,
    k = bonus."""
    return (i - 1) % (k + 1)


def run_both(folder, plain_tokens, k, params):
    (plain,) = letter_llm(folder).generate([PROMPT], params, use_tqdm=False)
    llm = letter_llm(folder, k, plain_tokens)
    (spec,) = llm.generate([PROMPT], params, use_tqdm=False)
    held = llm.llm_engine.kv_cache_manager.num_held_blocks
    assert held == 0, f"{held} blocks held after the speculative run"
    return plain, spec


def assert_same(plain, spec):
    p, s = plain.outputs[0], spec.outputs[0]
    assert s.token_ids == p.token_ids, "speculative and plain runs: the same token ids"
    assert s.text == p.text, f"speculative text {s.text!r}, plain {p.text!r}"
    assert s.finish_reason == p.finish_reason, \
        f"finish_reason: speculative {s.finish_reason}, plain {p.finish_reason}"
    assert s.stop_reason == p.stop_reason, \
        f"stop_reason: speculative {s.stop_reason!r}, plain {p.stop_reason!r}"
    pm, sm = plain.metrics, spec.metrics
    assert sm.num_output_tokens == pm.num_output_tokens == len(p.token_ids), \
        "num_output_tokens counts the tokens kept"
    # each target pass emits one token plus its accepted drafts, nothing the user never saw
    assert sm.num_target_passes + sm.num_spec_accepted == pm.num_target_passes, \
        "target passes + accepted drafts = output tokens"
    assert 0 <= sm.num_spec_accepted <= sm.num_spec_proposed, "accepted <= proposed"


@pytest.mark.parametrize("k, where", [
    (k, where) for k in (1, 4, 8) for where in ("first draft", "middle draft", "bonus", "straddle")
    if not (k == 1 and where == "middle draft")])  # k = 1: one draft, no middle
@pytest.mark.parametrize("include", [False, True])
def test_spec_stop_string_equals_the_plain_run(tiny, plain_tokens, k, where, include):
    text = LetterTokenizer().decode(plain_tokens)
    want = {"first draft": 0, "middle draft": k // 2, "bonus": k, "straddle": 0}[where]
    length = 3 if where == "straddle" else 2
    e = 1 + k + 1  # look from the second verify step on
    while True:
        e = first_end_at_or_after(text, e, length)
        if verify_offset(e, k) == want:
            break
        e += 1
    if where == "straddle":
        assert verify_offset(e - 1, k) == k  # the string starts in the previous step
    stop = text[e - length + 1:e + 1]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, stop=[stop],
                            include_stop_str_in_output=include)
    plain, spec = run_both(tiny, plain_tokens, k, params)
    assert plain.outputs[0].token_ids == plain_tokens[:e + 1], \
        f"the plain run with stop {stop!r} did not stop after token {e}"
    assert plain.outputs[0].stop_reason == stop, "stop_reason of the plain run"
    assert_same(plain, spec)


@pytest.mark.parametrize("k", [1, 4, 8])
def test_spec_stop_token_id_and_max_tokens_inside_the_run(tiny, plain_tokens, k):
    e = 1 + k + 1 + k // 2  # a middle draft of the second verify step
    while plain_tokens.index(plain_tokens[e]) != e:
        e += 1
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True,
                            stop_token_ids=[plain_tokens[e]])
    plain, spec = run_both(tiny, plain_tokens, k, params)
    assert plain.outputs[0].stop_reason == plain_tokens[e], "stop_reason of the plain run"
    assert_same(plain, spec)
    params = SamplingParams(max_tokens=1 + k + 1 + k // 2, temperature=0.0, ignore_eos=True)
    assert_same(*run_both(tiny, plain_tokens, k, params))


def test_no_drafts_are_proposed_before_min_tokens(tiny, plain_tokens):
    params = SamplingParams(max_tokens=30, min_tokens=6, temperature=0.0, ignore_eos=True)
    llm = letter_llm(tiny, 4, plain_tokens)
    (out,) = llm.generate([PROMPT], params, use_tqdm=False)
    proposer = llm.llm_engine.speculator.proposer
    assert proposer.asked and min(proposer.asked) >= 6, \
        f"drafts asked for at {sorted(set(proposer.asked))} output tokens, min_tokens 6"
    assert out.outputs[0].token_ids == plain_tokens[:30], "the plain run's 30 tokens"


# ---- the text the stop strings read ----------------------------------------------------


def test_stop_string_completed_by_the_last_token(tiny):
    llm = LLM(model=str(tiny), progress=False, block_size=4, num_gpu_blocks_override=256)
    llm.llm_engine.tokenizer = LetterTokenizer()
    for seed in range(50):  # a seeded run whose last two letters occur only at the end
        params = SamplingParams(max_tokens=6, temperature=1.0, seed=seed, ignore_eos=True)
        base = llm.generate([[5, 6, 7]], params)[0].outputs[0]
        stop = base.text[-2:]  # completed by the 6th (last allowed) token
        if base.text.find(stop) == 4:
            break
    assert base.finish_reason == "length" and base.text.find(stop) == 4, \
        "no seed in 50 gave a text whose last two letters occur only at its end"
    params.stop = [stop]
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    assert out.finish_reason == "stop", \
        f"stop {stop!r}, completed by the last allowed token: finish {out.finish_reason}"
    assert out.text == base.text[:4], f"text {out.text!r}, want {base.text[:4]!r}"


@pytest.mark.slow
def test_incremental_detokenization_equals_a_full_decode(hf_tokenizer):
    text = ("Paris est la capitale 🇫🇷 de la France. 東京は日本の首都です。 "
            "def f(x):\n    return x ** 2  # naïve café — ok?")
    ids = hf_tokenizer.encode(text, add_special_tokens=False) + [hf_tokenizer.eos_token_id]
    rng = np.random.default_rng(0)
    detok = IncrementalDetokenizer(hf_tokenizer)
    end = 0
    while end < len(ids):  # grow by 1..3 tokens, as plain and speculative steps do
        end = min(len(ids), end + int(rng.integers(1, 4)))
        detok.update(ids[:end])
        assert hf_tokenizer.decode(ids[:end], skip_special_tokens=True).startswith(detok.text)
    assert detok.text == hf_tokenizer.decode(ids, skip_special_tokens=True)
