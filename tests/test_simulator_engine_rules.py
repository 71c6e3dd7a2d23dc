"""The simulator and the command lines use the engine's rules; none restates one.

- blocks are counted by `blocks_for_tokens` only: no ceiling division by a block size is
  written anywhere else in refserve/ (an AST scan, with negative controls);
- the KV pool is sized by one function, engine_setup.size_kv_pool: the engine (through
  plan_kv_pool, which measures its backend) and the simulator call it and, given the same
  model, memory and knobs, get the same pool;
- a finished request's metrics are completed by one function, RequestMetrics.record_finish,
  in the engine and the simulator alike;
- the engine's flags are one declaration (entrypoints/engine_args.py): every engine flag
  parses identically in generate, serve, simulate and plan, or is one the simulator
  declares with a meaning of its own; simulate's and plan's sources declare no other, and
  the defaults follow the engine's (`--gpu this-machine`: the CPU backend's token budget).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import refserve
import refserve.engine
import refserve.simulator.engine
from refserve import engine_setup
from refserve.config import EngineConfig
from refserve.metrics import RequestMetrics
from refserve.sampling_params import SamplingParams
from refserve.sequence import Sequence

PACKAGE = Path(refserve.__file__).parent


# ---- blocks are counted by blocks_for_tokens -----------------------------------------------

# The one place the ceiling is written: the course's first exercise.
CEILING_OWNER = ("refserve/kv_cache/block_table.py", "blocks_for_tokens")


def _is_block_size(node: ast.expr) -> bool:
    """A divisor that is a block size: a name or attribute spelled block_size (or bs, the
    short name the KV-cache code uses), or the default block size written as a literal."""
    if isinstance(node, ast.Constant):
        return node.value == EngineConfig.block_size
    name = node.id if isinstance(node, ast.Name) else getattr(node, "attr", "")
    return name == "bs" or "block_size" in name.lower()


def _ceiling_divisor(node: ast.AST) -> ast.expr | None:
    """The divisor when `node` is a ceiling division written out, else None. The forms:
    -(-a // b), (a + b - 1) // b, and ceil(a / b) (math.ceil, np.ceil or a bare ceil)."""
    if (isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub)
            and isinstance(node.operand, ast.BinOp)
            and isinstance(node.operand.op, ast.FloorDiv)
            and isinstance(node.operand.left, ast.UnaryOp)
            and isinstance(node.operand.left.op, ast.USub)):
        return node.operand.right
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.FloorDiv):
        left = node.left
        # a + b - 1 parses as (a + b) - 1, a + (b - 1) as written
        if (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Sub)
                and isinstance(left.right, ast.Constant) and left.right.value == 1
                and isinstance(left.left, ast.BinOp) and isinstance(left.left.op, ast.Add)):
            return node.right
        if (isinstance(left, ast.BinOp) and isinstance(left.op, ast.Add)
                and isinstance(left.right, ast.BinOp) and isinstance(left.right.op, ast.Sub)):
            return node.right
    if isinstance(node, ast.Call) and len(node.args) == 1:
        func = node.func
        name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
        arg = node.args[0]
        if name == "ceil" and isinstance(arg, ast.BinOp) and isinstance(arg.op, ast.Div):
            return arg.right
    return None


def inlined_block_ceilings(source: str, path: str = "<string>") -> list[str]:
    """'path:line: text' of every ceiling division by a block size in `source`, outside
    blocks_for_tokens itself."""
    tree = ast.parse(source)
    owners: dict[int, str] = {}
    for fn in ast.walk(tree):
        if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            for inner in ast.walk(fn):
                owners.setdefault(id(inner), fn.name)
    found = []
    for node in ast.walk(tree):
        divisor = _ceiling_divisor(node)
        if divisor is None or not _is_block_size(divisor):
            continue
        if (path, owners.get(id(node))) == CEILING_OWNER:
            continue
        found.append(f"{path}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_block_ceiling_is_written_outside_blocks_for_tokens():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        found += inlined_block_ceilings(path.read_text(), rel)
    assert not found, ("count blocks with blocks_for_tokens (refserve/kv_cache/"
                       "block_table.py), not a ceiling of your own:\n" + "\n".join(found))


@pytest.mark.parametrize("snippet", [
    "n = -(-tokens // block_size)",
    "n = -(-tokens // self.block_size)",
    "n = -(-end // bs)",
    "n = batch * -(-tokens // 16)",
    "n = (tokens + block_size - 1) // block_size",
    "n = (tokens + (bs - 1)) // bs",
    "n = math.ceil(tokens / config.block_size)",
    "n = int(np.ceil(tokens / block_size))",
    "n = ceil(tokens / bs)",
])
def test_the_scan_finds_each_written_out_ceiling(snippet):
    assert len(inlined_block_ceilings(snippet)) == 1


@pytest.mark.parametrize("snippet", [
    "n = blocks_for_tokens(tokens, block_size)",
    "logical = p // block_size",                   # a floor: the block a position lies in
    "full = (len(tokens) - 1) // bs",              # a floor: full blocks before the last
    "tiles = -(-q // tile)",                       # a ceiling, of attention tiles
    "parts = -(-context // partition_size)",
])
def test_the_scan_leaves_floors_and_other_ceilings_alone(snippet):
    assert inlined_block_ceilings(snippet) == []


def test_the_scan_sees_the_exercise_when_it_is_not_the_owner():
    path, _ = CEILING_OWNER
    source = (PACKAGE.parent / path).read_text()
    assert inlined_block_ceilings(source, path) == []
    assert len(inlined_block_ceilings(source, "elsewhere.py")) == 1


# ---- the KV pool is sized by one function --------------------------------------------------


def calls_to(names: set[str]) -> dict[str, set[str]]:
    """For every module of refserve/: which of `names` it calls (as f(...) or x.f(...))."""
    found: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else getattr(f, "attr", None)
                if name in names:
                    found.setdefault(rel, set()).add(name)
    return found


def test_the_engine_and_the_simulator_call_the_one_pool_sizing():
    assert refserve.engine.plan_kv_pool is engine_setup.plan_kv_pool
    assert refserve.simulator.engine.size_kv_pool is engine_setup.size_kv_pool
    callers = calls_to({"plan_kv_pool", "size_kv_pool", "check_pool_holds_one_sequence",
                        "kv_budget_on_device"})
    assert callers == {"refserve/engine.py": {"plan_kv_pool"},
                       "refserve/simulator/engine.py": {"size_kv_pool"},
                       "refserve/engine_setup.py": {"size_kv_pool",
                                                    "check_pool_holds_one_sequence",
                                                    "kv_budget_on_device"}}


def test_the_engine_and_the_simulator_get_the_same_pool(tiny_llama, monkeypatch):
    """The same model, memory and knobs: the real engine (the CPU, then a device that reports
    its memory) and the simulator (the host profile, then a GPU profile of that memory with
    the same bytes in use) size the same pool, for the same reason."""
    import dataclasses

    from refserve.backends.numpy_backend import NumpyBackend
    from refserve.engine import LLMEngine
    from refserve.simulator import SimulatedEngine, load_model
    from refserve.simulator.hardware import host_profile

    shape = load_model(str(tiny_llama))
    host = host_profile({"peak_flops": 1e11, "bandwidth_bytes_per_s": 1e10})
    knobs = dict(block_size=4, max_num_batched_tokens=64, dtype="float32")

    def both(gpu, **config):
        real = LLMEngine(model=str(tiny_llama), progress=False, **knobs, **config)
        sim = SimulatedEngine(shape, gpu, EngineConfig(**knobs, **config))
        return (real.num_blocks, real.kv_pool_plan.knob), (sim.num_blocks, sim.pool_sized_by)

    real, sim = both(host, kv_cache_memory_bytes=1 << 20, backend="numpy")
    assert real == sim and real[0] == 682

    class FakeDevice(NumpyBackend):  # a 4 MB device with 1 MB in use
        def free_device_memory(self):
            return 3_000_000

        def total_device_memory(self):
            return 4_000_000

    monkeypatch.setattr(refserve.engine, "get_backend", lambda name, **options: FakeDevice())
    weights = shape.total_params * 4
    gpu = dataclasses.replace(host, kind="gpu", memory_bytes=4_000_000,
                              reserved_bytes=1_000_000 - weights)
    for utilization in (0.5, 0.9):
        (real_blocks, real_knob), (sim_blocks, sim_knob) = both(
            gpu, gpu_memory_utilization=utilization)
        assert real_blocks == sim_blocks > 0
        # the same rule and numbers; only what is in use is described differently
        assert real_knob.split(" (")[0] == sim_knob.split(" (")[0]


# ---- a finished request's metrics: one function ------------------------------------------


def finished_seq(tokens: int, first: float | None, finish: float | None, cached=0,
                 preemptions=0) -> Sequence:
    seq = Sequence("r", [1, 2, 3], SamplingParams(max_tokens=tokens), 0.0, seq_id=None)
    seq.output_token_ids.extend(range(tokens))
    seq.first_token_time, seq.finish_time = first, finish
    seq.num_cached_tokens, seq.num_preemptions = cached, preemptions
    return seq


def test_record_finish_by_hand():
    """n = 3 samples: TPOT is per sequence (each one's decode time over its own tokens
    after the first), never the request's time over all n samples' tokens."""
    m = RequestMetrics(arrival_time=0.0, first_token_time=1.0)
    m.record_finish([finished_seq(5, 1.0, 3.0, cached=16, preemptions=1),
                     finished_seq(3, 1.0, 2.0, preemptions=2),
                     finished_seq(1, 1.0, 1.0)], now=9.0)
    assert (m.finish_time, m.num_output_tokens, m.num_preemptions) == (3.0, 9, 3)
    assert (m.decode_time, m.num_decode_tokens) == (3.0, 6)  # (2 + 1) s over 4 + 2 tokens
    assert m.tpot == 0.5 and m.num_cached_tokens == 16
    one = RequestMetrics(arrival_time=0.0, first_token_time=1.0)
    one.record_finish([finished_seq(4, 1.0, None)], now=4.0)  # not stamped yet: now
    assert (one.finish_time, one.tpot) == (4.0, 1.0)


def test_the_engine_and_the_simulator_finish_requests_with_it(tiny_llama, monkeypatch):
    from refserve import LLM
    from refserve.simulator import SimulatedEngine, load_gpu, load_model, make_workload

    finished = []
    record = RequestMetrics.record_finish

    def spy(self, seqs, now):
        seqs = list(seqs)
        finished.append(seqs[0].request_id)
        record(self, seqs, now)

    monkeypatch.setattr(RequestMetrics, "record_finish", spy)
    llm = LLM(model=str(tiny_llama), progress=False, block_size=4,
              num_gpu_blocks_override=64)
    outs = llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, n=2))
    assert sorted(finished) == sorted(o.request_id for o in outs)
    assert all(o.metrics.num_output_tokens == 6 and o.metrics.tpot for o in outs)
    finished.clear()
    model = load_model("llama-3-8b")
    engine = SimulatedEngine(model, load_gpu("h100-80gb"), EngineConfig(
        num_gpu_blocks_override=64, max_model_len=512))
    requests = make_workload("chat", 5, 4.0, vocab_size=model.vocab_size,
                             max_model_len=512, seed=0)
    result = engine.run(requests)
    assert sorted(finished) == sorted(r.request_id for r in requests)
    assert all(m.tpot or m.num_output_tokens == 1 for m in result.metrics.values())


def assignments_to(attrs: set[str], source: str) -> set[str]:
    """Which of `attrs` `source` assigns as an attribute (x.attr = ..., x.attr += ...)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AugAssign) else [])
        found |= {t.attr for t in targets if isinstance(t, ast.Attribute) and t.attr in attrs}
    return found


FINISH_FIELDS = {"decode_time", "num_decode_tokens"}


def test_only_record_finish_sets_the_per_sequence_decode_time():
    setters = {path.relative_to(PACKAGE.parent).as_posix()
               for path in PACKAGE.rglob("*.py")
               if assignments_to(FINISH_FIELDS, path.read_text())}
    assert setters == {"refserve/metrics.py"}
    # negative control: the copy the simulator held is found
    assert assignments_to(FINISH_FIELDS, "m.decode_time = now - m.first_token_time\n"
                          "m.num_decode_tokens += 1") == FINISH_FIELDS


# ---- the engine's flags: one declaration --------------------------------------------------

PLAN_SLOS = ["--slo-ttft-p99", "1s", "--slo-tpot-p99", "50ms"]


def parsers() -> dict:
    """Each entry point's parser, with the argv it needs besides engine flags and the
    engine flags it gives a meaning of its own."""
    from refserve import generate, plan, serve, simulate

    return {"generate": (generate.build_parser(), ["hi"], ()),
            "serve": (serve.build_parser(), [], ()),
            "simulate": (simulate.build_parser(), [], simulate.OWN_MEANING),
            "plan": (plan.build_parser(), PLAN_SLOS,
                     simulate.OWN_MEANING + simulate.SEARCHED)}


def engine_actions(parser) -> dict[str, object]:
    """option string -> action, for the engine groups' flags."""
    return {opt: action for group in parser._action_groups
            if group.title.startswith("engine:") for action in group._group_actions
            for opt in action.option_strings}


def signature(action) -> tuple:
    """What a flag means: its action, dest, type (a parser built by a factory, such as
    memory_size(...), is a new function per parser: compared by name), default, choices,
    help."""
    kind = getattr(action.type, "__qualname__", action.type)
    return (type(action).__name__, action.dest, kind, action.default, action.choices,
            action.nargs, action.const, action.help, action.metavar)


# One value per engine flag, not its default, for the parse test.
ENGINE_ARGV = {
    "--model": ["some/folder"], "--dtype": ["float16"], "--seed": ["7"],
    "--block-size": ["32"], "--num-gpu-blocks-override": ["99"],
    "--gpu-memory-utilization": ["0.8"], "--max-model-len": ["2048"],
    "--max-num-seqs": ["8"], "--max-num-batched-tokens": ["512"],
    "--long-prefill-token-threshold": ["64"], "--enable-prefix-caching": [],
    "--no-enable-prefix-caching": [], "--enable-chunked-prefill": [],
    "--no-enable-chunked-prefill": [], "--scheduling-policy": ["priority"],
    "--preemption-mode": ["swap"], "--swap-space": ["2"], "--enforce-eager": [],
    "--tensor-parallel-size": ["1"],
    "--speculative-config": ['{"method": "ngram", "num_speculative_tokens": 3}'],
    "--backend": ["numpy"], "--kv-cache-memory-bytes": ["1GiB"], "--batching": ["static"],
    "--kv-cache-layout": ["contiguous"], "--prefix-caching-policy": ["radix"],
    "--num-gpu-blocks": ["12"], "--kv-cache-memory": ["3GiB"],
}


def test_every_engine_flag_is_the_engines_in_every_entry_point():
    reference = engine_actions(parsers()["generate"][0])
    assert set(reference) == set(ENGINE_ARGV), "give each engine flag a value in ENGINE_ARGV"
    for name, (parser, _, own) in parsers().items():
        actions = engine_actions(parser)
        for opt, ref in reference.items():
            if ref.dest in own:
                assert opt not in actions, (name, opt)
            else:
                assert opt in actions and signature(actions[opt]) == signature(ref), (name, opt)
        assert set(actions) <= set(reference), name
        # a flag of its own meaning is declared outside the engine groups
        mine = {a.dest for a in parser._actions} - {a.dest for a in actions.values()}
        assert set(own) - {"backend"} <= mine, name


@pytest.mark.parametrize("opt", sorted(ENGINE_ARGV))
def test_every_engine_flag_parses_identically_everywhere(opt, capsys):
    values = {}
    for name, (parser, rest, own) in parsers().items():
        action = engine_actions(parsers()["generate"][0])[opt]
        if action.dest in own:
            continue
        args = parser.parse_args([opt, *ENGINE_ARGV[opt], *rest])
        values[name] = getattr(args, action.dest)
    capsys.readouterr()  # the deprecated spellings' warnings
    assert len(set(map(repr, values.values()))) == 1, values
    assert {"generate", "serve"} <= set(values)


def declared_flags(source: str) -> set[str]:
    """The option strings of every add_argument call in `source`."""
    return {arg.value for node in ast.walk(ast.parse(source))
            if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument"
            for arg in node.args if isinstance(arg, ast.Constant)
            and str(arg.value).startswith("--")}


def test_simulate_and_plan_declare_no_engine_flag_of_their_own():
    """Outside engine_args.py only the flags of their own meaning: a copy of an engine flag
    (and its drifting default) in simulate.py or plan.py fails here."""
    from refserve import simulate

    engine = {opt: action.dest
              for opt, action in engine_actions(parsers()["generate"][0]).items()}
    allowed = {"simulate.py": simulate.OWN_MEANING,
               "plan.py": simulate.OWN_MEANING + simulate.SEARCHED}
    for name, own in allowed.items():
        copies = {opt for opt in declared_flags((PACKAGE / name).read_text())
                  if opt in engine and engine[opt] not in own}
        assert not copies, f"{name} declares engine flags itself: {sorted(copies)}"
    # negative control: the copy simulate.py held is found
    stray = 'e.add_argument("--max-num-batched-tokens", type=int, default=8192)'
    assert declared_flags(stray) == {"--max-num-batched-tokens"}


def test_an_exclusion_must_name_an_engine_flag():
    from refserve.entrypoints.cli_common import ArgumentParser
    from refserve.entrypoints.engine_args import add_engine_args

    with pytest.raises(ValueError, match="no engine flag.*max_num_tokens"):
        add_engine_args(ArgumentParser(), exclude=("model", "max_num_tokens"))


def test_simulated_defaults_are_the_engines(tiny_llama, monkeypatch):
    """simulate with no budget flags runs the budget and prefill cap the real engine runs on
    the backend the profile stands for: the CPU backend's on this machine, vLLM's on a GPU."""
    from refserve.bench import roofline
    from refserve.engine import LLMEngine
    from refserve.simulate import build_parser, prepare

    monkeypatch.setattr(roofline, "measure_ceilings", lambda *a: {
        "peak_flops": 1e11, "bandwidth_bytes_per_s": 1e10})
    cpu = LLMEngine(model=str(tiny_llama), backend="cpu", progress=False).config

    def simulated(gpu):
        args = build_parser().parse_args(["--model", "smollm2-135m", "--gpu", gpu,
                                          "--num-requests", "1"])
        config = prepare(args)[3].config
        return config.max_num_batched_tokens, config.long_prefill_token_threshold

    assert simulated("this-machine") == (cpu.max_num_batched_tokens,
                                         cpu.long_prefill_token_threshold) == (256, 128)
    assert simulated("h100-80gb") == (8192, 0)  # vLLM's GPU default, no prefill cap
