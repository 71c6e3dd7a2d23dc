"""The scheduler an EngineConfig asks for, built in one place for the real engine
(engine.py) and the simulator (simulator/engine.py), so that both run the same policies.

    batching="static"      StaticScheduler: batches formed first come first served, and
                           preemption by recompute (config.py refuses the other choices)
    batching="continuous"  Scheduler (PrefillFirstScheduler, prefill_first.py, with
                           enable_chunked_prefill=False) with the config's
                           scheduling_policy and preemption_mode; "swap" needs the host
                           pool (`host_pool`)
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from refserve.scheduler.prefill_first import PrefillFirstScheduler
from refserve.scheduler.scheduler import Scheduler
from refserve.scheduler.static import StaticScheduler

if TYPE_CHECKING:
    from refserve.config import EngineConfig
    from refserve.kv_cache.host_pool import HostBlockPool
    from refserve.kv_cache.kv_cache_manager import KVCacheManager


def make_scheduler(config: EngineConfig, kv_cache_manager: KVCacheManager,
                   max_model_len: int, eos_token_id: int | None = None,
                   host_pool: HostBlockPool | None = None) -> Scheduler:
    """The scheduler of `config` (its token budget already resolved) over
    `kv_cache_manager`; `host_pool`: swap preemption's, None with recompute."""
    common = (config.max_num_seqs, config.max_num_batched_tokens, kv_cache_manager,
              max_model_len)
    if config.batching == "static":
        return StaticScheduler(*common, eos_token_id=eos_token_id,
                               long_prefill_token_threshold=config.long_prefill_token_threshold)
    # vLLM's enable_chunked_prefill=False: prefill-only steps while there is prefill work.
    cls = Scheduler if config.enable_chunked_prefill else PrefillFirstScheduler
    return cls(*common, eos_token_id=eos_token_id,
               long_prefill_token_threshold=config.long_prefill_token_threshold,
               scheduling_policy=config.scheduling_policy,
               preemption_mode=config.preemption_mode, host_pool=host_pool)
