"""`bench prefix` and `bench preemption` on the tiny random model (fast; the --quick runs on
the embedded SmolLM2 are test_bench_scenarios.py's, marked slow)."""

import json

from refserve.bench import main
from refserve.bench.branching import WORKLOADS, make_branching, shuffled


def test_branching_workloads_are_deterministic_and_branch():
    for name in WORKLOADS:
        a, b = make_branching(name, 16, 0, 5000), make_branching(name, 16, 0, 5000)
        assert a.prompts == b.prompts and a.prompts != make_branching(name, 16, 1, 5000).prompts
        # shared prefixes: the prompts' trie is smaller than the prompts
        assert 0 < a.distinct_tokens < a.prompt_tokens
        order = shuffled(a.prompts, 0)
        assert sorted(map(tuple, order)) == sorted(map(tuple, a.prompts))
        assert order != a.prompts


def test_prefix_bench_on_the_tiny_model(tmp_path, tiny_llama):
    path = tmp_path / "prefix.json"
    assert main(["prefix", "--model", str(tiny_llama), "--scale", "8", "--max-tokens", "2",
                 "--block-size", "4", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    rows = {(r["workload"], r["config"]): r for r in data["rows"]}
    for name in WORKLOADS:
        off, hashed, radix = (rows[(name, c)] for c in ("off", "hash", "radix"))
        assert off["cached_tokens"] == 0
        assert radix["cached_tokens"] >= hashed["cached_tokens"] > 0  # the rule
        for config in ("radix + fcfs", "radix + lpm"):
            assert rows[(name, config)]["prompt_tokens"] == off["prompt_tokens"]
    assert all(data["same_outputs"].values())


def test_preemption_bench_on_the_tiny_model(tmp_path, tiny_llama):
    path = tmp_path / "preemption.json"
    assert main(["preemption", "--model", str(tiny_llama), "--contexts", "12", "24",
                 "--num-requests", "4", "--max-tokens", "10", "--block-size", "4",
                 "--swap-space", "0.01", "--json", str(path)]) == 0
    data = json.loads(path.read_text())
    for r in data["rows"]:
        assert r["preemptions"] > 0
        assert (r["recomputed_tokens"] > 0) == (r["mode"] == "recompute")
        assert (r["swap_bytes"] > 0) == (r["mode"] == "swap")
    assert all(data["same_outputs"].values())
