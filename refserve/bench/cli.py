"""`python -m refserve.bench <scenario> [--quick] [--json PATH] [--plot PATH]`."""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from refserve.bench.common import machine_info, machine_line, pyplot, write_json
from refserve.entrypoints.cli_common import (
    ArgumentParser,
    CLIError,
    HelpFormatter,
    check_output_path,
)

SCENARIOS = ("batching", "paged", "prefix", "chunked", "memory", "spec", "capacity",
             "roofline", "loadtest", "sim-fidelity", "sim-world", "preemption", "compare",
             "busy")
# The scenarios that step an engine in this process: --trace records their timelines.
TRACED = ("batching", "paged", "prefix", "chunked", "memory", "spec", "capacity",
          "preemption", "sim-fidelity", "busy")
# The scenario that runs a server process: --trace goes to it (serve --trace), and the
# server writes the timeline when the bench shuts it down.
SERVER_TRACED = ("loadtest",)


class _Formatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """The scenario docstrings keep their layout; each default is shown once."""


def build_parser() -> ArgumentParser:
    from refserve import bench

    p = ArgumentParser(prog="python -m refserve.bench", description=bench.__doc__,
                       formatter_class=_Formatter)
    sub = p.add_subparsers(dest="scenario", required=True, metavar="scenario")
    for name in SCENARIOS:
        module = importlib.import_module(f"refserve.bench.{name.replace('-', '_')}")
        s = sub.add_parser(name, help=module.HELP, description=module.__doc__,
                           formatter_class=_Formatter)
        s.add_argument("--model", default=None, help="HF folder (default: embedded SmolLM2)")
        s.add_argument("--seed", type=int, default=0, help="seed of the workload")
        s.add_argument("--quick", action="store_true", help="a small workload (CI smoke run)")
        s.add_argument("--json", type=Path, help="write all numbers here")
        s.add_argument("--plot", type=Path, help="write a PNG chart here (matplotlib)")
        if name in TRACED:
            s.add_argument("--trace", type=Path, help="write every engine's timeline here "
                           "(Chrome trace-event JSON: https://ui.perfetto.dev)")
        elif name in SERVER_TRACED:
            s.add_argument("--trace", type=Path, help="write the server's timeline here "
                           "(its serve --trace, written when the bench stops it)")
        module.add_arguments(s)
        s.set_defaults(module=module, parser=s)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    module = args.module
    args.command = "python -m refserve.bench " + " ".join(
        sys.argv[1:] if argv is None else argv)
    if args.quick:
        module.apply_quick(args)
    for name in getattr(module, "POSITIVE", ()):
        value = getattr(args, name)
        if (isinstance(value, (list, tuple)) and any(v <= 0 for v in value)) or (
                not isinstance(value, (list, tuple)) and value <= 0):
            args.parser.error(f"--{name.replace('_', '-')} must be > 0")
    try:  # before the run, which may take minutes: its results must have somewhere to go
        for flag in ("json", "plot", "trace"):
            if getattr(args, flag, None) is not None:
                check_output_path(getattr(args, flag), f"--{flag}")
    except CLIError as e:
        args.parser.error(str(e))
    if args.plot is not None:
        pyplot()  # matplotlib is there (or one `error:` line now, not after the run)
    args.tracer = None
    if args.scenario in TRACED and args.trace is not None:
        from refserve.simulator.trace import EngineTrace

        args.tracer = EngineTrace()
    machine = machine_info()
    print(f"machine: {machine_line(machine)}\ncommand: {args.command}", flush=True)
    try:
        body = module.run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    result = {"scenario": args.scenario, "machine": machine, "command": args.command,
              "quick": args.quick, **body}
    if args.json:
        write_json(result, args.json)
    if args.plot:
        module.plot(result, args.plot)
    if args.tracer is not None:
        args.tracer.write(args.trace)
        print(f"trace: {args.trace} ({len(args.tracer.recorders)} engine(s); open it in "
              "https://ui.perfetto.dev)")
    return 0
