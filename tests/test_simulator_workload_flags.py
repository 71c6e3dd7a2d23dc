"""Every workload flag of simulate, plan and bench loadtest either changes the workload or
is one error: no flag is silently ignored. --input-len / --output-len / --range-ratio
imply the random workload, as in vLLM's throughput benchmark."""

from __future__ import annotations

import json
import math

import pytest

from refserve import plan, simulate
from refserve.bench import loadtest
from refserve.entrypoints.cli_common import ArgumentParser, CLIError
from refserve.simulator.hardware import load_model

MODEL = load_model("llama-3-8b")


def sim_requests(*argv, module=simulate):
    """The requests simulate (or plan) would simulate for argv, or the CLIError."""
    args = module.build_parser().parse_args(["--slo-ttft-p99", "1s", "--slo-tpot-p99",
                                             "0.1s", *argv] if module is plan else argv)
    if module is plan:
        plan._check(args)
        return simulate.make_requests(args, MODEL, 8192, 4.0, num_requests=20)
    args.num_requests_given = args.num_requests is not None
    if args.rate is None and args.replay is None:
        args.rate = simulate.DEFAULT_RATE
    simulate.resolve_workload_args(args, args.rate)
    args.num_requests = args.num_requests or 20
    return simulate.make_requests(args, MODEL, 8192,
                                  math.inf if args.rate is None else args.rate)


def shape(requests):
    return [(r.arrival_time, r.num_prompt_tokens, r.num_output_tokens) for r in requests]


@pytest.fixture
def result_json(tmp_path):
    path = tmp_path / "result.json"
    path.write_text(json.dumps({"input_lens": [7, 900], "output_lens": [3, 40]}))
    return path


@pytest.mark.parametrize("module", [simulate, plan])
def test_input_and_output_len_imply_the_random_workload(module):
    reqs = sim_requests("--input-len", "2048", "--output-len", "2", module=module)
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in reqs} == {(2048, 2)}
    assert all(r.request_id.startswith("random-") for r in reqs)
    reqs = sim_requests("--output-len", "5", module=module)  # with the default input
    assert {(r.num_prompt_tokens, r.num_output_tokens) for r in reqs} == {(1024, 5)}
    ratio = sim_requests("--range-ratio", "0.5", module=module)
    assert len({r.num_prompt_tokens for r in ratio}) > 1
    with pytest.raises(CLIError, match="--input-len describes the random workload, not "
                                       "sharegpt"):
        sim_requests("--workload", "sharegpt", "--input-len", "10", module=module)
    with pytest.raises(CLIError, match="different workloads"):
        sim_requests("--input-len", "10", "--dataset-path", "x.json", module=module)


def test_every_simulate_workload_flag_changes_the_workload_or_errors(tmp_path, result_json):
    base = shape(sim_requests("--rate", "4"))
    changed = {
        "--workload sharegpt": ["--workload", "sharegpt"],
        "--input-len": ["--input-len", "64"],
        "--output-len": ["--output-len", "9"],
        "--range-ratio": ["--workload", "random", "--range-ratio", "0.3"],
        "--dataset-path": ["--dataset-path", str(result_json)],
        "--seed": ["--seed", "7"],
        "--rate": ["--rate", "8"],
        "--num-requests": ["--num-requests", "30"],
        "--arrival": ["--arrival", "bursty"],
        "--burstiness": ["--arrival", "bursty", "--burstiness", "9"],
    }
    reference = {"--range-ratio": ["--workload", "random"], "--burstiness": ["--arrival",
                                                                              "bursty"]}
    for flag, argv in changed.items():
        against = shape(sim_requests("--rate", "4", *reference.get(flag, [])))
        assert shape(sim_requests("--rate", "4", *argv)) != (against if flag in reference
                                                             else base), flag
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "prompt_tokens": 10, "output_tokens": 3}\n'
                     '{"timestamp": 1, "prompt_tokens": 12, "output_tokens": 2}\n')
    assert shape(sim_requests("--replay", str(trace))) == [(0.0, 10, 3), (1.0, 12, 2)]
    # --rate rescales the trace's times to that mean rate, --seed its synthetic token ids
    assert shape(sim_requests("--replay", str(trace), "--rate", "4")) == [
        (0.0, 10, 3), (0.25, 12, 2)]
    errors = [
        (["--burstiness", "3"], "--burstiness shapes --arrival bursty"),
        (["--arrival", "bursty", "--rate", "inf"], "finite --rate"),
        (["--tokenizer", "tok.json"], "give --dataset-path"),
        (["--workload", "chat", "--output-len", "3"], "not chat"),
        (["--replay", str(trace), "--workload", "chat"], "--replay"),
        (["--replay", str(trace), "--input-len", "5"], "--input-len"),
        (["--replay", str(trace), "--num-requests", "5"], "--num-requests"),
        (["--replay", str(trace), "--arrival", "bursty"], "--arrival"),
    ]
    for argv, needle in errors:
        with pytest.raises(CLIError, match=needle):
            sim_requests(*argv)


def test_tokenizer_counts_a_sharegpt_files_text(tmp_path, smollm2_dir):
    conv = [{"conversations": [{"from": "human", "value": "hello there, " * 20},
                               {"from": "gpt", "value": "general kenobi " * 30}]}]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(conv))
    plain = shape(sim_requests("--dataset-path", str(path)))
    counted = shape(sim_requests("--dataset-path", str(path), "--tokenizer",
                                 str(smollm2_dir / "tokenizer.json")))
    assert plain != counted
    with pytest.raises(CLIError, match="drop --tokenizer"):  # a result file holds counts
        result = tmp_path / "result.json"
        result.write_text(json.dumps({"input_lens": [7], "output_lens": [3]}))
        sim_requests("--dataset-path", str(result), "--tokenizer",
                     str(smollm2_dir / "tokenizer.json"))


def loadtest_args(*argv):
    p = ArgumentParser()
    loadtest.add_arguments(p)
    args = p.parse_args(argv)
    args.seed = 0
    loadtest.resolve_workload_args(args)
    return args


def test_every_loadtest_workload_flag_changes_the_workload_or_errors(result_json):
    def sent(*argv):
        args = loadtest_args(*argv)
        reqs = loadtest.length_requests(args, 8, 0)
        if reqs is None:  # the corpus: text prompts
            reqs = loadtest._requests(8, args.mean_output, args.max_paragraphs, 0)
        return [(str(r["prompt"]), r["max_tokens"]) for r in reqs]

    assert loadtest_args().workload == "corpus"
    assert loadtest_args("--input-len", "50").workload == "random"
    base = sent()
    for argv in (["--input-len", "50"], ["--output-len", "3"], ["--range-ratio", "0.5"],
                 ["--dataset-path", str(result_json)], ["--workload", "sharegpt"],
                 ["--mean-output", "200"], ["--max-paragraphs", "0"]):
        assert sent(*argv) != base, argv
    for argv, needle in ((["--workload", "sharegpt", "--output-len", "3"], "not sharegpt"),
                         (["--input-len", "9", "--mean-output", "5"], "different workloads"),
                         (["--workload", "random", "--max-paragraphs", "1"], "not random")):
        with pytest.raises(ValueError, match=needle):
            loadtest_args(*argv)
