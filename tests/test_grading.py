"""The grader itself (tests/grading.py): the mechanism markers, the recorder the course's
exercise grader reads (`--grade-record`), its one plain line per failure, and `--grade`'s
hand-over to refserve/course_grade.py. Run by pytester on small generated test folders."""

import builtins
import json
from pathlib import Path

import grade_record
import grading
import pytest

pytest_plugins = ["pytester"]

CONFTEST = 'pytest_plugins = ["grading"]\n'


def run_isolated(pytester, *args):
    """Run in a fresh process with its own copy of the plugin: the generated files reuse
    real module names (test_scheduler.py ...) that this process has already imported."""
    pytester.makepyfile(grading=Path(grading.__file__).read_text(),
                        grade_record=Path(grade_record.__file__).read_text())
    return pytester.runpytest_subprocess("-p", "no:nbmake", *args)  # nbmake: 1.5 s of import


# ---- marking ------------------------------------------------------------------------------


def test_modules_are_mapped_to_mechanisms_and_minus_m_selects_them(pytester):
    """Test files carry no markers: RULES and the file-name fallback give them."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_block_table="def test_append_rule(): pass\n",
        test_scheduler="def test_chunked_prefill_x(): pass\ndef test_admit(): pass\n",
        test_preemption_extra="def test_p(): pass\n",   # fallback: file name
        test_misc="def test_m(): pass\n",               # no rule: no marker
    )
    result = run_isolated(pytester, "-m", "scheduler", "-q", "--co")
    result.stdout.fnmatch_lines(["*2/5 tests collected*"])
    result = run_isolated(pytester, "-m", "chunked_prefill", "-q", "--co")
    result.stdout.fnmatch_lines(["test_scheduler.py::test_chunked_prefill_x", "*1/5 tests*"])
    result = run_isolated(pytester, "-m", "preemption or block_table", "-q", "--co")
    result.stdout.fnmatch_lines(["test_block_table.py::test_append_rule",
                                 "test_preemption_extra.py::test_p", "*2/5 tests*"])


def test_a_marker_written_in_the_test_file_wins_over_the_rules(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_scheduler="import pytest\n@pytest.mark.cow\ndef test_x(): pass\n"
                                       "def test_y(): pass\n")
    result = run_isolated(pytester, "-m", "cow", "-q", "--co")
    result.stdout.fnmatch_lines(["test_scheduler.py::test_x", "*1/2 tests collected*"])
    result = run_isolated(pytester, "-m", "scheduler", "-q", "--co")
    result.stdout.fnmatch_lines(["test_scheduler.py::test_y", "*1/2 tests collected*"])


@pytest.mark.parametrize("module, name, expected", [
    ("test_scheduler.py", "test_chunked_prefill_interleaves_with_decodes",
     ("scheduler", "chunked_prefill")),
    ("test_scheduler.py", "test_preemption_preempts_newest_to_head_of_queue_and_keeps_output",
     ("scheduler", "preemption")),
    ("test_scheduler.py", "test_static_vs_continuous", ("scheduler",)),
    ("test_prefix_cache.py", "test_fork_then_child_write_in_shared_partial_block_copies_once",
     ("cow",)),
    ("test_prefix_cache.py", "test_lru_eviction_order", ("prefix_cache",)),
    ("test_backend.py", "test_copy_blocks_copies_exactly_the_listed_blocks", ("cow",)),
    ("test_engine.py", "test_abort_frees_blocks_at_once", ("engine",)),
    ("test_rejection_sampler.py", "test_anything", ("spec_accept",)),
    ("test_ngram_proposer.py", "test_anything", ("spec_propose",)),
    ("test_spec_decode_engine.py", "test_anything", ("spec_e2e",)),
    ("test_cupy_backend.py", "test_anything", ("backend_equality",)),
    ("test_backend_equality_cpu.py", "test_sample_draws_the_reference_tokens",
     ("backend_equality", "sampling")),
    ("test_backend_equality_cpu_matmul.py", "test_calibration_picks_a_valid_plan",
     ("backend_equality",)),
    ("test_spec_rejection_sampler.py", "test_anything", ("spec_accept",)),
    ("test_spec_ngram.py", "test_anything", ("spec_propose",)),
    ("test_spec_warping.py", "test_p_and_q_are_warped_with_the_same_request_settings",
     ("spec_accept", "sampling")),
    ("test_unknown_thing.py", "test_anything", ()),
])
def test_rules_map_the_course_modules(module, name, expected):
    assert grading.mechanisms_for(module, name) == expected


@pytest.mark.parametrize("reason, blocked", [
    ("no GPU: cupy sees 0 CUDA devices", True),
    ("Skipped: no GPU", True),
    ("No gpu available", True),
    ("could not import 'cupy': No module named 'cupy'", True),
    ("nvcc (CUDA toolkit) is not installed", True),
    ("needs scipy", False),
    ("this machine has cupy and a CUDA GPU", False),
])
def test_blocked_means_a_gpu_skip_reason(reason, blocked):
    assert grade_record.is_blocked(reason) is blocked


def test_pyproject_registers_exactly_the_graded_mechanisms():
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    markers = tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"]["markers"]
    names = [line.split(":")[0] for line in markers]
    assert names == ["slow", *grading.MECHANISMS]


# ---- recording one exercise's run (--grade-record) ----------------------------------------

RECORDED = """
import pytest
from hypothesis import given, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule


def test_passes():
    assert True


def test_assert_with_message():
    assert 3 + 3 <= 5, "token budget exceeded"


@settings(max_examples=300)
@given(st.integers(0, 1000))
def test_two_bugs(x):
    # Two different failures: by default Hypothesis reports both, as an exception group.
    if x > 500:
        raise ValueError("too big")
    assert x < 10, "x must be small"


class Counter(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.n = 0

    @rule(k=st.integers(0, 5))
    def add(self, k):
        self.n += k

    @invariant()
    def below_seven(self):
        assert self.n < 7, f"n={self.n}"


TestCounter = Counter.TestCase


def test_stub():
    raise NotImplementedError("exercise append_rule: blocks needed minus blocks held")


def test_gpu():
    pytest.skip("no GPU: cupy sees no CUDA device")


def test_optional():
    pytest.skip("needs scipy")


@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")


def test_setup_error(broken):
    pass
"""


def record(pytester, name, *args):
    """Run RECORDED with --grade-record (a subprocess: the grading profile it loads is
    process-wide). Returns the events."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_recorded=RECORDED)
    path = pytester.path / name
    run_isolated(pytester, f"--grade-record={path}", "-p", "no:cacheprovider", *args)
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_the_record_has_each_outcome_and_one_plain_line_per_failure(pytester):
    events = record(pytester, "first.jsonl")
    assert events[0] == {"selected": 8}
    tests = {e["test"].split("::", 1)[1]: e for e in events if "test" in e}
    started = [e["start"].split("::", 1)[1] for e in events if "start" in e]
    assert started == list(tests)  # each test announced before its result
    assert {name: e["outcome"] for name, e in tests.items()} == {
        "test_passes": "passed", "test_assert_with_message": "failed",
        "test_two_bugs": "failed", "TestCounter::runTest": "failed", "test_stub": "failed",
        "test_gpu": "blocked", "test_optional": "skipped", "test_setup_error": "failed"}
    assert tests["test_passes"]["line"] == ""
    assert tests["test_assert_with_message"]["line"] == (
        "AssertionError: token budget exceeded; assert (3 + 3) <= 5")
    assert tests["test_setup_error"]["line"] == "RuntimeError: fixture broke"
    assert tests["test_stub"]["not_done"] == ["append_rule"]
    assert tests["test_two_bugs"]["not_done"] == []
    # Hypothesis: one bug (never an exception group), its example on the same line.
    two_bugs = tests["test_two_bugs"]["line"]
    assert two_bugs.startswith(("ValueError: too big (falsifying example: test_two_bugs(x=",
                                "AssertionError: x must be small")), two_bugs
    assert "falsifying example: test_two_bugs(x=" in two_bugs
    machine = tests["TestCounter::runTest"]["line"]
    assert machine.startswith("AssertionError: n=") and "; state.add(k=" in machine, machine
    for e in tests.values():
        assert "\n" not in e["line"] and "ExceptionGroup" not in e["line"]
        assert "Explanation" not in e["line"]


def test_the_record_is_the_same_on_every_run(pytester):
    """The grading profile is deterministic: a grade repeats exactly."""
    first = record(pytester, "first.jsonl")
    assert record(pytester, "second.jsonl") == first


def test_shards_split_the_selection_and_keep_each_test_s_place(pytester):
    """`--grade-shard I/N`: every Nth test from I; together the shards run each selected
    test once, and each event keeps the test's place in the whole selection."""
    whole = [e for e in record(pytester, "whole.jsonl", "-k", "not setup_error")
             if "test" in e]
    shards = [record(pytester, f"shard{i}.jsonl", "-k", "not setup_error",
                     f"--grade-shard={i}/2") for i in range(2)]
    assert [e["selected"] for e, *_ in shards] == [4, 3]
    tests = sorted((e for events in shards for e in events if "test" in e),
                   key=lambda e: e["index"])
    assert tests == whole and [e["index"] for e in whole] == list(range(7))
    assert [e["index"] for e in shards[1] if "test" in e] == [1, 3, 5]


@pytest.mark.skipif(not hasattr(builtins, "ExceptionGroup"), reason="Python 3.11's builtin")
def test_plain_line_reads_an_exception_group_through_its_first_exception():
    group = builtins.ExceptionGroup("2 distinct failures", [AssertionError("assert 2 == 1"),
                                                     ValueError("other")])
    assert grade_record.plain_line(group) == "AssertionError: assert 2 == 1"


def test_plain_line_folds_the_falsifying_example_and_drops_the_rest():
    exc = AssertionError("blocks leaked\nassert 3 == 2\n +  where 3 = len([1, 2, 3])\n"
                         "Full diff:\n  - 2\n  + 3")
    exc.__notes__ = ["Falsifying example: test_x(\n    a=1,\n    b=[1,\n     2],\n)",
                     "Draw 1: 0  # or any other generated value",
                     "Explanation:\n    These lines were always and only run by failing cases"]
    assert grade_record.plain_line(exc) == (
        "AssertionError: blocks leaked; assert 3 == 2; + where 3 = len([1, 2, 3]) "
        "(falsifying example: test_x(a=1, b=[1, 2]); Draw 1: 0)")
    assert grade_record.plain_line(NotImplementedError()) == "NotImplementedError"


def test_fold_example_writes_state_machine_steps_on_one_line():
    assert grade_record.fold_example("<state machine>\nstate = M()\nstate.add(k=2)\n"
                                "state.check()") == "state = M(); state.add(k=2); state.check()"
    long = grade_record.fold_example("test_x(\n" + "a=1,\n" * 200 + ")")
    assert len(long) == grade_record.MAX_EXAMPLE_CHARS and long.endswith(" ...")


def test_last_error_line_of_a_collection_error():
    text = "ImportError while importing\n\x1b[31mE   ModuleNotFoundError: No module x\x1b[0m\n"
    assert grade_record.last_error_line(text) == "ModuleNotFoundError: No module x"
    assert grade_record.last_error_line("just text\nlast\n") == "last"


# ---- --grade hands the command to the course grader -----------------------------------------


@pytest.mark.parametrize("args, message", [
    (["--grade", "test_a.py"], "--grade with test paths ['test_a.py']"),
    (["--grade", "-m", "scheduler"], "--grade with -m 'scheduler'"),
    (["--exercise", "append_rule"], "--exercise NAME goes with --grade"),
    # pytester's folder is not this checkout: its course grader would not be the reference's
    (["--grade", "-m", "not slow"], "--grade: refserve was imported from"),
])
def test_grade_refuses_what_it_cannot_honour(pytester, args, message):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_a="def test_a(): pass\n")
    result = pytester.runpytest(*args)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message in result.stderr.str()
    assert not (pytester.path / "grade.json").exists()



@pytest.mark.parametrize("args, joined", [
    (["--impl", "/s", "-m", "not slow"], ["--impl=/s", "-m", "not slow"]),
    (["--impl=/s", "--grade"], ["--impl=/s", "--grade"]),
    (["-q", "--impl"], ["-q", "--impl"]),
    (["--grade", "--grade-json", "g.json", "--exercise", "x"],
     ["--grade", "--grade-json=g.json", "--exercise=x"]),
])
def test_impl_with_a_space_is_joined(args, joined):
    assert grading.join_impl_args(args) == joined


def test_exercise_stubs_are_read_from_failure_reports():
    assert grade_record.exercises_not_done(
        "E   NotImplementedError: exercise append_rule: blocks needed") == {"append_rule"}
    assert grade_record.exercises_not_done(
        "\x1b[0;31mNotImplementedError\x1b[0m: exercise blocks_for_tokens: ceil") == \
        {"blocks_for_tokens"}
    assert grade_record.exercises_not_done(
        "raise NotImplementedError('exercise a_b: x')") == {"a_b"}
    assert grade_record.exercises_not_done("AssertionError: 3 != 4") == set()
    assert grade_record.exercises_not_done("NotImplementedError: contiguous layout") == set()


def test_a_run_ends_without_nbmake_s_advertisement_yet_collects_the_notebooks():
    """pyproject's addopts turn nbmake on for every run (the notebooks are tests); the
    grader turns its option off once collection is over, so nbmake's closing line is gone
    while the notebooks are still collected."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "notebooks", "--collect-only"], cwd=root, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "01_paged_kv_cache.ipynb" in proc.stdout, proc.stdout[-2000:]
    assert "nbmake" not in proc.stdout + proc.stderr, proc.stdout[-500:]
