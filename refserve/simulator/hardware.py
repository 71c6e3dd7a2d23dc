"""What the simulator assumes about the machine and the model: GPU profiles and model shapes.

A `GpuProfile` is data: memory, dense peak FLOP/s per dtype, memory bandwidth, interconnect
and host-link bandwidth, an hourly price, and the cost model's efficiencies (priors until
`step_fit.fit` or bench sim-world measures them). The built-in profiles live in `gpus.toml`
beside this file, each number with the source it was taken from; every one of them is an
assumption the user can override:

    load_gpu("h100-80gb")                                   a built-in profile
    load_gpu("my-gpu", hardware_file="gpus.toml")           a profile from the user's file
    load_gpu("h100-80gb", overrides={"usd_per_hour": 3.1})  one number replaced
    host_profile(measure_ceilings(...))                     "this machine", from the
                                                            `roofline` bench's measurement

A `ModelShape` is the part of an HF config.json the cost model reads (layers, widths,
heads, vocabulary), from a capacity preset (`llama-3-8b`, ...) or any config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from refserve import capacity
from refserve.engine_setup import PoolShape

PROFILES_FILE = Path(__file__).with_name("gpus.toml")
THIS_MACHINE = "this-machine"


@dataclass(frozen=True)
class GpuProfile:
    """One device. Units: bytes, FLOP/s, bytes/s, seconds, dollars (see gpus.toml)."""

    key: str
    name: str
    memory_bytes: int
    peak_flops: dict[str, float]
    memory_bandwidth: float
    interconnect_bandwidth: float
    allreduce_latency_s: float
    host_link_bandwidth: float
    reserved_bytes: int
    usd_per_hour: float
    flops_efficiency: float
    bandwidth_efficiency: float
    attention_efficiency: float
    step_overhead_s: float
    row_overhead_s: float
    # "gpu": the KV pool is sized by gpu_memory_utilization of memory_bytes, like vLLM;
    # "host": by kv_cache_memory_bytes, like refserve's CPU backends.
    kind: str = "gpu"
    # e_kv: the fraction of the bandwidth the paged KV gather reaches, when it differs from
    # the weight read's (0: the same as bandwidth_efficiency)
    kv_bandwidth_efficiency: float = 0.0
    # the fraction of the fp8 peak the fp8 GEMMs (--quantization fp8) reach, when it
    # differs from flops_efficiency (0: the same)
    fp8_flops_efficiency: float = 0.0
    # The GPU's fixed seconds per kernel (cost_model.py's "kernels" term; 0: not priced)
    kernel_gap_s: float = 0.0
    # Queries and keys per tile of the attention kernel (0: exact query-key pairs, as the
    # NumPy engine computes them; a GPU profile prices FlashAttention's tiles)
    attention_tile: int = 0
    # NCCL's ring all-reduce: each of its 2 (p - 1) steps' latency, on top of
    # allreduce_latency_s (0: a flat latency; cost_model.py)
    allreduce_hop_s: float = 0.0
    # A custom one-shot all-reduce's latency (vLLM's, SGLang's, TensorRT-LLM's, PyTorch's
    # intra-node one; 0: the same as allreduce_latency_s)
    custom_allreduce_latency_s: float = 0.0
    # The fraction of the shorter of a GEMM's compute and weight-stream times hidden under
    # the longer (cost_model.overlapped; 1: the roofline's max)
    gemm_overlap: float = 1.0
    source: dict[str, str] = field(default_factory=dict)

    def peak(self, dtype: str) -> float:
        if dtype not in self.peak_flops:
            raise ValueError(f"{self.name} has no {dtype} peak in its profile (it has "
                             f"{', '.join(self.peak_flops)}); choose --dtype among those")
        return self.peak_flops[dtype]

    def describe(self, dtype: str) -> list[str]:
        """The assumptions, one line each, for the simulator's header."""
        src = self.source
        return [
            f"{self.name}: {self.memory_bytes / 2**30:.1f} GiB ({src.get('memory_bytes', '')})",
            f"  peak {self.peak(dtype) / 1e12:.1f} TFLOP/s {dtype} dense "
            f"({src.get('peak_flops', '')})",
            f"  bandwidth {self.memory_bandwidth / 1e9:.0f} GB/s "
            f"({src.get('memory_bandwidth', '')})",
            f"  interconnect {self.interconnect_bandwidth / 1e9:.0f} GB/s each way, "
            f"all-reduce latency {self.allreduce_latency_s * 1e6:.0f} us "
            f"({src.get('interconnect_bandwidth', '')})",
            f"  ${self.usd_per_hour:.2f}/hour ({src.get('usd_per_hour', '')})",
            f"  efficiencies: GEMM {self.flops_efficiency:.0%}, bandwidth "
            f"{self.bandwidth_efficiency:.0%}, attention {self.attention_efficiency:.0%}, "
            + (f"overhead {self.step_overhead_s * 1e3:.2f} ms/step + "
               f"{self.row_overhead_s * 1e6:.1f} us/row" if self.kind == "host" else
               "host terms from the engine profile (engines.toml)")
            + f" ({src.get('efficiencies', '')})",
        ]


_FIELDS = {f.name: f for f in dataclasses.fields(GpuProfile)}
_NUMBERS = [name for name, f in _FIELDS.items()
            if f.type in ("int", "float") and name != "key"]


def read_table_file(path: Path) -> dict:
    """A TOML or JSON file of profiles: {key: {field: value, ..., "source": {...}}}."""
    if not path.is_file():
        raise ValueError(f"hardware file {path} does not exist")
    text = path.read_bytes()
    if path.suffix == ".json":
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"hardware file {path}: not JSON ({e})") from None
    else:
        try:
            import tomllib
        except ImportError:  # Python 3.10
            try:
                import tomli as tomllib
            except ImportError:
                raise ValueError(f"reading {path} needs Python >= 3.11 (tomllib) or "
                                 "`pip install tomli`; or give a .json file") from None
        try:
            data = tomllib.loads(text.decode())
        except tomllib.TOMLDecodeError as e:
            raise ValueError(f"hardware file {path}: not TOML ({e})") from None
    if not isinstance(data, dict) or not all(isinstance(v, dict) for v in data.values()):
        raise ValueError(f"hardware file {path}: expected one table per GPU, "
                         '{"my-gpu": {"memory_bytes": ..., ...}}')
    return data


def builtin_gpus() -> dict[str, dict]:
    return read_table_file(PROFILES_FILE)


def gpu_names(hardware_file: Path | None = None) -> list[str]:
    names = list(builtin_gpus())
    if hardware_file is not None:
        names += [k for k in read_table_file(Path(hardware_file)) if k not in names]
    return names + [THIS_MACHINE]


def _profile(key: str, table: dict, origin: str) -> GpuProfile:
    values = {k: v for k, v in table.items() if k in _FIELDS}
    unknown = sorted(set(table) - set(_FIELDS))
    if unknown:
        raise ValueError(f"GPU profile {key!r} ({origin}): unknown field(s) "
                         f"{', '.join(unknown)}; fields are {', '.join(_NUMBERS)}")
    missing = [n for n, f in _FIELDS.items() if n not in values and n != "key"
               and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    if missing:
        raise ValueError(f"GPU profile {key!r} ({origin}) lacks {', '.join(missing)}")
    for name in _NUMBERS:
        value = values.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                  or value < 0):
            raise ValueError(f"GPU profile {key!r}: {name}={value!r} must be a number >= 0")
    for name in ("memory_bytes", "memory_bandwidth"):
        if not values[name] > 0:
            raise ValueError(f"GPU profile {key!r}: {name} must be > 0")
    for name, same in (("kv_bandwidth_efficiency", "bandwidth_efficiency"),
                       ("fp8_flops_efficiency", "flops_efficiency")):
        value = values.get(name, 0.0)
        if not 0 <= value <= 1:
            raise ValueError(f"GPU profile {key!r}: {name}={value!r} must be in [0, 1] (0: "
                             f"the same as {same})")
    if not 0 <= values.get("gemm_overlap", 1.0) <= 1:
        raise ValueError(f"GPU profile {key!r}: gemm_overlap={values['gemm_overlap']!r} must "
                         "be in [0, 1] (1: the roofline's max)")
    for name in ("flops_efficiency", "bandwidth_efficiency", "attention_efficiency"):
        if not 0 < values[name] <= 1:
            raise ValueError(f"GPU profile {key!r}: {name}={values[name]!r} must be in (0, 1]")
    peaks = values["peak_flops"]
    if not isinstance(peaks, dict) or not peaks or not all(
            isinstance(v, (int, float)) and v > 0 for v in peaks.values()):
        raise ValueError(f"GPU profile {key!r}: peak_flops must map dtypes to FLOP/s > 0, "
                         "e.g. { bfloat16 = 989e12 }")
    values["memory_bytes"] = int(values["memory_bytes"])
    values["reserved_bytes"] = int(values["reserved_bytes"])
    return GpuProfile(key=key, **values)


def load_gpu(key: str, hardware_file: Path | None = None,
             overrides: dict[str, float] | None = None) -> GpuProfile:
    """A built-in profile or one from `hardware_file` (whose tables may also override
    fields of a built-in one), with `overrides` ({field: number}) applied last."""
    tables = builtin_gpus()
    origin = "built-in"
    if hardware_file is not None:
        for name, table in read_table_file(Path(hardware_file)).items():
            tables[name] = {**tables.get(name, {}), **table}
            if name == key:
                origin = str(hardware_file)
    if key not in tables:
        raise ValueError(f"unknown GPU {key!r}; choose one of "
                         f"{', '.join(gpu_names(hardware_file))}, or describe yours in a "
                         "--hardware file (the layout of refserve/simulator/gpus.toml)")
    return apply_overrides(_profile(key, tables[key], origin), overrides)


def apply_overrides(profile: GpuProfile, overrides: dict[str, float] | None) -> GpuProfile:
    """The profile with some numbers replaced; `peak_flops.<dtype>` sets one dtype's peak.
    Each replaced number's source becomes "given by the user"."""
    if not overrides:
        return profile
    values = dataclasses.asdict(profile)
    key = values.pop("key")
    values["peak_flops"] = dict(values["peak_flops"])
    values["source"] = dict(values["source"])
    for name, value in overrides.items():
        if name.startswith("peak_flops."):
            values["peak_flops"][name.split(".", 1)[1]] = value
            values["source"]["peak_flops"] = "given by the user"
        elif name in _NUMBERS:
            values[name] = value
            values["source"][name] = "given by the user"
            if name in ("flops_efficiency", "bandwidth_efficiency", "attention_efficiency",
                        "kv_bandwidth_efficiency", "fp8_flops_efficiency", "kernel_gap_s",
                        "step_overhead_s", "row_overhead_s"):
                values["source"]["efficiencies"] = "given by the user"
        else:
            raise ValueError(f"cannot override {name!r}: fields are {', '.join(_NUMBERS)} "
                             "and peak_flops.<dtype>")
    return _profile(key, values, "overridden")


def host_profile(ceilings: dict, memory_bytes: int | None = None) -> GpuProfile:
    """"this machine": the CPU as the tuned CPU backend sees it, from the `roofline` bench's
    `measure_ceilings` ({"peak_flops", "bandwidth_bytes_per_s"}: a float32 matmul and an
    array copy). The efficiencies are relative to those measured ceilings, so they start
    near 1; the overheads are rough priors for the CPU engine until `fit` measures them."""
    if memory_bytes is None:
        memory_bytes = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    peak = float(ceilings["peak_flops"])
    return GpuProfile(
        key=THIS_MACHINE, name="this machine (CPU backend)",
        memory_bytes=int(memory_bytes), peak_flops={"float32": peak},
        memory_bandwidth=float(ceilings["bandwidth_bytes_per_s"]),
        interconnect_bandwidth=1e9, allreduce_latency_s=0.0, host_link_bandwidth=1e9,
        reserved_bytes=0, usd_per_hour=0.0, flops_efficiency=0.8, bandwidth_efficiency=0.8,
        attention_efficiency=0.3, step_overhead_s=2e-3, row_overhead_s=2e-4, kind="host",
        source={"memory_bytes": "physical memory (sysconf)",
                "peak_flops": "measured: float32 matmul (bench roofline)",
                "memory_bandwidth": "measured: array copy (bench roofline)",
                "interconnect_bandwidth": "one CPU: no tensor parallelism",
                "usd_per_hour": "your own machine; pass --usd-per-hour",
                "efficiencies": "rough priors for the NumPy engine; fit them (phase 2: "
                                "bench sim-fidelity)"})


# ---- the model ---------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelShape:
    """The numbers of a Llama-family model the cost model and the pool sizing read.

    layer_params   parameters of the transformer layers (attention + MLP + norms): each is
                   read once per step and multiplied by every query token
    lm_head_params vocab_size * hidden_size: multiplied by each logits row only
    total_params   everything held in memory (embeddings and LM head included)
    """

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    layer_params: int
    lm_head_params: int
    total_params: int
    max_position_embeddings: int
    eos_token_id: int | None
    dtype: str  # the checkpoint's own dtype (used by --dtype auto)

    @property
    def attention_width(self) -> int:
        """num_heads * head_dim: the width of q and of the attention output."""
        return self.num_heads * self.head_dim

    @property
    def pool_shape(self) -> PoolShape:
        """What the engine's pool sizing reads of this model (engine_setup.PoolShape)."""
        return PoolShape(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads,
                         head_dim=self.head_dim, hidden_size=self.hidden_size,
                         intermediate_size=self.intermediate_size, vocab_size=self.vocab_size)

    def kv_bytes_per_token(self, dtype_bytes: int, tensor_parallel_size: int = 1) -> int:
        """KV bytes per token of ONE GPU, the pool sizing's (PoolShape.kv_bytes_per_token:
        the KV heads split across GPUs, at least one each)."""
        return self.pool_shape.kv_bytes_per_token(dtype_bytes, tensor_parallel_size)


def load_model(model: str) -> ModelShape:
    """A capacity preset ("llama-3-8b", ...) or a path to an HF folder / config.json."""
    name, config = capacity.load_model_config(model)
    s = capacity.model_shape(config)
    total = capacity.num_parameters(config)
    lm_head = s["vocab_size"] * s["hidden_size"]
    embeddings = lm_head  # the input embedding table, read only at T rows per step
    tied = config.get("tie_word_embeddings", False)
    layer_params = total - embeddings - (0 if tied else lm_head) - s["hidden_size"]
    eos = config.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    max_pos = config.get("max_position_embeddings", 8192)
    dtype = (capacity.PRESET_DTYPE if name in capacity.PRESETS
             else capacity.model_dtype(config) or "bfloat16")
    return ModelShape(
        name=name, num_layers=s["num_layers"], hidden_size=s["hidden_size"],
        num_heads=s["num_heads"], num_kv_heads=s["num_kv_heads"], head_dim=s["head_dim"],
        intermediate_size=s["intermediate_size"], vocab_size=s["vocab_size"],
        layer_params=layer_params, lm_head_params=lm_head, total_params=total,
        max_position_embeddings=int(max_pos), eos_token_id=eos, dtype=dtype)


# Hugging Face ids of the presets, for the `vllm serve` line `plan` prints.
HF_IDS = {"llama-3-8b": "meta-llama/Meta-Llama-3-8B-Instruct",
          "llama-3-70b": "meta-llama/Meta-Llama-3-70B-Instruct",
          "llama-3.1-8b": "meta-llama/Llama-3.1-8B-Instruct",
          "llama-3.1-70b": "meta-llama/Llama-3.1-70B-Instruct",
          "llama-2-7b": "meta-llama/Llama-2-7b-chat-hf",
          "llama-2-70b": "meta-llama/Llama-2-70b-chat-hf",
          "smollm2-135m": "HuggingFaceTB/SmolLM2-135M-Instruct"}
