"""The CLI's one error type for bad arguments, its parser, and the checked argument types.

Every flag is checked for type, range and finiteness as argparse reads it (no `x or default`
later that would turn a 0 into the default, no `inf` rate reaching a workload generator), and a bad
one is the same one line, exit 2, as every other error the CLI reports. So are a comma list's items
(`SEED_LIST`, `choice_list`) and an output path (`OUTPUT`: checked, and its folder made, before the work
whose result it holds; `write_json` then writes it whole or not at all). The experiment scripts use the
same types, so a bad flag there fails as argparse reads it too.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import secrets
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NoReturn, TypeVar

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


def choice(choices: Iterable[str]) -> Callable[[str], str]:
    """An argparse type: one of `choices`, for a list item (a lone flag has argparse's `choices`)."""
    names = tuple(choices)

    def parse(raw: str) -> str:
        if raw not in names:
            raise argparse.ArgumentTypeError(f"must be one of {', '.join(names)}, got {raw!r}")
        return raw

    return parse


def comma_list(item: Callable[[str], T]) -> Callable[[str], list[T]]:
    """An argparse type: comma-separated items, each read by the argparse type `item`. An empty
    item (`1,,2`, a trailing comma, `''`) or one given twice is refused rather than skipped or
    counted twice: either is a typo, and a study run on it averages over the wrong seeds."""

    def parse(raw: str) -> list[T]:
        values: list[T] = []
        for piece in (piece.strip() for piece in raw.split(",")):
            if not piece:
                raise argparse.ArgumentTypeError(f"expected comma-separated items, none empty; got {raw!r}")
            try:
                value = item(piece)
            except argparse.ArgumentTypeError as exc:
                raise argparse.ArgumentTypeError(f"each item {exc}") from None
            if value in values:
                raise argparse.ArgumentTypeError(f"{piece} given twice (in {raw!r})")
            values.append(value)
        return values

    return parse


def choice_list(choices: Iterable[str]) -> Callable[[str], list[str]]:
    """An argparse type: some of `choices`, comma-separated; an unknown name fails as the flag is
    read, not after the earlier names' results were computed (or silently dropped)."""
    return comma_list(choice(choices))


SEED_LIST = comma_list(SEED)
COUNT_LIST = comma_list(COUNT)
RATE_LIST = comma_list(RATE)
POSITIVE_LIST = comma_list(POSITIVE)
NAME_LIST = comma_list(str)


def prepare_output(given: str | os.PathLike[str]) -> Path:
    """The file a command writes when its work is done (`--json OUT`), checked and its folder made
    before the work starts: a path it cannot write then fails in a second, not after the minutes of
    work whose result it was to hold. Raises `UsageError`."""
    raw = os.fspath(given)
    if not raw.strip():
        raise UsageError("empty output path")
    path = Path(raw)
    if path.is_dir():
        raise UsageError(f"{raw}: is a directory; expected a file to write")
    _make_folder(path.parent, raw)
    return path


def prepare_output_dir(given: str | os.PathLike[str]) -> Path:
    """A folder a command writes its results into (`--out DIR`), made and checked before the work
    starts, for the reason `prepare_output` gives. Raises `UsageError`."""
    raw = os.fspath(given)
    if not raw.strip():
        raise UsageError("empty output folder")
    path = Path(raw)
    _make_folder(path, raw)
    return path


def _make_folder(folder: Path, raw: str) -> None:
    """Make `folder` (given as part of the flag value `raw`) and check this process may write in it."""
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):  # the folder, or a folder above it, is a file
        raise UsageError(f"{raw}: cannot make the folder {folder}: a part of that path is a file") from None
    except OSError as exc:
        raise UsageError(f"{raw}: cannot make the folder {folder}: {exc.strerror}") from None
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"{raw}: cannot write in {folder} (permission denied)")


def _argparse_type(prepare: Callable[[str], Path]) -> Callable[[str], Path]:
    """`prepare` as an argparse type: argparse shows an ArgumentTypeError's message, while for a
    ValueError (which a UsageError is) it prints only 'invalid value'."""

    def parse(raw: str) -> Path:
        try:
            return prepare(raw)
        except UsageError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    parse.__name__ = prepare.__name__
    return parse


OUTPUT = _argparse_type(prepare_output)
OUTPUT_DIR = _argparse_type(prepare_output_dir)


def _write_whole(path: str | Path, text: str) -> None:
    """Write through a temporary file beside `path` and `os.replace`: a reader, or a run killed
    mid-write, sees the old file or the whole new one, never a truncated one. A symbolic link is
    followed, so the file it points at is the one replaced."""
    target = Path(os.path.realpath(path))
    temporary = target.with_name(f".{target.name}.{secrets.token_hex(4)}.tmp")
    descriptor = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, target)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_json(path: str | Path, data: Any, **dumps: Any) -> None:
    """`data` as indented JSON (`dumps`: json.dumps's other options, `default=str`), written as
    `_write_whole` writes: whole or not at all."""
    _write_whole(path, json.dumps(data, indent=2, **dumps) + "\n")


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
