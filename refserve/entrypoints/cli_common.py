"""What every command line of refserve shares: the parser, the error, the checks made first.

Every entry point (generate, serve, bench, capacity, course, selfcheck) builds its parser
from `ArgumentParser` here, so they all behave alike:

- a usage mistake is ONE line, `error: <what> (see <prog> --help)`, exit status 2, never a
  traceback (argparse's default prints the whole usage block first);
- no abbreviations (`allow_abbrev=False`): `--max-token 5` is an unknown flag, not a
  silent `--max-tokens 5`; subcommand parsers inherit it, being built from the same class;
- `--help` shows each default once (`HelpFormatter`).

Output paths are checked before the long work starts (`check_output_path`): a benchmark
that runs for minutes must not end in "folder does not exist".
"""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

EXIT_USAGE = 2


class CLIError(ValueError):
    """A user's mistake: the entry point prints it as one `error: ...` line, exit status 2."""


class HelpFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to an option's help, once: not when the help already speaks of
    its default, and not for None or False (an unset option or an off switch says nothing)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if ("default" in text or any(default is v for v in (None, False, argparse.SUPPRESS))
                or not action.option_strings):
            return text
        return f"{text} (default: %(default)s)" if text else "(default: %(default)s)"


class RawDescriptionHelpFormatter(HelpFormatter, argparse.RawDescriptionHelpFormatter):
    """HelpFormatter that keeps the description's line breaks (a module docstring)."""


class ArgumentParser(argparse.ArgumentParser):
    """argparse with refserve's conventions (see the module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"error: {' '.join(message.split())} (see {self.prog} --help)\n")


def check_output_path(path: Path, flag: str = "--json") -> None:
    """`path` (given with `flag`) can be written: checked before the work whose result it
    will hold.

    Raises CLIError naming the flag: the path is a folder, its folder does not exist, or it
    cannot be written there.
    """
    path = Path(path)
    if path.is_dir():
        raise CLIError(f"{flag} {path}: is a folder; give a file path")
    folder = path.parent
    if not folder.is_dir():
        raise CLIError(f"{flag} {path}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise CLIError(f"{flag} {path}: cannot write there (permission denied)")


def write_trace(trace, path: Path) -> None:
    """Write the engine's `--trace` timeline (`trace` None: no --trace was given). Raises
    CLIError naming the flag when the file cannot be written."""
    if trace is None:
        return
    try:
        trace.write(path)
    except OSError as e:
        raise CLIError(f"--trace {path}: cannot write it ({e.strerror})") from None


def json_object(text: str) -> dict:
    """argparse type: a JSON object given on the command line (--speculative-config)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not valid JSON ({e}): {text!r}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError(f"must be a JSON object {{...}}, got {text!r}")
    return value


_BARE_NUMBER = re.compile(r"\s*\d+(\.\d+)?\s*")


def memory_size(require_unit: bool):
    """argparse type for a memory size ('80GiB', '24GB', '512MiB').

    require_unit=True (capacity's --memory): a bare number is refused, because "80" read as
    80 bytes is never what was meant. False (--kv-cache-memory-bytes, whose name says bytes,
    as vLLM's): a bare number is a count of bytes.
    """
    from refserve.capacity import parse_memory

    def parse(text: str) -> int:
        if require_unit and _BARE_NUMBER.fullmatch(text):
            raise argparse.ArgumentTypeError(
                f"{text!r} has no unit; write e.g. {text.strip()}GiB or {text.strip()}GB "
                "(GiB = 2^30 bytes, GB = 10^9)")
        try:
            return parse_memory(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    return parse
