"""The simulator: refserve's real control plane at GPU scale, on a laptop.

The real `Scheduler` and `KVCacheManager` run on a virtual clock; only the model forward is
replaced, by a roofline cost model of the step's composition on a GPU profile. Modules:

    hardware.py    GPU profiles (gpus.toml: every number with its source) and model shapes
    composition.py what a step computes: the sums the cost model prices
    cost_model.py  the step time: roofline terms, precision, the host's terms
    multi_step.py  vLLM V0's --num-scheduler-steps rounds around the real scheduler
    delivery.py    when a simulated token reaches its client, as steps
    engine_overheads.py, engines.toml   each serving engine's host terms, as data
    step_fit.py    `fit` of the efficiencies to measured steps; `replay` of measured times
    world.py, measurements/   published GPU measurements (one file per source), replayed
    world_fit.py, bounds.py, bounds.toml   the fit of the constants, each inside its
                   physical range; world_validate.py: leave a source or an engine out
    workload.py    arrivals (Poisson, bursty), length distributions, shared prefixes, traces
    engine.py      `SimulatedEngine`: schedule, price, update; the real engine's metrics
    outputs.py     what the "model" emits: the next tokens; speculation's drawn acceptance
    trace.py       Chrome trace-event JSON: a track per request and one for the steps

Commands: `python -m refserve.simulate` (one configuration) and `python -m refserve.plan`
(search configurations under SLOs; prints the `vllm serve` line). The simulator sits on the
top floor beside the command lines: it imports the core, and no core module imports it.
"""

from refserve.simulator.cost_model import CostModel, Efficiencies, StepComposition
from refserve.simulator.engine import SimResult, SimulatedEngine
from refserve.simulator.hardware import GpuProfile, ModelShape, load_gpu, load_model
from refserve.simulator.outputs import SimulatedSpeculation, SyntheticOutputs
from refserve.simulator.step_fit import fit
from refserve.simulator.trace import TraceRecorder
from refserve.simulator.workload import SimRequest, load_trace, make_workload

__all__ = ["CostModel", "Efficiencies", "GpuProfile", "ModelShape", "SimRequest", "SimResult",
           "SimulatedEngine", "SimulatedSpeculation", "StepComposition", "SyntheticOutputs",
           "TraceRecorder", "fit", "load_gpu", "load_model", "load_trace", "make_workload"]
