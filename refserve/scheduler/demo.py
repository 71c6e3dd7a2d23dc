"""A stand-in model and a tiny workload, to watch the schedulers step by step:
`python -m refserve.scheduler`. The tests use the same stub model."""

from __future__ import annotations

import zlib

from refserve.kv_cache.kv_cache_manager import KVCacheManager
from refserve.scheduler.scheduler import Scheduler
from refserve.scheduler.static import StaticScheduler
from refserve.sequence import Sequence


def stub_next_token(request_id: str, position: int) -> int:
    """A stand-in model: the token sampled at `position` is a fixed function of the request
    and the position, so every request's output is known before it runs."""
    return zlib.crc32(f"{request_id}:{position}".encode()) % 1000 + 10


def run_stub(scheduler: Scheduler, requests: list[tuple[str, int, int]],
             verbose: bool = True) -> dict[str, list[int]]:
    """Run (request_id, prompt_len, max_tokens) requests to completion with the stub model;
    returns each request's output tokens."""
    from refserve.sampling_params import SamplingParams

    for request_id, prompt_len, max_tokens in requests:
        prompt = [1 + (i * 7) % 50 for i in range(prompt_len)]
        scheduler.add_sequence(Sequence(request_id, prompt, SamplingParams(max_tokens=max_tokens)))
    outputs: dict[str, list[int]] = {}
    while scheduler.has_unfinished():
        out = scheduler.schedule()
        sampled = {row.seq.seq_id: [stub_next_token(row.seq.request_id, row.end)]
                   for row in out.scheduled if row.num_logits}
        retired = scheduler.update(out, sampled).retired
        if verbose:
            print(out)
            for seq in retired:
                print(f"  retired {seq.seq_id} ({seq.request_id}): {seq.status.value}, "
                      f"{seq.num_output_tokens} tokens, {seq.num_preemptions} preemptions")
            print()
        for seq in retired:
            outputs[seq.request_id] = seq.output_token_ids
    return outputs


def main() -> None:
    requests = [("A", 40, 6), ("B", 7, 12), ("C", 12, 3), ("D", 5, 9), ("E", 20, 4)]
    results = {}
    for cls in (Scheduler, StaticScheduler):
        print(f"=== {cls.__name__} ({cls.batching} batching): max_num_seqs=3, "
              f"max_num_batched_tokens=16, 12 blocks of 4 tokens ===\n")
        kv = KVCacheManager(num_blocks=12, block_size=4, enable_prefix_caching=True)
        scheduler = cls(max_num_seqs=3, max_num_batched_tokens=16, kv_cache_manager=kv,
                        max_model_len=64)
        outputs = run_stub(scheduler, requests)
        results[cls.batching] = (outputs, scheduler)
    print("=== summary ===")
    for name, (_, s) in results.items():
        print(f"{name:>10}: {s.num_steps} steps, slot-steps used {s.slot_steps_used}, "
              f"wasted {s.slot_steps_wasted}, preemptions {s.num_preemptions}")
    same = results["continuous"][0] == results["static"][0]
    print(f"same outputs: {same}")
