"""The CLI's one error type for bad arguments, its parser, and the checked argument types.

Every flag is checked for type, range and finiteness as argparse reads it (no `x or default`
later that would turn a 0 into the default, no `inf` rate reaching a workload generator), and a bad
one is the same one line, exit 2, as every other error the CLI reports.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import NoReturn, TypeVar

T = TypeVar("T")


class UsageError(ValueError):
    """A user-facing error: printed as one line, exit status 2."""


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are `UsageError`s: `main` prints them like every other
    error (one line, exit 2) instead of argparse printing the usage block and exiting itself."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (see {self.prog} --help)")


def integer(low: int = 1, high: int | None = None) -> Callable[[str], int]:
    """An argparse type: a whole number in [low, high]."""

    def parse(raw: str) -> int:
        try:
            value = int(raw)
        except ValueError:
            value = None
        if value is None or value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(f"must be {_bounds(low, high)} (an integer), got {raw!r}")
        return value

    return parse


def number(
    low: float = 0.0, high: float = math.inf, *, low_open: bool = True, says: str | None = None
) -> Callable[[str], float]:
    """An argparse type: a finite number above `low` (or at least `low`, `low_open=False`) and
    below `high` (exclusive). `says` words the range for the error message."""
    if says is None:
        if math.isinf(high):
            says = f"{'>' if low_open else '>='} {low:g}"
        else:
            says = f"in {'(' if low_open else '['}{low:g}, {high:g})"

    def parse(raw: str) -> float:
        try:
            value = float(raw)
        except ValueError:
            value = math.nan
        above = value > low if low_open else value >= low
        if not (math.isfinite(value) and above and value < high):
            raise argparse.ArgumentTypeError(f"must be {says} (a finite number), got {raw!r}")
        return value

    return parse


def given(value: T | None, default: T) -> T:
    """The flag's value unless it was not given (a 0 is a value, not a missing flag)."""
    return default if value is None else value


def _bounds(low: int, high: int | None) -> str:
    if high is None:
        return "> 0" if low == 1 else f">= {low}"
    return f"in [{low}, {high}]"


POSITIVE = number()
# Arrivals per second: below one a week, or a billion a second, is a unit slip; a rate of 1e-300
# would put arrivals where a step's duration no longer changes the clock.
RATE = number(1e-6, 1e9, low_open=False, says="> 0, at least 1e-06 and below 1e+09")
# Seconds, bounded as trace timestamps are (adapt.traces.MAX_TIMESTAMP_S).
DURATION = number(0.0, 1e10, says="> 0 and below 1e+10")
# Seconds that may be zero (a delay), bounded as DURATION is.
DELAY = number(0.0, 1e10, low_open=False, says=">= 0 and below 1e+10")
COUNT = integer()
SEED = integer(0)


def add_api_key_argument(parser: argparse.ArgumentParser, flag: str, whose: str) -> None:
    """`flag KEY`: the `--api-key` a server (`whose`: "the server's", "the servers'") was started
    with, which its status route asks for. Its default is vLLM's own `VLLM_API_KEY` environment
    variable, which keeps the key out of the process list."""
    parser.add_argument(
        flag,
        default=os.environ.get("VLLM_API_KEY"),
        metavar="KEY",
        help=f"{whose} --api-key, without which the status is refused (default: the VLLM_API_KEY"
        " environment variable, which keeps the key out of the process list)",
    )


def add_parallel_arguments(parser: argparse.ArgumentParser, *, ray: bool = True) -> None:
    """`--jobs N`: independent replays on N processes (default: every core the process may use);
    `--ray [ADDRESS]`: as Ray tasks instead, on a local runtime or an existing cluster. Results are
    the same either way and for any N."""
    from adapt.parallel import default_jobs

    parser.add_argument(
        "--jobs",
        type=COUNT,
        default=default_jobs(),
        help="independent replays run on N processes; results do not depend on N (default: every"
        " core, %(default)s here)",
    )
    if ray:
        parser.add_argument(
            "--ray",
            nargs="?",
            const="local",
            metavar="ADDRESS",
            help="run the replays as Ray tasks: on a local Ray runtime with --jobs CPUs (no ADDRESS),"
            " or on the cluster at ADDRESS (auto, ray://head:10001)",
        )
