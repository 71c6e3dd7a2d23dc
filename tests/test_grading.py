"""The grader itself (tests/grading.py), run by pytester on small generated test folders."""

import json
from pathlib import Path

import grading
import pytest

pytest_plugins = ["pytester"]

CONFTEST = 'pytest_plugins = ["grading"]\n'


def run_isolated(pytester, *args):
    """Run in a fresh process with its own copy of the plugin: the generated files reuse
    real module names (test_scheduler.py ...) that this process has already imported."""
    pytester.makepyfile(grading=Path(grading.__file__).read_text())
    return pytester.runpytest_subprocess(*args)

# One file whose tests name their mechanisms themselves, one outcome of each kind.
EXPLICIT = """
import pytest

@pytest.mark.scheduler
def test_admits_fcfs():
    assert True

@pytest.mark.scheduler
@pytest.mark.preemption
def test_preempts_newest():
    assert True

@pytest.mark.scheduler
def test_respects_token_budget():
    assert 3 + 3 <= 5, "token budget exceeded"

@pytest.mark.cow
def test_copy_before_write():
    assert True

@pytest.mark.kernels
def test_kernel_matches_reference():
    pytest.skip("no GPU: cupy sees no CUDA device")

@pytest.mark.backend_equality
@pytest.mark.skipif(True, reason="no GPU")
def test_cupy_equals_numpy():
    pass

@pytest.mark.sampling
def test_optional_feature():
    pytest.skip("needs scipy")

@pytest.fixture
def broken():
    raise RuntimeError("fixture broke")

@pytest.mark.allocator
def test_setup_error(broken):
    pass
"""


def run_grade(pytester, *args):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_explicit=EXPLICIT)
    result = pytester.runpytest("--grade", *args)
    return result, json.loads((pytester.path / "grade.json").read_text())


def table_row(result, name):
    rows = [line for line in result.outlines if line.split()[:1] == [name]]
    assert len(rows) == 1, f"expected one table row for {name}, got {rows}"
    return rows[0].split()


def test_table_lists_every_mechanism_with_right_counts(pytester):
    result, _ = run_grade(pytester)
    result.stdout.fnmatch_lines(["*grade: one row per mechanism*"])
    for name in grading.MECHANISMS:
        table_row(result, name)
    #                  passed failed skipped blocked status...
    assert table_row(result, "scheduler")[1:6] == ["2", "1", "0", "0", "FAIL"]
    assert table_row(result, "preemption")[1:6] == ["1", "0", "0", "0", "pass"]
    assert table_row(result, "cow")[1:6] == ["1", "0", "0", "0", "pass"]
    assert table_row(result, "kernels")[1:] == ["0", "0", "0", "1", "blocked:", "no", "GPU"]
    assert table_row(result, "backend_equality")[5:] == ["blocked:", "no", "GPU"]
    assert table_row(result, "sampling")[1:6] == ["0", "0", "1", "0", "skipped"]
    assert table_row(result, "allocator")[1:6] == ["0", "1", "0", "0", "FAIL"]  # setup error
    assert table_row(result, "spec_accept")[1:] == ["0", "0", "0", "0", "no", "tests"]
    # TOTAL counts each test once, though test_preempts_newest carries two mechanisms.
    assert table_row(result, "TOTAL")[1:5] == ["3", "2", "1", "2"]
    # A failing mechanism is named with its invariant and its failing tests.
    result.stdout.fnmatch_lines([f"scheduler: invariant broken: {grading.MECHANISMS['scheduler']}",
                                 "*test_explicit.py::test_respects_token_budget"])
    assert result.ret == pytest.ExitCode.TESTS_FAILED


def test_grade_json_has_the_fields(pytester):
    _, report = run_grade(pytester)
    assert {"created", "duration_s", "args", "exit_status", "gpu", "mechanisms",
            "total"} <= set(report)
    assert report["exit_status"] == int(pytest.ExitCode.TESTS_FAILED)
    assert set(grading.MECHANISMS) <= set(report["mechanisms"])
    sched = report["mechanisms"]["scheduler"]
    assert {k: sched[k] for k in ("passed", "failed", "skipped", "blocked", "total")} == \
        {"passed": 2, "failed": 1, "skipped": 0, "blocked": 0, "total": 3}
    assert sched["score"] == pytest.approx(2 / 3)
    assert sched["status"] == "FAIL"
    assert sched["invariant"] == grading.MECHANISMS["scheduler"]
    assert sched["failed_tests"] == ["test_explicit.py::test_respects_token_budget"]
    kernels = report["mechanisms"]["kernels"]
    assert kernels["status"] == "blocked: no GPU" and kernels["score"] is None
    assert kernels["blocked_tests"] == ["test_explicit.py::test_kernel_matches_reference"]
    assert report["total"]["total"] == 8


def test_grade_json_path_is_configurable(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_one="import pytest\n@pytest.mark.cow\ndef test_a(): pass\n")
    result = pytester.runpytest("--grade", "--grade-json", "out/g.json")
    assert result.ret == 0
    report = json.loads((pytester.path / "out" / "g.json").read_text())
    assert report["mechanisms"]["cow"]["status"] == "pass"
    assert not (pytester.path / "grade.json").exists()


def test_without_grade_no_table_and_no_json(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_one="def test_a(): pass\n")
    result = pytester.runpytest()
    assert result.ret == 0
    assert "grade: one row per mechanism" not in result.stdout.str()
    assert not (pytester.path / "grade.json").exists()


def test_only_blocked_and_passing_tests_exit_zero(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_gpu="""
import pytest
@pytest.mark.kernels
def test_needs_gpu(): pytest.skip("no GPU here")
@pytest.mark.kernels
def test_on_cpu(): pass
""")
    result = pytester.runpytest("--grade")
    assert result.ret == 0
    assert table_row(result, "kernels")[1:] == ["1", "0", "0", "1", "pass", "(some", "blocked:",
                                                "no", "GPU)"]


def test_modules_are_mapped_to_mechanisms_and_minus_m_selects_them(pytester):
    """Test files carry no markers: RULES and the file-name fallback give them."""
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(
        test_block_table="def test_append_rule(): pass\n",
        test_scheduler="def test_chunked_prefill_x(): pass\ndef test_admit(): pass\n",
        test_preemption_extra="def test_p(): pass\n",   # fallback: file name
        test_misc="def test_m(): pass\n",               # no rule: unmapped
    )
    result = run_isolated(pytester, "-m", "scheduler", "-q", "--co")
    result.stdout.fnmatch_lines(["*2/5 tests collected*"])
    result = run_isolated(pytester, "-m", "chunked_prefill", "-q", "--co")
    result.stdout.fnmatch_lines(["test_scheduler.py::test_chunked_prefill_x", "*1/5 tests*"])
    result = run_isolated(pytester, "--grade")
    assert table_row(result, "block_table")[1] == "1"
    assert table_row(result, "scheduler")[1] == "2"
    assert table_row(result, "chunked_prefill")[1] == "1"
    assert table_row(result, "preemption")[1] == "1"
    assert table_row(result, "unmapped")[1] == "1"


def test_a_marker_written_in_the_test_file_wins_over_the_rules(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_scheduler="import pytest\n@pytest.mark.cow\ndef test_x(): pass\n")
    result = run_isolated(pytester, "--grade")
    assert table_row(result, "cow")[1] == "1"
    assert table_row(result, "scheduler")[1] == "0"


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
    assert grading.is_blocked(reason) is blocked


def test_pyproject_registers_exactly_the_graded_mechanisms():
    pyproject = Path(__file__).resolve().parents[1] / "pyproject.toml"
    tomllib = pytest.importorskip("tomllib", reason="tomllib needs Python 3.11")
    markers = tomllib.loads(pyproject.read_text())["tool"]["pytest"]["ini_options"]["markers"]
    names = [line.split(":")[0] for line in markers]
    assert names == ["slow", *grading.MECHANISMS]


def test_a_collection_error_prints_it_and_grades_nothing(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_fine="import pytest\n@pytest.mark.cow\ndef test_a(): pass\n",
                        test_broken="def test_b(:\n    pass\n")
    stale = pytester.path / "grade.json"
    stale.write_text(json.dumps({"mechanisms": {}, "total": {"passed": 99}}))
    result = pytester.runpytest("--grade")
    assert result.ret == pytest.ExitCode.INTERRUPTED
    out = result.stdout.str()
    assert "SyntaxError" in out and "test_broken.py" in out   # the error itself
    assert "grade: one row per mechanism" not in out
    assert "not graded: 1 collection error(s)" in out
    assert not stale.exists(), "an older grade.json would be read as this run's"


STUBS = """
import pytest

@pytest.mark.block_table
def test_append():
    raise NotImplementedError("exercise append_rule: blocks needed minus blocks held")

@pytest.mark.block_table
def test_append_via_a_command(tmp_path):
    assert False, "stderr: error: exercise append_rule: blocks needed minus blocks held"

@pytest.mark.scheduler
def test_admit_stub():
    raise NotImplementedError("exercise scheduler_admit: FCFS")

@pytest.mark.scheduler
def test_admit_wrong():
    assert 1 == 2, "admitted out of order"

@pytest.mark.allocator
def test_not_implemented_elsewhere():
    raise NotImplementedError("cupy backend: no GPU")
"""


def test_rows_that_fail_only_on_exercise_stubs_say_not_done_yet(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_stubs=STUBS)
    result = pytester.runpytest("--grade")
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    assert table_row(result, "block_table")[5:] == ["FAIL:", "not", "done", "yet:",
                                                   "append_rule"]
    assert table_row(result, "scheduler")[5:] == ["FAIL"]       # one real failure
    assert table_row(result, "allocator")[5:] == ["FAIL"]       # not an exercise stub
    result.stdout.fnmatch_lines([
        "block_table: not done yet: exercise(s) append_rule still raise NotImplementedError",
        "scheduler: invariant broken: *",
        "*test_stubs.py::test_admit_stub  (not done yet: scheduler_admit)"])
    report = json.loads((pytester.path / "grade.json").read_text())
    row = report["mechanisms"]["scheduler"]
    assert row["status"] == "FAIL" and row["exercises_not_done"] == ["scheduler_admit"]
    assert row["not_done_tests"] == ["test_stubs.py::test_admit_stub"]
    assert report["mechanisms"]["block_table"]["status"] == "FAIL: not done yet: append_rule"


def test_grade_json_is_checked_before_the_tests_run(pytester):
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_one="def test_a(): pass\n")
    (pytester.path / "adir").mkdir()
    result = pytester.runpytest("--grade", "--grade-json", "adir")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert "--grade-json" in result.stderr.str() and "is a folder" in result.stderr.str()


@pytest.mark.parametrize("args, joined", [
    (["--impl", "/s", "-m", "not slow"], ["--impl=/s", "-m", "not slow"]),
    (["--impl=/s", "--grade"], ["--impl=/s", "--grade"]),
    (["-q", "--impl"], ["-q", "--impl"]),
])
def test_impl_with_a_space_is_joined(args, joined):
    assert grading.join_impl_args(args) == joined


def test_exercise_stubs_are_read_from_failure_reports():
    assert grading.exercises_not_done(
        "E   NotImplementedError: exercise append_rule: blocks needed") == {"append_rule"}
    assert grading.exercises_not_done(
        "\x1b[0;31mNotImplementedError\x1b[0m: exercise blocks_for_tokens: ceil") == \
        {"blocks_for_tokens"}
    assert grading.exercises_not_done("raise NotImplementedError('exercise a_b: x')") == {"a_b"}
    assert grading.exercises_not_done("AssertionError: 3 != 4") == set()
    assert grading.exercises_not_done("NotImplementedError: contiguous layout") == set()
