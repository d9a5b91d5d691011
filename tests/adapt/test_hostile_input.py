"""Hostile input: every importer and the CLI's flags, fuzzed.

What must hold for any input: a clear error (a `TraceError` of one line naming the file, and the
line where one is at fault; on the command line one stderr line and exit 2) or a correct result --
never another exception, a traceback, a hang, or a silently different answer. Mutations that keep
a file's meaning (a byte-order mark, CRLF line ends, gzip) must give the very same trace.
"""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import adapt.cli.replay as cli_replay
from adapt.cli import main
from adapt.requests import SLO, CompletedRequest
from adapt.steplog import load_step_log
from adapt.tokenizer import TOKENIZERS, count_tokens, minilm_offsets, well_formed
from adapt.traces import MAX_TOKENS, Trace, TraceError, load_trace, prompt_hash

REPO = Path(__file__).resolve().parents[2]
FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# One valid file per importer: (name, text); each has at least three data rows.
SEEDS: dict[str, tuple[str, str]] = {
    "azure": (
        "azure.csv",
        "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,100,20\n0.5,2000,7\n1.25,35,400\n",
    ),
    "lengths": ("lengths.csv", "num_prefill_tokens,num_decode_tokens\n100,20\n2000,7\n35,400\n"),
    "burstgpt": (
        "burst.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,100,50,150,Conversation log\n6,GPT-4,80,3,83,API log\n9,ChatGPT,60,10,70,API log\n",
    ),
    "mooncake": (
        "moon.jsonl",
        "".join(
            json.dumps({"timestamp": t, "input_length": i, "output_length": o, "hash_ids": [1, 2]}) + "\n"
            for t, i, o in [(0, 100, 20), (500, 2000, 7), (1250, 35, 400)]
        ),
    ),
    "alpaca": (
        "alpaca.jsonl",
        "".join(
            json.dumps({"instruction": text, "output_tokens": n, "generator": "g"}) + "\n"
            for text, n in [("say hi", 3), ("write a long poem about the sea", 120), ("sum 2 and 2", 1)]
        ),
    ),
    "requestlog": (
        "requests.jsonl",
        "".join(
            json.dumps(
                CompletedRequest(
                    f"r{i}", t, p, o, t + 0.1, t + 1.0, slo=SLO("deadline", deadline_s=9)
                ).to_dict()
            )
            + "\n"
            for i, (t, p, o) in enumerate([(0.0, 100, 20), (0.5, 2000, 7), (1.25, 35, 400)])
        ),
    ),
}
STEP_LOG = (
    "start_s,tokens,sampled,num_decodes,duration_s\n0.0,100,1,0,0.01\n0.01,3,3,3,0.004\n0.02,50,2,1,0.006\n"
)


def _load(path: Path) -> Trace:
    return load_trace(path, tokenizer="whitespace")  # no model files: the counts are what matter here


def _check_error(err: TraceError, path: Path, line: int | None = None) -> None:
    message = str(err)
    assert "\n" not in message and str(path) in message, message
    if line is not None:
        assert f"{path}:{line}:" in message or "no usable rows" in message, message


def _check_trace(trace: Trace) -> None:
    """What any loaded trace satisfies, whatever the file looked like."""
    report = trace.report
    assert len(trace) == len(trace.output_tokens) >= 1
    assert report.loaded == len(trace) and report.rows_read == report.loaded + sum(report.skipped.values())
    for counts in (trace.prompt_tokens, trace.output_tokens):
        assert counts.dtype == np.int64 and counts.min() >= 1 and counts.max() <= MAX_TOKENS
    if trace.arrival_s is not None:
        assert np.isfinite(trace.arrival_s).all() and trace.arrival_s[0] == 0
        assert (np.diff(trace.arrival_s) >= 0).all()


def _same(a: Trace, b: Trace) -> None:
    assert a.report.format == b.report.format
    assert a.prompt_tokens.tolist() == b.prompt_tokens.tolist()
    assert a.output_tokens.tolist() == b.output_tokens.tolist()
    assert (a.arrival_s is None) == (b.arrival_s is None)
    if a.arrival_s is not None:
        assert a.arrival_s.tolist() == b.arrival_s.tolist()


def _write(directory: Path, name: str, data: bytes) -> Path:
    path = directory / name
    path.write_bytes(data)
    return path


# ----------------------------------------------------------------- meaning-preserving mutations
@FUZZ
@given(
    fmt=st.sampled_from(sorted(SEEDS)),
    bom=st.booleans(),
    crlf=st.booleans(),
    gz=st.booleans(),
    trailing=st.sampled_from(["", "\n", "\n\n", "\r\n"]),
)
def test_bom_crlf_gzip_and_blank_lines_change_nothing(fmt, bom, crlf, gz, trailing):
    name, text = SEEDS[fmt]
    with tempfile.TemporaryDirectory() as tmp:
        original = _load(_write(Path(tmp), name, text.encode()))
        changed = text + trailing
        if crlf:
            changed = changed.replace("\n", "\r\n")
        data = ("\ufeff" if bom else "").encode() + changed.encode()
        mutated = _load(
            _write(Path(tmp), "m." + name + (".gz" if gz else ""), gzip.compress(data) if gz else data)
        )
    _same(mutated, original)
    _check_trace(mutated)


# ------------------------------------------------------------------------ destructive bytes
byte_damage = st.one_of(
    st.tuples(st.just("truncate"), st.floats(0, 1)),
    st.tuples(st.just("flip"), st.floats(0, 1), st.integers(1, 255)),
    st.tuples(st.just("insert"), st.floats(0, 1), st.binary(min_size=1, max_size=8)),
)


def _damage(data: bytes, damage: tuple) -> bytes:
    at = min(int(damage[1] * len(data)), len(data) - 1)
    if damage[0] == "truncate":
        return data[:at]
    if damage[0] == "flip":
        return data[:at] + bytes([data[at] ^ damage[2]]) + data[at + 1 :]
    return data[:at] + damage[2] + data[at:]


@FUZZ
@given(fmt=st.sampled_from(sorted(SEEDS)), damage=byte_damage, gz=st.booleans())
def test_damaged_bytes_are_an_error_or_a_sane_trace(fmt, damage, gz):
    name, text = SEEDS[fmt]
    data = text.encode()
    data = _damage(gzip.compress(data), damage) if gz else _damage(data, damage)
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), name + (".gz" if gz else ""), data)
        try:
            trace = _load(path)
        except TraceError as err:
            _check_error(err, path)
        else:
            _check_trace(trace)


@FUZZ
@given(damage=byte_damage, gz=st.booleans())
def test_damaged_step_logs_are_an_error_or_clean_numbers(damage, gz):
    data = STEP_LOG.encode()
    data = _damage(gzip.compress(data), damage) if gz else _damage(data, damage)
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), "steps.csv" + (".gz" if gz else ""), data)
        try:
            frame = load_step_log(path)
        except TraceError as err:
            _check_error(err, path)
        else:
            for column in {"tokens", "duration_s"} | (set(frame.columns) & {"sampled", "num_decodes"}):
                values = frame[column].to_numpy(dtype=np.float64)
                assert np.isfinite(values).all() and (values >= 0).all()


# ------------------------------------------------------------------- structured mutations
# A cell's text and what it means as a token count: a number, or None (must be an error).
COUNT_CELLS: dict[str, float | None] = {
    "7": 7, " 7 ": 7, "7.0": 7, "1e9": 1e9, "1000000001": None, "1e20": None, "1e300": None,
    "-1": None, "nan": None, "inf": None, "-inf": None, "1.5": None, "": None, "abc": None, "0x10": None,
}  # fmt: skip
TIME_CELLS: dict[str, float | None] = {
    "7": 7, "1.5": 1.5, "1e9": 1e9, "1e11": None, "1e300": None, "-1": None, "nan": None,
    "inf": None, "": None, "abc": None,
}  # fmt: skip


@FUZZ
@given(
    fmt=st.sampled_from(["azure", "lengths", "burstgpt"]),
    row=st.integers(0, 2),
    column=st.integers(0, 5),
    cell=st.sampled_from(sorted(COUNT_CELLS)),
)
def test_a_hostile_csv_cell_is_reported_at_its_line_or_read_as_it_means(fmt, row, column, cell):
    name, text = SEEDS[fmt]
    header, *rows = [line.split(",") for line in text.strip().split("\n")]
    column %= len(header)
    title = header[column]
    timestamp = title in ("arrived_at", "Timestamp")
    counted = title in ("num_prefill_tokens", "num_decode_tokens", "Request tokens", "Response tokens")
    if not (timestamp or counted):
        return  # free-text columns (model, log type) are not read
    table = TIME_CELLS if timestamp else COUNT_CELLS
    cell = cell if cell in table else "7"
    rows[row][column] = cell
    content = "\n".join(",".join(r) for r in [header, *rows]) + "\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), name, content.encode())
        meaning = table[cell]
        if meaning is None:
            with pytest.raises(TraceError) as err:
                _load(path)
            _check_error(err.value, path, line=row + 2)
            assert f"field '{title}'" in str(err.value)
            return
        trace = _load(path)
    _check_trace(trace)
    if counted:
        values = (
            trace.prompt_tokens if title in ("num_prefill_tokens", "Request tokens") else trace.output_tokens
        )
        assert int(meaning) in values.tolist()


# A JSON value (as text) and what it means in a count or timestamp field: a number, or None (an error).
JSON_VALUES: dict[str, float | None] = {
    "7": 7, "7.0": 7, '"7"': 7, "1e9": 1e9, "NaN": None, "Infinity": None, "-1": None, "1e20": None,
    "1.5": None, "true": None, "null": None, "[1]": None, "{}": None, "9" * 5000: None,
}  # fmt: skip


@FUZZ
@given(
    row=st.integers(0, 2),
    key=st.sampled_from(["timestamp", "input_length", "output_length", "hash_ids"]),
    value=st.sampled_from([*sorted(JSON_VALUES), "<missing>", '[1, "a"]', "[true]", "[]"]),
)
def test_a_hostile_mooncake_field_is_reported_at_its_line_or_read_as_it_means(row, key, value):
    name, text = SEEDS["mooncake"]
    lines = text.strip().split("\n")
    record = json.loads(lines[row])
    if value == "<missing>":
        del record[key]
        lines[row] = json.dumps(record)
    else:
        record[key] = "__VALUE__"
        lines[row] = json.dumps(record).replace('"__VALUE__"', value)
    meaning = JSON_VALUES.get(value)
    if key == "hash_ids":
        ok = value in ("[1]", "[]", "<missing>")
    elif key == "timestamp":
        ok = meaning is not None or value == "1.5"  # milliseconds need not be whole
    else:
        ok = meaning is not None
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), name, ("\n".join(lines) + "\n").encode())
        if not ok:
            with pytest.raises(TraceError) as err:
                _load(path)
            _check_error(err.value, path, line=row + 1)
            return
        trace = _load(path)
    _check_trace(trace)
    if key in ("input_length", "output_length"):
        assert (
            int(meaning) in (trace.prompt_tokens if key == "input_length" else trace.output_tokens).tolist()
        )


def _loaded_or_refused_at(name: str, lines: list[str], row: int):
    """Load a JSON-lines file of `lines` named `name`: an error must name the file and `row`'s
    line; a trace must be sane (returned, or None after an error)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), name, ("\n".join(lines) + "\n").encode())
        try:
            trace = _load(path)
        except TraceError as err:
            _check_error(err, path, line=row + 1)
            return None
        _check_trace(trace)
        return trace


@FUZZ
@given(
    fmt=st.sampled_from(["alpaca", "requestlog"]),
    row=st.integers(0, 2),
    value=st.sampled_from([*sorted(JSON_VALUES), "<missing>", '"text"', "-5"]),
    data=st.data(),
)
def test_hostile_json_records_are_an_error_at_their_line_or_sane(fmt, row, value, data):
    name, text = SEEDS[fmt]
    lines = text.strip().split("\n")
    record = json.loads(lines[row])
    key = data.draw(st.sampled_from(sorted(record)))
    if value == "<missing>":
        del record[key]
        lines[row] = json.dumps(record)
    else:
        record[key] = "__VALUE__"
        lines[row] = json.dumps(record).replace('"__VALUE__"', value)
    _loaded_or_refused_at(name, lines, row)


@FUZZ
@given(
    row=st.integers(0, 2),
    key=st.sampled_from(["prompt_blocks", "answer_blocks"]),
    value=st.sampled_from([*sorted(JSON_VALUES), "[1, 2]", '["a1", null]', '{"a": 1}', '["00ff", "ab12"]']),
)
def test_hostile_content_keys_in_a_request_log_are_an_error_at_their_line_or_kept(row, key, value):
    """A request-log record's prefix-cache keys (`extra`, as a server with prefix caching writes
    them): anything but a list of strings is an error at its line, never a crash in a gate."""
    name, text = SEEDS["requestlog"]
    lines = text.strip().split("\n")
    record = json.loads(lines[row])
    record["extra"] = {key: "__VALUE__"}
    lines[row] = json.dumps(record).replace('"__VALUE__"', value)
    trace = _loaded_or_refused_at(name, lines, row)
    if trace is not None:
        assert trace.columns[key][row] == tuple(json.loads(value))


@FUZZ
@given(
    row=st.integers(0, 2),
    column=st.sampled_from(["start_s", "tokens", "sampled", "num_decodes", "duration_s"]),
    cell=st.sampled_from(sorted(COUNT_CELLS)),
)
def test_a_hostile_step_log_cell_is_reported_at_its_line_or_read_as_it_means(row, column, cell):
    header, *rows = [line.split(",") for line in STEP_LOG.strip().split("\n")]
    rows[row][header.index(column)] = cell
    content = "\n".join(",".join(r) for r in [header, *rows]) + "\n"
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), "steps.csv", content.encode())
        meaning = COUNT_CELLS[cell]
        number = None if cell.strip() in ("", "abc", "0x10") else float(cell)
        if column == "start_s":  # any finite number
            meaning = number if number is not None and math.isfinite(number) else None
        elif number is not None and math.isfinite(number) and number >= 0:
            meaning = number  # step features are numbers >= 0, not necessarily whole
        if meaning is None:
            with pytest.raises(TraceError) as err:
                load_step_log(path)
            _check_error(err.value, path, line=row + 2)
            assert f"field '{column}'" in str(err.value)
            return
        frame = load_step_log(path)
    assert meaning in frame[column].tolist()


# ------------------------------------------------------------------------- lone surrogates
# Valid JSON may escape a lone surrogate ("\ud800"): json.loads makes it a str that UTF-8, the Rust
# tokenizer and MiniLM all refuse. Drawn often, since a random code point is rarely one.
SURROGATE_TEXT = st.lists(
    st.one_of(
        st.characters(exclude_categories=()), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF)
    ),
    max_size=30,
).map("".join)


@FUZZ
@given(texts=st.lists(SURROGATE_TEXT, max_size=4))
def test_any_text_is_hashed_counted_and_cut_into_tokens_without_an_error(texts):
    for text in texts:
        clean = well_formed(text)
        assert len(clean) == len(text) and clean.encode("utf-8").decode("utf-8") == clean
        assert 1 <= prompt_hash(text) < 2**63 and prompt_hash(text) == prompt_hash(clean)
    for tokenizer in TOKENIZERS:
        counts = count_tokens(texts, tokenizer)
        assert len(counts) == len(texts) and all(count >= 0 for count in counts)
    for text, ends in zip(texts, minilm_offsets(texts), strict=True):
        assert all(0 < end <= len(text) for end in ends)  # offsets into the text as given


def test_a_prompt_with_a_lone_surrogate_loads_and_is_counted():
    records = [
        {"instruction": "say \ud800 hi", "output_tokens": 3},
        {"instruction": "ok", "output_tokens": 1},
    ]
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), "alpaca.jsonl", "".join(json.dumps(r) + "\n" for r in records).encode())
        trace = load_trace(path)  # counted with MiniLM's WordPiece
    assert trace.prompt_tokens.tolist()[0] == count_tokens(["say \ufffd hi"])[0]
    assert prompt_hash(trace.prompt_text[0]) == prompt_hash("say \ufffd hi")


# ---------------------------------------------------------------------------- CLI arguments
# Hostile texts for numeric flags; which flags accept each is decided below, independently of
# the CLI's own checks.
FLAG_TEXTS = ["0", "-1", "1", "2", "3", "4", "1.5", "nan", "inf", "-inf", "1e300", "1e-300", "abc", "", "1e3"]
MISTRAL_TP = {1, 2, 4, 8, 16, 32}  # slai-tiers replays mistral-7b: 32 heads, 8 KV heads


def _accepts(flag: str, text: str) -> bool:
    try:
        value = float(text)
    except ValueError:
        return False
    if not math.isfinite(value):
        return False
    if flag == "--rate":
        return 1e-6 <= value < 1e9
    if flag == "--duration":
        return 0 < value < 1e10
    if value != int(value) or not text.lstrip("-").isdigit():
        return False  # integers are written as integers
    if flag == "--tp":
        return int(value) in MISTRAL_TP
    return value >= (0 if flag == "--seed" else 1)


POLICY_SPECS = st.builds(
    lambda name, key, value: f"{name}:{key}={value}" if key else name,
    st.sampled_from(["fcfs", "sarathi", "spf", "slai-fixed", "edf", "fastserve", "nope"]),
    st.sampled_from([None, "token_budget", "offset", "order", "levels", "colour"]),
    st.sampled_from(["0", "1.5", "NaN", "Infinity", "-1", "true", "null", '"spf"', "[1]", "64", "5"]),
)


@pytest.fixture
def quick_replay(monkeypatch):
    """The replay itself runs on the first 3 requests: the flags are what is under test."""
    real = cli_replay.build_setup

    def build_setup(args):
        setup = real(args)
        setup.requests = setup.requests[:3]
        return setup

    monkeypatch.setattr(cli_replay, "build_setup", build_setup)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(
    flags=st.dictionaries(
        st.sampled_from(
            ["--rate", "--duration", "--num-requests", "--tp", "--token-budget", "--max-running", "--seed"]
        ),
        st.sampled_from(FLAG_TEXTS),
        max_size=3,
    ),
    policy=POLICY_SPECS,
)
def test_replay_flags_are_one_line_and_exit_2_or_a_replay(quick_replay, capsys, flags, policy):
    argv = [
        "replay",
        "--workload",
        "slai-tiers",
        "--no-mlflow",
        "--quiet",
        "--jobs",
        "1",
        "--policies",
        policy,
    ]
    for flag, text in flags.items():
        argv += [f"{flag}={text}"]  # `=` so that "-1" is a value, not a flag
    code = main(argv)
    captured = capsys.readouterr()
    errors = [line for line in captured.err.splitlines() if not line.startswith("replaying ")]
    assert code in (0, 2), captured.err
    if code == 2:
        assert len(errors) == 1 and errors[0].startswith("adapt: error: "), captured.err
    valid = all(_accepts(flag, text) for flag, text in flags.items())
    if not valid:
        assert code == 2, f"accepted {flags}"
    elif code == 2:  # valid flags, refused for a stated reason: the policy spec or an empty replay
        reasons = ("--policies", "no requests to replay", "would generate")
        assert any(reason in errors[0] for reason in reasons), errors[0]
    else:
        assert "done" in captured.out.splitlines()[0]


@pytest.mark.parametrize(
    ("argv", "content"),
    [
        (["trace", "stats", "{path}"], b"\x1f\x8b\x08\x00garbage-not-deflate"),  # corrupt gzip
        (["replay", "--workload", "slai-tiers", "--tp", "0", "--no-mlflow"], None),
        (
            ["--tracking-uri", "sqlite:///{dir}/r.db", "models", "promote", "x", "1", "--alias", "../../x"],
            None,
        ),
    ],
)
def test_the_real_command_prints_no_traceback(tmp_path, argv, content):
    path = tmp_path / "t.csv.gz"
    if content is not None:
        path.write_bytes(content)
    argv = [a.format(path=path, dir=tmp_path) for a in argv]
    done = subprocess.run(
        [sys.executable, "-m", "adapt.cli", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    errors = [line for line in done.stderr.splitlines() if " INFO " not in line]  # MLflow's table setup
    assert done.returncode == 2 and len(errors) == 1 and errors[0].startswith("adapt: error:"), done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ('{"token_budget": NaN}', "token_budget: expected int, got nan"),
        ('{"block_size": 16.5}', "block_size: expected int, got 16.5"),
        ('{"block_size": "16"}', "block_size: expected int, got '16'"),
        ('{"max_running": true}', "max_running: expected int, got True"),
        ('{"prefix_caching": "false"}', "prefix_caching: expected bool, got 'false'"),
        ('{"intake_delay_s": Infinity}', "intake_delay_s: expected float, got inf"),
        ('{"kv_capacity_tokens": -5}', "kv_capacity_tokens: must hold at least one block"),
        ('{"kv_capacity_tokens": 8}', "kv_capacity_tokens: must hold at least one block (16 tokens), got 8"),
        ('{"token_budget": 0}', "token_budget: must be > 0, got 0"),
        ('{"batch_time_ema": 0}', "batch_time_ema: must be in (0, 1], got 0"),
    ],
)
def test_a_hostile_engine_file_is_refused_naming_it_and_the_field(fields, message):
    """`engine.json` (what a server wrote, what a gate and `adapt conformance` replay on): a value
    of the wrong type or range is one error naming the file, not a crash deep in a replay."""
    from adapt.replay.engine import EngineConfig

    with pytest.raises(ValueError) as err:
        EngineConfig.from_json(fields, source="logs/engine.json")
    assert str(err.value).startswith("logs/engine.json: ") and message in str(err.value)


def test_an_engine_file_keeps_working_values_and_defaults_what_an_older_server_left_out():
    from adapt.replay.engine import EngineConfig

    config = EngineConfig(
        token_budget=512, kv_capacity_tokens=4096, prediction_delay_s=0.25, prefix_caching=True
    )
    assert EngineConfig.from_json(config.to_json()) == config
    assert EngineConfig.from_json('{"token_budget": 512, "intake_delay_s": 1}') == EngineConfig(
        token_budget=512, intake_delay_s=1
    )


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("request_id", '["a"]', "request_id: expected a non-empty string, got ['a']"),
        ("request_id", "null", "request_id: expected a non-empty string, got None"),
        ("prompt_text", "12345", "prompt_text: expected a string or null, got int"),
        ("prompt_text", '{"role": "user"}', "prompt_text: expected a string or null, got dict"),
    ],
)
def test_a_request_log_field_of_the_wrong_type_is_an_error_at_its_line(key, value, message):
    # An unhashable id crashed a retrain's de-duplication with no file named; a prompt that is not
    # a string reached the prompt components' trainers as text.
    name, text = SEEDS["requestlog"]
    lines = text.strip().split("\n")
    record = json.loads(lines[1])
    record[key] = "__VALUE__"
    lines[1] = json.dumps(record).replace('"__VALUE__"', value)
    with tempfile.TemporaryDirectory() as tmp:
        path = _write(Path(tmp), name, ("\n".join(lines) + "\n").encode())
        with pytest.raises(TraceError) as err:
            _load(path)
    assert f"{path}:2: " in str(err.value) and message in str(err.value)
