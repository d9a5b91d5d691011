import gzip

import pandas as pd
import pytest

from adapt.steplog import load_step_log
from adapt.traces import TraceError

GOOD = "start_s,tokens,sampled,duration_s\n0.5,10,1,0.01\n0.0,20,2,0.02\n"


def test_a_valid_log_reads_as_pandas_reads_it_sorted_by_start(tmp_path):
    path = tmp_path / "steps.csv"
    path.write_text(GOOD)
    frame = load_step_log(path)
    expected = pd.read_csv(path).sort_values("start_s").reset_index(drop=True)
    pd.testing.assert_frame_equal(frame, expected)
    jsonl = tmp_path / "steps.jsonl"
    expected.to_json(jsonl, orient="records", lines=True)
    pd.testing.assert_frame_equal(load_step_log(jsonl), expected)


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.csv", "", "empty file"),
        ("header.csv", "tokens,duration_s\n", "no steps"),
        ("ragged.csv", "tokens,duration_s\n1,0.1\n2,0.2,9\n", "Expected 2 fields in line 3"),
        ("short.csv", "tokens,duration_s\n1,0.1\n2\n", ":3: field 'duration_s'"),
        ("text.csv", "tokens,duration_s\n1,0.1\nmany,0.2\n", ":3: field 'tokens': expected a finite number"),
        ("inf.csv", "tokens,duration_s\n1,inf\n", ":2: field 'duration_s'"),
        ("neg.csv", "tokens,duration_s\n1,-0.1\n", ":2: field 'duration_s'"),
        ("nostart.csv", "start_s,tokens,duration_s\nx,1,0.1\n", "field 'start_s'"),
        ("missing.csv", "tokens\n1\n", "missing column(s) duration_s"),
        ("torn.jsonl", '{"tokens": 1, "dur\n', "no steps"),  # a torn line only
        ("bool.jsonl", '{"tokens": true, "duration_s": 0.1}\n', ":1: field 'tokens'"),
    ],
)
def test_malformed_step_logs_are_one_trace_error(tmp_path, name, content, message):
    path = tmp_path / name
    path.write_text(content)
    with pytest.raises(TraceError) as err:
        load_step_log(path)
    assert message in str(err.value) and str(path) in str(err.value)
    assert "\n" not in str(err.value)


def test_a_torn_line_of_a_jsonl_log_is_skipped(tmp_path, caplog):
    # What a flush cut short by a full disk or a kill leaves: a record's first half, and (the
    # flush retried) the next records glued after it. One such line used to fail every refit.
    path = tmp_path / "steps-000001.jsonl"
    path.write_text(
        '{"tokens": 1, "duration_s": 0.1}\n{"tokens": 2, "dur{"tokens": 2, "duration_s": 0.2}\n'
        '{"tokens": 3, "duration_s": 0.3}\n'
    )
    assert load_step_log(path)["tokens"].tolist() == [1, 3]
    assert "1 torn line(s) skipped" in caplog.text


def test_corrupt_gzip_and_missing_file(tmp_path):
    data = bytearray(gzip.compress(GOOD.encode() * 100))
    data[len(data) // 2] ^= 0xFF
    path = tmp_path / "steps.csv.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError, match="cannot read"):
        load_step_log(path)
    with pytest.raises(TraceError, match="no such file"):
        load_step_log(tmp_path / "nope.csv")
