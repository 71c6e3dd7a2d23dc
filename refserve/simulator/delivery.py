"""When a simulated token reaches its client, as steps (the fit's spans of steps).

A token is sampled in a step, its outputs are processed when that step ends (or, with
asynchronous output processing, while the next one runs: cost_model.py), a multi-step
round delivers its tokens together when it ends (multi_step.py), and an HTTP front end
adds its delay. `SimulatedEngine.run` records every delivery here, so that a metric's time
can be written as a sum of step times (refserve/simulator/world_replay.py).
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field


@dataclass
class DeliverySteps:
    """When each request's tokens reached its client, as steps: a delivery is (the step
    at whose end its outputs were processed, the step that sampled them: its delay
    applies). `first` / `last` per request, `gaps` every inter-token gap's two
    deliveries in `SimResult.itl`'s order, `lane` the steps whose output lane delayed
    their own delivery (async_output, no step after them). The spans of steps a metric's
    time is made of (refserve/simulator/world_replay.py fits on them)."""

    first: dict[str, tuple[int, int]] = field(default_factory=dict)
    last: dict[str, tuple[int, int]] = field(default_factory=dict)
    gaps: array = field(default_factory=lambda: array("q"))
    lane: set = field(default_factory=set)

    def deliver(self, request_id: str, at: int, sampled: int) -> None:
        if request_id in self.last:
            self.gaps.extend((*self.last[request_id], at, sampled))
        else:
            self.first[request_id] = (at, sampled)
        self.last[request_id] = (at, sampled)


__all__ = ["DeliverySteps"]
