"""The course's grader: every test carries a mechanism marker, and `pytest --grade` grades
a student copy exercise by exercise.

Loaded before collection by `-p grading` in pyproject.toml's pytest addopts (with tests/ on
pytest's pythonpath), so its options exist before pytest reads the command line's paths.
Its jobs:

1. Mark. Each collected test gets the markers of the first rule in `RULES` whose module
   pattern and test-name pattern both match (a rule may name several mechanisms). A test
   that already carries a mechanism marker written in its own file keeps exactly that. A
   module no rule names falls back to the mechanism spelled in its file name
   (tests/test_scheduler_extra.py -> scheduler). Because the markers exist at collection
   time, `pytest -m scheduler` runs one mechanism.

2. Grade. `pytest [--impl DIR] [-m "not slow"] --grade [--exercise NAME]` is the course's
   grade, the same as `python -m refserve.course grade [DIR] [--exercise NAME]`: pytest
   hands the command to refserve/course_grade.py (this checkout's), which grades each
   exercise of DIR alone inside the reference, prints one row per exercise and writes
   grade.json (`--grade-json`, default ./grade.json), then exits without running anything
   itself. Without --impl it grades this checkout's own regions (all pass). It always
   grades the not-slow selection of each exercise, so it takes no test paths and no other
   `-m`.

3. Record. `--grade-record PATH` is how course_grade.py reads one exercise's run back
   (tests/grade_record.py): one JSON line per event, each failure as one plain line (the
   assertion, a Hypothesis falsifying example folded in, never an exception group), under
   a deterministic Hypothesis profile that reports one bug. `--grade-shard I/N` runs every
   Nth selected test from I, so one exercise can use several cores.

4. Tell "blocked" from "failed". A check that needs a GPU and finds none must skip with a
   reason that starts with "no GPU" (e.g. `pytest.skip("no GPU: cupy cannot see a device")`,
   or the `requires_gpu` mark below). A failed `pytest.importorskip("cupy")` and a missing
   CUDA toolkit ("nvcc ... not installed") count too. Such skips are recorded as blocked,
   not failed.

5. Test another implementation. `--impl DIR` (or the environment variable REFSERVE_IMPL=DIR)
   runs these same tests against the `refserve` package in DIR (a student copy, or the
   grader's hybrid package): DIR goes first on sys.path (and on PYTHONPATH, for the tests'
   subprocesses) before anything imports refserve, and the run stops with a usage error
   unless the refserve it then imports is DIR's.
   `--impl DIR` with a space: pytest picks its rootdir (and so its configuration) from the
   command line's paths before any plugin can define an option, and takes DIR for a test
   path. So the plugin restarts the same command once with `--impl=DIR`, which pytest
   reads as one option (`restart_with_joined_impl`).
"""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import sys
from pathlib import Path

import pytest
from grade_record import Recorder, load_grading_profile

# Every mechanism marker, and the invariant its tests check. The course's exercises are
# graded under some of them (refserve/course_exercises.py, EXERCISES).
MECHANISMS: dict[str, str] = {
    "capacity": "KV bytes per token, blocks for N tokens, pool size and max concurrency "
                "follow the capacity formulas",
    "allocator": "a block is free iff its ref count is 0; the free queue hands out each "
                 "block once and a double free is an error",
    "block_table": "the append rule: a new block only when the last one is exactly full; "
                   "slot = block_id * block_size + position % block_size",
    "cow": "copy-on-write: a shared block (ref count > 1) is copied before anyone writes "
           "into it, and only then",
    "prefix_cache": "a prefix cache hit reuses only full, computed blocks whose whole hash "
                    "chain matches, never the block holding the last prompt token",
    "paged_attention": "attention over a block table equals dense causal attention over "
                       "the same tokens",
    "prepare": "the runner flattens a step: decode rows first, each token's position and "
               "slot from its block table, context lengths, logits rows in scheduler order",
    "scheduler": "admit / advance / retire: FCFS admission within max_num_seqs and the "
                 "token budget; every scheduled token has a slot",
    "chunked_prefill": "a long prefill is split across steps within the token budget "
                       "while decodes keep advancing",
    "preemption": "when the pool is short the newest running sequence is preempted "
                  "(recompute) and goes to the head of the waiting queue, output kept",
    "sampling": "temperature / top-k / top-p draw from exactly the distribution they "
                "define; a seeded request is reproducible in any batch",
    "spec_accept": "accept a draft token with probability min(1, p/q), else resample the "
                   "residual max(0, p - q): the output follows the target p exactly",
    "spec_propose": "a proposer returns at most k draft tokens, taken from the context "
                    "(n-gram) or from the draft model",
    "spec_e2e": "speculative decoding generates what the target alone would; rejected "
                "drafts leave no KV behind",
    "backend_equality": "the tuned CPU and the CuPy backends return what the NumPy "
                        "reference returns on the same inputs and draws",
    "kernels": "each CUDA kernel matches the NumPy reference on its own",
    "backend": "the Backend interface: selection, KV allocation, device transfers",
    "model_parity": "the NumPy Llama forward matches transformers (logits and greedy text)",
    "model_loading": "checkpoints load, convert and fail with a clear error",
    "engine": "the engine serves every request to its finish reason and keeps the pool "
              "consistent, whatever else fails",
    "serving": "the OpenAI-compatible server maps requests onto the engine, streams, and "
               "aborts on disconnect",
    "cli": "command-line entry points: documented flags, `error:` lines and exit 2 on bad "
           "input",
    "bench": "benchmarks run end to end and report only measured numbers",
    "course": "the course machinery: grading, student copies, notebooks",
    "simulator": "the simulator runs the real scheduler and KV cache on a virtual clock: "
                 "its schedule is the real engine's, its step times follow the roofline",
}

# (module glob, test-name regex or None, markers). First match wins, so specific rules
# come before the catch-all for their module. The name is the test function's name
# (parametrisation ids stripped; for a class-based test, "Class.method").
RULES: list[tuple[str, str | None, tuple[str, ...]]] = [
    ("test_capacity.py", None, ("capacity",)),
    ("test_block_allocator.py", None, ("allocator",)),
    ("test_block_table.py", None, ("block_table",)),
    ("test_kv_cache_stateful.py", None, ("allocator", "block_table", "cow", "prefix_cache")),
    ("test_prefix_cache.py", r"fork|cow", ("cow",)),
    ("test_prefix_cache.py", r"append_rule", ("block_table",)),
    ("test_prefix_cache.py", None, ("prefix_cache",)),
    ("test_backend.py", r"copy_blocks", ("cow",)),
    ("test_backend.py", r"write_kv|allocate_kv_cache", ("paged_attention",)),
    ("test_backend.py", None, ("backend",)),
    ("test_paged_attention.py", None, ("paged_attention",)),
    ("test_model_parity.py", r"paged|ragged", ("model_parity", "paged_attention")),
    ("test_model_parity.py", None, ("model_parity",)),
    ("test_default_model.py", r"greedy|tokenizer|chat_template", ("model_parity",)),
    ("test_default_model.py", None, ("model_loading",)),
    ("test_default_model_fetch.py", None, ("model_loading",)),
    ("test_loader_errors.py", None, ("model_loading",)),
    ("test_hub_ids.py", None, ("model_loading",)),
    ("test_prefill_first.py", r"simulator", ("simulator", "chunked_prefill")),
    ("test_prefill_first.py", None, ("scheduler", "chunked_prefill")),
    ("test_scheduler.py", r"chunked_prefill", ("scheduler", "chunked_prefill")),
    ("test_scheduler.py", r"preempt", ("scheduler", "preemption")),
    ("test_scheduler.py", None, ("scheduler",)),
    ("test_model_runner.py", None, ("prepare",)),
    ("test_swap.py", r"Scheduler|scheduler|recompute|victim|never_applied|knobs|computed",
     ("scheduler", "preemption")),
    ("test_swap.py", None, ("preemption",)),
    ("test_tour.py", None, ("course",)),
    ("test_stop_rules.py", r"spec", ("scheduler", "spec_e2e")),
    ("test_stop_rules.py", None, ("scheduler",)),
    ("test_sampling.py", None, ("sampling",)),
    ("test_vllm_sampling_fields.py", None, ("sampling",)),
    ("test_engine_smollm2.py", r"chunking_and_preemption",
     ("engine", "model_parity", "chunked_prefill", "preemption")),
    ("test_engine.py", r"prefix_cache", ("engine", "prefix_cache")),
    ("test_engine.py", r"parallel_sampling", ("engine", "cow")),
    ("test_engine.py", r"seeded_sampling", ("engine", "sampling")),
    ("test_engine.py", r"static_and_continuous", ("engine", "scheduler")),
    ("test_engine.py", r"contiguous_layout", ("engine", "paged_attention")),
    ("test_engine.py", r"pool_sized", ("engine", "capacity")),
    ("test_engine*.py", None, ("engine",)),
    ("test_generate_cli.py", None, ("cli",)),
    ("test_simulator*.py", None, ("simulator",)),
    ("test_bench*.py", None, ("bench",)),
    ("test_spec_warping.py", r"warp", ("spec_accept", "sampling")),
    ("test_backend_equality_cpu.py", r"sample", ("backend_equality", "sampling")),
    ("test_backend_equality_cpu.py", r"paged_attention|contiguous|gather",
     ("backend_equality", "paged_attention")),
    ("test_backend_equality_cpu.py", None, ("backend_equality",)),
    ("test_cpu_threads.py", None, ("backend",)),
    ("test_backend_equality_cpu_attention.py", None, ("backend_equality", "paged_attention")),
    ("test_backend_equality_cpu_matmul.py", r"greedy|tiny_model",
     ("backend_equality", "model_parity")),
    ("test_backend_equality_cpu_matmul.py", None, ("backend_equality",)),
    ("test_spec_warping.py", None, ("spec_e2e",)),
    # Modules other issues add; named by what they are about.
    ("test_*rejection*.py", None, ("spec_accept",)),
    ("test_*accept*.py", None, ("spec_accept",)),
    ("test_*ngram*.py", None, ("spec_propose",)),
    ("test_*propos*.py", None, ("spec_propose",)),
    ("test_spec*.py", None, ("spec_e2e",)),
    ("test_*equal*.py", None, ("backend_equality",)),
    ("test_cupy*.py", None, ("backend_equality",)),
    ("test_*kernel*.py", None, ("kernels",)),
    ("test_*cuda*.py", None, ("kernels",)),
    ("test_serv*.py", None, ("serving",)),
    ("test_openai*.py", None, ("serving",)),
    ("test_loadtest*.py", None, ("serving",)),
    ("test_*cli*.py", None, ("cli",)),
    ("test_notebook*.py", None, ("course",)),
    ("*.ipynb", None, ("course",)),  # the notebooks themselves, executed by nbmake
    ("test_course*.py", None, ("course",)),
    ("test_student*.py", None, ("course",)),
    ("test_grading*.py", None, ("course",)),
    ("test_step*.py", None, ("engine",)),
    ("test_no_host_sync.py", None, ("backend",)),
    ("test_module_structure.py", None, ("course",)),
    ("test_lifecycle_owners.py", None, ("scheduler",)),
    ("test_dependencies.py", None, ("course",)),
    ("test_metrics*.py", None, ("engine",)),
    # against a recording of the real vLLM (tests/data/vllm_parity.json)
    ("test_vllm_parity.py", r"sampling_field", ("sampling",)),
    ("test_vllm_parity.py", None, ("model_parity",)),
    ("test_vllm_parity_spec.py", None, ("spec_e2e",)),
    ("test_vllm_api_edges.py", None, ("engine",)),
]

@functools.cache
def _gpu_present() -> bool:
    try:
        import cupy  # noqa: F401  (optional dependency)

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # noqa: BLE001  (no cupy, no driver, no device: all mean "no GPU")
        return False


requires_gpu = pytest.mark.skipif(not _gpu_present(), reason="no GPU: cupy sees no CUDA device")


def mechanisms_for(module: str, name: str) -> tuple[str, ...]:
    """The markers RULES give test `name` in module file `module` (e.g. 'test_x.py')."""
    for pattern, name_regex, markers in RULES:
        if fnmatch.fnmatch(module, pattern) and (name_regex is None
                                                  or re.search(name_regex, name)):
            return markers
    stem = module.removeprefix("test_").removesuffix(".py")
    return tuple(m for m in MECHANISMS if stem == m or stem.startswith(m + "_"))


# ---- pytest hooks ------------------------------------------------------------------------


def pytest_addoption(parser):
    group = parser.getgroup("grading", "course grading")
    group.addoption("--grade", action="store_true",
                    help="grade the student copy given with --impl (default: this checkout), "
                         "each exercise alone inside the reference; print one row per "
                         "exercise and write grade.json (python -m refserve.course grade)")
    group.addoption("--exercise", action="append", metavar="NAME",
                    help="with --grade: grade only this exercise (repeatable)")
    group.addoption("--grade-json", default="grade.json", metavar="PATH",
                    help="where --grade writes its JSON report (default: ./grade.json)")
    group.addoption("--impl", default=os.environ.get("REFSERVE_IMPL") or None, metavar="DIR",
                    help="test the refserve package in DIR (a student copy from `python -m "
                         "refserve.course make-student DIR`) instead of this checkout's; "
                         "default: $REFSERVE_IMPL")
    group.addoption("--grade-record", default=None, metavar="PATH",
                    help="(for refserve/course_grade.py) record each test's outcome and "
                         "first failure as JSON lines in PATH, under a deterministic "
                         "Hypothesis profile")
    group.addoption("--grade-shard", default="0/1", metavar="I/N",
                    help="(with --grade-record) run only the selected tests whose index "
                         "is I modulo N")


def use_implementation(impl: str) -> Path:
    """Make `import refserve` load DIR/refserve (see the module docstring, job 5). Returns the
    package folder; raises pytest.UsageError if that cannot be guaranteed."""
    root = Path(impl).expanduser().resolve()
    package = root / "refserve"
    if not (package / "__init__.py").is_file():
        raise pytest.UsageError(f"--impl {impl}: {package} is not a refserve package; make one "
                                "with `python -m refserve.course make-student DIR`")
    loaded = sys.modules.get("refserve")
    if loaded is not None and Path(loaded.__file__).resolve().parent != package:
        raise pytest.UsageError(f"--impl {impl}: refserve was already imported from "
                                f"{Path(loaded.__file__).parent} before the option applied")
    sys.path.insert(0, str(root))
    os.environ["PYTHONPATH"] = os.pathsep.join(
        [str(root), *filter(None, [os.environ.get("PYTHONPATH")])])
    import refserve

    where = Path(refserve.__file__).resolve().parent
    if where != package:
        raise pytest.UsageError(f"--impl {impl}: `import refserve` found {where}, not {package}")
    return package


# The plugin's options that take a value: pytest takes a separate value for a test path
# (an existing path even moves the rootdir) before the plugin has defined them.
JOINED_OPTIONS = ("--impl", "--grade-json", "--exercise")


def join_impl_args(args: list[str]) -> list[str]:
    """['--impl', 'DIR', ...] -> ['--impl=DIR', ...] (and the other JOINED_OPTIONS): the
    form pytest cannot misread."""
    out, i = [], 0
    while i < len(args):
        if args[i] in JOINED_OPTIONS and i + 1 < len(args):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config, parser, args):
    restart_with_joined_impl(early_config)


def restart_with_joined_impl(config) -> None:
    """`--impl DIR` with a space: run the same command again as `--impl=DIR` (see the
    module docstring, job 5), before any conftest or test is loaded from the wrong root."""
    given = list(config.invocation_params.args)
    joined = join_impl_args(given)
    if joined == given:
        return
    if sys.argv[1:] != given:  # pytest.main() inside another program: cannot restart it
        raise pytest.UsageError("write --impl=DIR (with '='): pytest reads the DIR of "
                                "'--impl DIR' as a test path before this option exists "
                                "(--grade-json and --exercise too)")
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # give the terminal back: it is redirected while this runs
        capture.stop_global_capturing()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "pytest", *joined])


@pytest.hookimpl(tryfirst=True)
def pytest_cmdline_main(config):
    """`--grade`: the course grade (job 2) runs instead of a test session."""
    if not config.getoption("grade"):
        if config.getoption("exercise"):
            raise pytest.UsageError("--exercise NAME goes with --grade")
        return None
    markexpr = " ".join(config.getoption("markexpr", "").split())
    if markexpr not in ("", "not slow"):
        raise pytest.UsageError(f"--grade with -m {markexpr!r}: the grade runs each exercise's "
                                "not-slow tests; drop -m (one exercise: --exercise NAME)")
    if config.args_source is pytest.Config.ArgsSource.ARGS:
        raise pytest.UsageError(f"--grade with test paths {config.args}: the grade picks each "
                                "exercise's tests itself; drop them (one exercise: "
                                "--exercise NAME)")
    from refserve import course_grade

    # pyproject's pythonpath puts this checkout first: the grader must be the reference's.
    here = Path(course_grade.__file__).resolve()
    if not here.is_relative_to(config.rootpath):
        raise pytest.UsageError(f"--grade: refserve was imported from {here.parent}, not from "
                                f"this checkout {config.rootpath}")
    impl = config.getoption("impl")
    json_path = Path(config.invocation_params.dir) / config.getoption("grade_json")
    try:
        return course_grade.run(Path(impl) if impl else None, config.getoption("exercise"),
                                json_path=json_path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


def pytest_configure(config):
    impl = config.getoption("impl", None)
    if impl:
        config._refserve_impl = use_implementation(impl)
    # pyproject.toml registers the same names (tests/test_grading.py keeps the two equal);
    # registering here too lets the plugin run in a test folder without that file.
    registered = {line.split(":")[0].strip() for line in config.getini("markers")}
    for name, invariant in MECHANISMS.items():
        if name not in registered:
            config.addinivalue_line("markers", f"{name}: {invariant}")
    record = config.getoption("grade_record", None)
    if record:
        load_grading_profile()
        shard, _, shards = config.getoption("grade_shard").partition("/")
        if not (shard.isdigit() and shards.isdigit() and int(shard) < int(shards)):
            raise pytest.UsageError(f"--grade-shard {config.getoption('grade_shard')}: "
                                    "write I/N with 0 <= I < N")
        config.pluginmanager.register(Recorder(Path(record), int(shard), int(shards)),
                                      "refserve-grade-recorder")


@pytest.hookimpl(tryfirst=True)
def pytest_terminal_summary(terminalreporter, exitstatus, config):
    """nbmake (it runs the notebooks: `--nbmake` in pyproject's addopts) prints an
    advertisement at the end of every run while its option is on. Every notebook was
    collected long before this, so turning the option off now only drops that line."""
    if getattr(config.option, "nbmake", False):
        config.option.nbmake = False


def pytest_report_header(config):
    impl = getattr(config, "_refserve_impl", None)
    return [f"refserve under test: {impl} (--impl)"] if impl else []


@pytest.hookimpl(tryfirst=True)  # before -m deselects, so `pytest -m scheduler` sees marks
def pytest_collection_modifyitems(config, items):
    for item in items:
        if any(m.name in MECHANISMS for m in item.iter_markers()):
            continue  # the test file chose its own mechanism
        module = Path(str(item.fspath)).name
        name = getattr(item, "originalname", None) or item.name.split("[")[0]
        cls = getattr(item, "cls", None)  # notebook items (nbmake) have no class
        if cls is not None:
            name = f"{cls.__name__}.{name}"
        for marker in mechanisms_for(module, name):
            item.add_marker(marker)
