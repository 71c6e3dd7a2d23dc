"""The course's grader: every test carries a mechanism marker; `pytest --grade` scores each one.

Loaded before collection by `-p grading` in pyproject.toml's pytest addopts (with tests/ on
pytest's pythonpath), so its options exist before pytest reads the command line's paths.
Its jobs:

1. Mark. Each collected test gets the markers of the first rule in `RULES` whose module
   pattern and test-name pattern both match (a rule may name several mechanisms). A test
   that already carries a mechanism marker written in its own file keeps exactly that. A
   module no rule names falls back to the mechanism spelled in its file name
   (tests/test_scheduler_extra.py -> scheduler); otherwise it is reported as unmapped.
   Because the markers exist at collection time, `pytest -m scheduler` runs one mechanism.

2. Score. `--grade` records every test's outcome (setup, call and teardown together: any
   failing phase makes the test failed) and, at the end, prints one row per mechanism:
   passed / failed / skipped / blocked and a status. A test counts once under each of its
   markers; the TOTAL row counts each test once.

3. Tell "blocked" from "failed". A check that needs a GPU and finds none must skip with a
   reason that starts with "no GPU" (e.g. `pytest.skip("no GPU: cupy cannot see a device")`,
   or the `requires_gpu` mark below). A failed `pytest.importorskip("cupy")` and a missing
   CUDA toolkit ("nvcc ... not installed") count too. Such skips are *blocked*, not failed:
   a mechanism whose only non-passing tests are blocked reads "blocked: no GPU".

`grade.json` (path: `--grade-json`, default ./grade.json) holds the same numbers plus the
node ids of failed and blocked tests, for CI or a course dashboard. A run with a collection
error (or interrupted) is not graded: the error is printed, the exit status is non-zero, and
neither a table nor grade.json is written (a grade.json left by an earlier run is removed).

Not done yet. A failure whose report shows an exercise stub's NotImplementedError
("exercise <name>: <hint>", what `make-student` leaves in each region) fails only because
that exercise is not written yet; a row whose failures are all of that kind says so and names
the exercises ("FAIL: not done yet: append_rule"), so an untouched student copy reads as a
to-do list, not as broken code. The notebooks' row (course) too.

4. Grade a student copy. `--impl DIR` (or the environment variable REFSERVE_IMPL=DIR) runs
   these same tests against the `refserve` package in DIR, a copy written by
   `python -m refserve.course make-student DIR`: DIR goes first on sys.path (and on
   PYTHONPATH, for the tests' subprocesses) before anything imports refserve, and the run
   stops with a usage error unless the refserve it then imports is DIR's.
   `--impl DIR` with a space: pytest picks its rootdir (and so its configuration) from the
   command line's paths before any plugin can define an option, and takes DIR for a test
   path. So the plugin restarts the same command once with `--impl=DIR`, which pytest
   reads as one option (`restart_with_joined_impl`).
"""

from __future__ import annotations

import fnmatch
import functools
import json
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# Every mechanism the course grades, and the invariant a failing test says was broken.
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

# Skip reasons that mean "this machine cannot run a GPU check" (lower-cased): the convention
# ("no GPU ..."), a failed pytest.importorskip("cupy") (cupy exists only for GPUs), and a
# missing CUDA toolkit ("nvcc (CUDA toolkit) is not installed").
_BLOCKED_REASONS = re.compile(
    r"^no gpu|could not import 'cupy|\b(nvcc|cuda)\b.*\bnot (installed|available|found)")
# An exercise stub's NotImplementedError in a failure report (the raise line or its message,
# or a command line's `error: exercise NAME: ...`), and the terminal's colour codes around it.
_EXERCISE_STUB = re.compile(r"(?:NotImplementedError\W{1,4}|error: )exercise ([a-z][a-z0-9_]*)")
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")

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


def exercises_not_done(report_text: str) -> set[str]:
    """The exercises whose stub (NotImplementedError "exercise NAME: ...") a failure shows."""
    return set(_EXERCISE_STUB.findall(_ANSI.sub("", report_text)))


def is_blocked(reason: str) -> bool:
    """A skip reason that means "this machine has no GPU" (the convention above)."""
    text = reason.strip().removeprefix("Skipped:").strip().lower()
    return bool(_BLOCKED_REASONS.search(text))


# ---- pytest hooks ------------------------------------------------------------------------


def pytest_addoption(parser):
    group = parser.getgroup("grading", "course grading")
    group.addoption("--grade", action="store_true",
                    help="print a per-mechanism score table at the end and write grade.json")
    group.addoption("--grade-json", default="grade.json", metavar="PATH",
                    help="where --grade writes its JSON report (default: ./grade.json)")
    group.addoption("--impl", default=os.environ.get("REFSERVE_IMPL") or None, metavar="DIR",
                    help="test the refserve package in DIR (a student copy from `python -m "
                         "refserve.course make-student DIR`) instead of this checkout's; "
                         "default: $REFSERVE_IMPL")


def use_implementation(impl: str) -> Path:
    """Make `import refserve` load DIR/refserve (see the module docstring, job 4). Returns the
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


def join_impl_args(args: list[str]) -> list[str]:
    """['--impl', 'DIR', ...] -> ['--impl=DIR', ...]: the form pytest cannot misread."""
    out, i = [], 0
    while i < len(args):
        if args[i] == "--impl" and i + 1 < len(args):
            out.append(f"--impl={args[i + 1]}")
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
    module docstring, job 4), before any conftest or test is loaded from the wrong root."""
    given = list(config.invocation_params.args)
    joined = join_impl_args(given)
    if joined == given:
        return
    if sys.argv[1:] != given:  # pytest.main() inside another program: cannot restart it
        raise pytest.UsageError("write --impl=DIR (with '='): pytest reads the DIR of "
                                "'--impl DIR' as a test path before this option exists")
    capture = config.pluginmanager.getplugin("capturemanager")
    if capture is not None:  # give the terminal back: it is redirected while this runs
        capture.stop_global_capturing()
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, "-m", "pytest", *joined])


def check_grade_json(config) -> Path:
    """--grade-json is writable: checked before the tests run, not after."""
    path = Path(config.invocation_params.dir) / config.getoption("grade_json")
    if path.is_dir():
        raise pytest.UsageError(f"--grade-json {path}: is a folder; give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise pytest.UsageError(f"--grade-json {path}: cannot create its folder "
                                f"({e.strerror})") from None
    if not os.access(path.parent, os.W_OK):
        raise pytest.UsageError(f"--grade-json {path}: cannot write there (permission denied)")
    return path


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
    if config.getoption("grade", False):
        config.pluginmanager.register(Grader(config, check_grade_json(config)),
                                      "refserve-grader")


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


@dataclass
class Row:
    passed: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    blocked: list[str] = field(default_factory=list)
    # Failed tests that fail only on an exercise stub, and those exercises (see "Not done").
    not_done: dict[str, set[str]] = field(default_factory=dict)

    def exercises_not_done(self) -> list[str]:
        return sorted(set().union(*self.not_done.values())) if self.not_done else []

    def only_not_done(self) -> bool:
        return bool(self.failed) and all(t in self.not_done for t in self.failed)

    def status(self) -> str:
        if self.only_not_done():
            return "FAIL: not done yet: " + ", ".join(self.exercises_not_done())
        if self.failed:
            return "FAIL"
        if self.blocked and not self.passed:
            return "blocked: no GPU"
        if self.passed:
            return "pass" + (" (some blocked: no GPU)" if self.blocked else "")
        return "skipped" if self.skipped else "no tests"

    def score(self) -> float | None:
        graded = len(self.passed) + len(self.failed)
        return None if graded == 0 else len(self.passed) / graded

    def to_dict(self) -> dict:
        return {"passed": len(self.passed), "failed": len(self.failed),
                "skipped": len(self.skipped), "blocked": len(self.blocked),
                "total": sum(map(len, (self.passed, self.failed, self.skipped, self.blocked))),
                "score": self.score(), "status": self.status(),
                "failed_tests": list(self.failed), "blocked_tests": list(self.blocked),
                "not_done_tests": [t for t in self.failed if t in self.not_done],
                "exercises_not_done": self.exercises_not_done()}


class Grader:
    """Collects one outcome per test, then scores each mechanism."""

    def __init__(self, config, json_path: Path) -> None:
        self.config = config
        self.json_path = json_path
        self.markers: dict[str, tuple[str, ...]] = {}
        self.outcome: dict[str, str] = {}        # nodeid -> passed/failed/skipped/blocked
        self.not_done: dict[str, set[str]] = {}  # failed nodeid -> exercises it shows
        self.collection_errors: list[str] = []
        self.graded = False
        self.started = time.time()
        self.rows: dict[str, Row] = {}
        self.total = Row()

    def pytest_collectreport(self, report):
        if report.failed:
            self.collection_errors.append(report.nodeid or "(the command line)")

    def pytest_collection_finish(self, session):
        for item in session.items:
            self.markers[item.nodeid] = tuple(
                dict.fromkeys(m.name for m in item.iter_markers() if m.name in MECHANISMS))

    def pytest_runtest_logreport(self, report):
        if report.failed:
            self.outcome[report.nodeid] = "failed"
            stubs = exercises_not_done(report.longreprtext)
            if stubs:
                self.not_done.setdefault(report.nodeid, set()).update(stubs)
        elif report.skipped and self.outcome.get(report.nodeid) != "failed":
            reason = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            if hasattr(report, "wasxfail"):
                self.outcome[report.nodeid] = "skipped"
            else:
                self.outcome[report.nodeid] = "blocked" if is_blocked(reason) else "skipped"
        elif report.passed and report.when == "call":
            self.outcome.setdefault(report.nodeid, "passed")

    def pytest_sessionfinish(self, session, exitstatus):
        if self.collection_errors or exitstatus in (
                pytest.ExitCode.INTERRUPTED, pytest.ExitCode.INTERNAL_ERROR,
                pytest.ExitCode.USAGE_ERROR):
            # Some tests never ran: a grade would be a lie. An older grade.json would be
            # read as this run's, so it goes too.
            if self.json_path.is_file():
                self.json_path.unlink()
            return
        self.graded = True
        self.rows = {name: Row() for name in MECHANISMS}
        self.rows["unmapped"] = Row()
        for nodeid, outcome in self.outcome.items():
            getattr(self.total, outcome).append(nodeid)
            for name in self.markers.get(nodeid) or ("unmapped",):
                getattr(self.rows[name], outcome).append(nodeid)
        for nodeid, stubs in self.not_done.items():
            for row in (self.total, *(self.rows[n] for n in
                                      self.markers.get(nodeid) or ("unmapped",))):
                row.not_done[nodeid] = stubs
        report = {
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "duration_s": round(time.time() - self.started, 2),
            "args": list(self.config.invocation_params.args),
            "exit_status": int(exitstatus),
            "gpu": _gpu_present(),
            "refserve": str(Path(sys.modules["refserve"].__file__).resolve().parent)
            if "refserve" in sys.modules else None,
            "mechanisms": {name: {"invariant": MECHANISMS.get(name, "tests no rule maps"),
                                  **row.to_dict()} for name, row in self.rows.items()},
            "total": self.total.to_dict(),
        }
        self.json_path.parent.mkdir(parents=True, exist_ok=True)
        self.json_path.write_text(json.dumps(report, indent=2) + "\n")

    def pytest_terminal_summary(self, terminalreporter):
        tr = terminalreporter
        if not self.graded:
            why = (f"{len(self.collection_errors)} collection error(s), shown above"
                   if self.collection_errors else "the run did not finish")
            tr.section("grade: not graded", red=True)
            tr.write_line(f"not graded: {why}; some tests never ran. Fix it and run again "
                          "(no grade table, no grade.json).", red=True)
            return
        tr.section("grade: one row per mechanism")
        tr.write_line(f"{'mechanism':<17}{'passed':>7}{'failed':>7}{'skipped':>8}"
                      f"{'blocked':>8}  status")
        for name, row in [*self.rows.items(), ("TOTAL", self.total)]:
            d = row.to_dict()
            if name == "unmapped" and not d["total"]:
                continue
            tr.write_line(f"{name:<17}{d['passed']:>7}{d['failed']:>7}{d['skipped']:>8}"
                          f"{d['blocked']:>8}  {d['status']}",
                          red=bool(row.failed), green=row.status().startswith("pass"))
        for name, row in self.rows.items():
            if row.only_not_done():
                tr.write_line(f"{name}: not done yet: exercise(s) "
                              f"{', '.join(row.exercises_not_done())} still raise "
                              "NotImplementedError")
            elif row.failed:
                tr.write_line(f"{name}: invariant broken: {MECHANISMS.get(name, 'unmapped')}")
            for nodeid in row.failed:
                stubs = row.not_done.get(nodeid)
                tr.write_line(f"    {nodeid}" + (f"  (not done yet: {', '.join(sorted(stubs))})"
                                                 if stubs else ""))
        tr.write_line(f"wrote {self.json_path}")
