"""prefix_caching_policy="hash" | "radix" on the engine: the same outputs, the same metrics.

The manager-level invariants of both policies are the stateful test's
(test_kv_cache_stateful.py); here the tiny random model runs the branching shapes of the
prefix bench (a shared stem, branches, a growing transcript) through a pool small enough
that cached blocks are evicted, and greedy output must not depend on the policy."""

import numpy as np
import pytest

from refserve import LLM, SamplingParams
from refserve.config import EngineConfig
from refserve.entrypoints.cli_common import ArgumentParser
from refserve.entrypoints.engine_args import add_engine_args, engine_config_from_args

VOCAB = 97
GREEDY = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)


def branching_prompts(seed=0):
    """A stem shared by every prompt, two branches off it, and a transcript that grows."""
    rng = np.random.default_rng(seed)
    tokens = lambda n: rng.integers(3, VOCAB, size=n).tolist()  # noqa: E731
    stem, left, right = tokens(13), tokens(6), tokens(7)
    turns = [tokens(5) for _ in range(3)]
    prompts = [stem + left + tokens(3), stem + right + tokens(2), stem + left + tokens(4),
               stem + tokens(3)]
    transcript = stem[:]
    for turn in turns:
        transcript = transcript + turn
        prompts.append(transcript)
    return prompts


def run(tiny_llama, blocks, one_at_a_time, **kw):
    llm = LLM(model=str(tiny_llama), progress=False, block_size=4,
              num_gpu_blocks_override=blocks, max_num_seqs=2, max_model_len=40, **kw)
    prompts = branching_prompts()
    if one_at_a_time:  # later prompts find what earlier ones cached
        outs = [llm.generate([p], GREEDY, use_tqdm=False)[0] for p in prompts]
    else:
        outs = llm.generate(prompts, GREEDY, use_tqdm=False)
    llm.llm_engine.kv_cache_manager.check_invariants()
    return [o.outputs[0].token_ids for o in outs], llm.llm_engine.stats(), llm


@pytest.mark.parametrize("blocks, one_at_a_time", [(64, True), (16, True), (16, False)])
def test_greedy_output_is_the_same_off_hash_radix(tiny_llama, blocks, one_at_a_time):
    off, off_stats, _ = run(tiny_llama, blocks, one_at_a_time, enable_prefix_caching=False)
    hashed, hash_stats, _ = run(tiny_llama, blocks, one_at_a_time)
    radix, radix_stats, llm = run(tiny_llama, blocks, one_at_a_time,
                                  prefix_caching_policy="radix")
    assert off == hashed == radix
    assert off_stats["prefix_cache_hit_tokens"] == 0
    # Same workload, same queries; the tree finds at least what the chain finds.
    assert radix_stats["prefix_cache_queried_tokens"] >= hash_stats[
        "prefix_cache_queried_tokens"] > 0
    assert radix_stats["prefix_cache_hit_tokens"] >= hash_stats["prefix_cache_hit_tokens"] > 0
    kv = llm.llm_engine.kv_cache_manager
    assert kv.num_held_blocks == 0  # nothing leaks: every block free or cached
    assert kv.num_evictable_blocks + kv.num_free_blocks == kv.num_blocks
    assert kv.num_evictable_blocks == len(kv.cached_blocks()) > 0


def test_a_small_pool_evicts_under_both_policies(tiny_llama):
    for policy in ("hash", "radix"):
        _, stats, _ = run(tiny_llama, 16, True, prefix_caching_policy=policy)
        assert stats["prefix_cache_evictions"] > 0, policy


def test_radix_hits_the_stem_block_aligned(tiny_llama):
    """The second prompt shares 13 stem tokens with the first: 3 whole blocks of 4 hit (the
    13th token lies in a block that diverges), whatever the policy."""
    prompts = branching_prompts()
    for policy in ("hash", "radix"):
        llm = LLM(model=str(tiny_llama), progress=False, block_size=4,
                  num_gpu_blocks_override=64, prefix_caching_policy=policy)
        llm.generate([prompts[0]], GREEDY, use_tqdm=False)
        out = llm.generate([prompts[1]], GREEDY, use_tqdm=False)[0]
        assert out.metrics.num_cached_tokens == 12, policy


def test_the_flag_and_the_knob():
    parser = ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).prefix_caching_policy == "hash"
    args = parser.parse_args(["--prefix-caching-policy", "radix"])
    assert engine_config_from_args(args).prefix_caching_policy == "radix"
    with pytest.raises(ValueError, match="prefix_caching_policy='tree'"):
        EngineConfig(prefix_caching_policy="tree")


def test_the_tree_is_public_under_radix_only():
    from refserve.kv_cache import KVCacheManager
    from refserve.kv_cache.radix_cache import RadixCache

    assert KVCacheManager(8, 4).radix_tree is None
    assert KVCacheManager(8, 4, enable_prefix_caching=False,
                          prefix_caching_policy="radix").radix_tree is None
    tree = KVCacheManager(8, 4, prefix_caching_policy="radix").radix_tree
    assert isinstance(tree, RadixCache) and tree.num_cached_blocks == 0
