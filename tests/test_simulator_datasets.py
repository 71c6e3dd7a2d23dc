"""The workloads vLLM's benchmarks speak (refserve/benchmark_datasets.py): the length
statistics of the random and ShareGPT-like generators, and reading lengths from files."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from refserve import benchmark_datasets as ds
from refserve.simulator.workload import make_workload


def rng(seed=0):
    return np.random.default_rng(seed)


def test_random_lengths_are_exact_without_a_range_ratio():
    p, o = ds.random_lengths(rng(), 500, 1024, 128)
    assert set(p) == {1024} and set(o) == {128}


@pytest.mark.parametrize("ratio", [0.1, 0.5, 0.9])
def test_random_lengths_are_uniform_on_vllms_range(ratio):
    n, length = 40_000, 1000
    p, _ = ds.random_lengths(rng(1), n, length, 10, ratio)
    low, high = math.floor(length * (1 - ratio)), math.ceil(length * (1 + ratio))
    assert p.min() == low and p.max() == high  # both ends reached, nothing beyond
    # A discrete uniform on [low, high]: mean (low + high) / 2, variance ((k)^2 - 1) / 12.
    k = high - low + 1
    assert abs(p.mean() - (low + high) / 2) < 4 * math.sqrt((k * k - 1) / 12 / n)
    assert p.var() == pytest.approx((k * k - 1) / 12, rel=0.03)
    # Negative control: a one-sided spread [low, length] has the wrong mean.
    one_sided = rng(1).integers(low, length + 1, n)
    assert abs(one_sided.mean() - (low + high) / 2) > 10 * math.sqrt((k * k - 1) / 12 / n)


def test_random_lengths_refuse_bad_arguments():
    for kwargs, match in (({"range_ratio": 1.0}, "range_ratio"),
                          ({"input_len": 0}, "input_len"), ({"output_len": 2.5}, "output_len")):
        args = {"input_len": 8, "output_len": 8, "range_ratio": 0.0, **kwargs}
        with pytest.raises(ValueError, match=match):
            ds.random_lengths(rng(), 4, **args)


def test_clipped_lognormal_mean_matches_monte_carlo():
    mu, sigma, low, high = 5.0, 1.0, 4, 1024
    x = np.clip(rng(2).lognormal(mu, sigma, 400_000), low, high)
    assert ds.clipped_lognormal_mean(mu, sigma, low, high) == pytest.approx(x.mean(), rel=0.005)
    # Negative control: the unclipped mean exp(mu + sigma^2 / 2) is far off here.
    assert math.exp(mu + sigma**2 / 2) > 1.05 * x.mean()
    assert ds.clipped_lognormal_mean(ds.solve_mu(215, 1.0, 4, 1024), 1.0, 4, 1024) == \
        pytest.approx(215)


def test_sharegpt_lengths_have_the_published_means_and_vllms_limits():
    p, o = ds.sharegpt_lengths(rng(3), 50_000)
    assert p.min() >= 4 and p.max() <= 1024 and o.min() >= 1
    assert (p + o).max() <= 2048
    # The published means: 215 prompt tokens; 194 output tokens before the joint limit
    # (prompt + output <= 2048) trims the longest few.
    assert p.mean() == pytest.approx(215, rel=0.02)
    assert o.mean() == pytest.approx(194, rel=0.03)
    # Long-tailed, as chat is: the median prompt is well below the mean.
    assert np.median(p) < 0.8 * p.mean()


def test_sharegpt_file_lengths_with_vllms_filter(tmp_path):
    def conv(prompt_words, reply_words):
        return {"conversations": [{"from": "human", "value": " ".join(["w"] * prompt_words)},
                                  {"from": "gpt", "value": " ".join(["w"] * reply_words)}]}

    data = [conv(10, 20), conv(3, 20), conv(10, 2), conv(1100, 5), conv(1000, 1100),
            {"conversations": [{"from": "human", "value": "only one turn"}]}, "junk",
            conv(50, 60)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))

    def words(text):
        return len(text.split())

    assert ds.read_length_file(path, words) == [(10, 20), (50, 60)]
    p, o = ds.file_lengths(path, rng(), 5, words)
    assert sorted(zip(p, o))[:2] == [(10, 20), (10, 20)] and len(p) == 5
    assert set(zip(p, o)) == {(10, 20), (50, 60)}  # reused in turn when the file is short
    # Without a tokenizer: 4 characters a token ("w w w ..." of 10 words = 19 chars -> 5).
    assert ds.read_length_file(path)[0] == (5, 10)


def test_vllm_result_file_and_bad_files(tmp_path):
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"input_lens": [100, 200], "output_lens": [10, 20],
                                  "ttfts": [0.1, 0.2]}))
    assert ds.read_length_file(result) == [(100, 10), (200, 20)]
    bad = tmp_path / "bad.json"
    for text, match in (("{", "not JSON"), ('{"input_lens": [1], "output_lens": []}',
                                            "equally long"),
                        ('{"a": 1}', "expected a ShareGPT list"), ("[]", "no conversation")):
        bad.write_text(text)
        with pytest.raises(ValueError, match=match):
            ds.read_length_file(bad)
    with pytest.raises(ValueError, match="cannot read"):
        ds.read_length_file(tmp_path / "missing.json")


def test_simulator_workloads_use_the_generators(tmp_path):
    reqs = make_workload("random", 64, 4.0, vocab_size=1000, max_model_len=4096,
                         input_len=300, output_len=40, range_ratio=0.5, seed=5)
    lengths = [(r.num_prompt_tokens, r.num_output_tokens) for r in reqs]
    want = ds.random_lengths(np.random.default_rng([5, 1]), 64, 300, 40, 0.5)
    # The same length stream (the workload's second generator), in arrival order.
    assert sorted(lengths) == sorted(zip(want[0].tolist(), want[1].tolist()))
    offline = make_workload("sharegpt", 32, math.inf, vocab_size=1000, max_model_len=4096)
    assert all(r.arrival_time == 0.0 for r in offline)
    result = tmp_path / "result.json"
    result.write_text(json.dumps({"input_lens": [7, 9], "output_lens": [3, 4]}))
    reqs = make_workload("dataset", 4, 2.0, vocab_size=1000, max_model_len=4096,
                         dataset_path=result)
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in reqs} == {(7, 3), (9, 4)}
    with pytest.raises(ValueError, match="needs a dataset_path"):
        make_workload("dataset", 4, 2.0, vocab_size=1000, max_model_len=4096)


def test_loadtest_sends_the_same_workload_descriptions(tmp_path):
    """bench loadtest's --workload random / sharegpt / --dataset-path: the generators'
    lengths as token-id prompts and max_tokens."""
    import argparse

    from refserve.bench import loadtest

    p = argparse.ArgumentParser(allow_abbrev=False)
    loadtest.add_arguments(p)
    args = p.parse_args(["--workload", "random", "--input-len", "50", "--output-len", "6",
                         "--range-ratio", "0.2", "--rates", "inf"])
    reqs = loadtest.length_requests(args, 200, seed=3)
    want_p, want_o = ds.random_lengths(np.random.default_rng(3), 200, 50, 6, 0.2)
    assert [len(r["prompt"]) for r in reqs] == want_p.tolist()
    assert [r["max_tokens"] for r in reqs] == want_o.tolist()
    assert all(loadtest.PROMPT_IDS[0] <= t < loadtest.PROMPT_IDS[1]
               for r in reqs for t in r["prompt"])
    assert args.rates == [math.inf]
    result = tmp_path / "r.json"
    result.write_text(json.dumps({"input_lens": [5], "output_lens": [2]}))
    args = p.parse_args(["--dataset-path", str(result)])
    assert [(len(r["prompt"]), r["max_tokens"]) for r in
            loadtest.length_requests(args, 2, 0)] == [(5, 2), (5, 2)]
    assert loadtest.length_requests(p.parse_args([]), 2, 0) is None  # the corpus default
