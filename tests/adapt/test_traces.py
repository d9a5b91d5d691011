import gzip
import json

import numpy as np
import pytest

from adapt.cli import main
from adapt.traces import TraceError, detect_format, load_trace, trace_stats


def write(path, text):
    path.write_text(text)
    return path


def test_azure_csv_with_processed_columns(tmp_path):
    path = write(tmp_path / "a.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n1.5,20,7\n")
    trace = load_trace(path)
    assert trace.report.format == "azure"
    assert trace.prompt_tokens.tolist() == [10, 20]
    assert trace.arrival_s.tolist() == [0.0, 1.5]


def test_azure_raw_columns_with_datetime_and_unsorted_rows(tmp_path):
    path = write(
        tmp_path / "raw.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:50.0000000,30,3\n"
        "2023-11-16 18:15:46.5000000,10,1\n",
    )
    trace = load_trace(path)
    assert trace.report.reordered == 1
    assert trace.prompt_tokens.tolist() == [10, 30]
    assert trace.arrival_s.tolist() == pytest.approx([0.0, 3.5])


def test_lengths_csv_has_no_timestamps(tmp_path):
    path = write(
        tmp_path / "l.csv", "num_prefill_tokens,num_decode_tokens,num_total_tokens,pd_ratio\n5,6,11,0.8\n"
    )
    trace = load_trace(path)
    assert trace.arrival_s is None and trace.output_tokens.tolist() == [6]


def test_burstgpt_counts_failed_requests(tmp_path):
    path = write(
        tmp_path / "b.csv",
        "Timestamp,Model,Request tokens,Response tokens,Total tokens,Log Type\n"
        "5,ChatGPT,100,50,150,Conversation log\n"
        "6,ChatGPT,80,0,80,Conversation log\n"
        "7,GPT-4,60,10,70,API log\n",
    )
    trace = load_trace(path)
    assert trace.report.format == "burstgpt"
    assert trace.report.rows_read == 3 and trace.report.loaded == 2
    assert trace.report.skipped == {"zero output tokens (failed request)": 1}
    assert trace.arrival_s.tolist() == [0.0, 2.0]


def test_mooncake_jsonl_in_milliseconds(tmp_path):
    lines = [
        {"timestamp": 0, "input_length": 100, "output_length": 10, "hash_ids": [1, 2]},
        {"timestamp": 2500, "input_length": 50, "output_length": 5, "hash_ids": [1]},
    ]
    path = write(tmp_path / "m.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n")
    trace = load_trace(path)
    assert trace.report.format == "mooncake"
    assert trace.arrival_s.tolist() == [0.0, 2.5]
    assert trace.columns["hash_ids"] == [[1, 2], [1]]


def test_alpaca_jsonl_gz_counts_tokens_with_named_tokenizer(tmp_path):
    path = tmp_path / "p.jsonl.gz"
    rows = [
        {"instruction": "Say hello", "output": "Hello there my friend", "generator": "g1", "category": "c"},
        {"instruction": "Nothing", "output": "", "generator": "g2"},
    ]
    with gzip.open(path, "wt") as handle:
        handle.write("\n".join(json.dumps(r) for r in rows))
    trace = load_trace(path, tokenizer="whitespace")
    assert trace.report.tokenizer == "whitespace"
    assert trace.prompt_tokens.tolist() == [2] and trace.output_tokens.tolist() == [4]
    assert trace.report.skipped == {"empty instruction or output": 1}
    assert trace.columns["generator"] == ["g1"]


def test_alpaca_default_tokenizer_is_minilm_wordpiece(tmp_path):
    path = write(tmp_path / "p.json", json.dumps([{"instruction": "Hello world", "output": "Hi"}]))
    trace = load_trace(path)
    assert trace.report.tokenizer == "minilm-wordpiece"
    assert trace.prompt_tokens.tolist() == [2]


def test_request_log_round_trip(tmp_path):
    from adapt.requests import CompletedRequest

    records = [
        CompletedRequest("a", 0.0, 10, 3, 0.5, 1.0),
        CompletedRequest("b", 0.2, 12, 0, None, None, outcome="dropped"),
    ]
    path = write(tmp_path / "log.jsonl", "\n".join(json.dumps(r.to_dict()) for r in records))
    trace = load_trace(path)
    assert trace.report.format == "requestlog"
    assert len(trace) == 1 and trace.report.skipped == {"outcome dropped": 1}


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        ("empty.csv", "", "empty file"),
        ("header.csv", "arrived_at,foo\n1,2\n", "missing column"),
        (
            "neg.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,5\n1,-3,5\n",
            ":3: field 'num_prefill_tokens'",
        ),
        (
            "nan.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0,ten,5\n",
            ":2: field 'num_prefill_tokens'",
        ),
        ("frac.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,5.5\n", "whole number"),
        ("cells.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10\n", "expected 3 cells"),
        (
            "bad.jsonl",
            '{"timestamp": 0, "input_length": 1, "output_length": 1}\n{oops\n',
            ":2: unparsable JSON",
        ),
        (
            "miss.jsonl",
            '{"timestamp": 0, "input_length": 1, "output_length": 1}\n{"timestamp": 1, "input_length": 1}\n',
            "field 'output_length': missing",
        ),
        ("what.csv", "a,b\n1,2\n", "unrecognised CSV header"),
        ("x.parquet", "nope", "unknown extension"),
        ("onlyheader.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n", "no data rows"),
    ],
)
def test_malformed_inputs_name_file_line_and_field(tmp_path, name, content, message):
    path = write(tmp_path / name, content)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert message in str(err.value)
    assert str(path) in str(err.value)


def test_cli_prints_one_line_and_exits_nonzero(tmp_path, capsys):
    path = write(tmp_path / "neg.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,-5\n")
    assert main(["trace", "stats", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "neg.csv:2: field 'num_decode_tokens'" in err[0]
    assert main(["trace", "stats", str(tmp_path / "missing.csv")]) == 2


def test_detect_format_of_shared_files(shared_traces):
    assert detect_format(shared_traces / "azure_conv_2023.csv") == "azure"
    assert detect_format(shared_traces / "sharegpt_lengths.csv") == "lengths"


@pytest.mark.parametrize(
    ("name", "count", "in_median", "out_median"),
    [
        ("azure_conv_2023.csv", 19366, 1020, 129),
        ("sharegpt_lengths.csv", 30731, 1730, 415),
    ],
)
def test_trace_stats_match_the_data_readme(shared_traces, tmp_path, name, count, in_median, out_median):
    out = tmp_path / "stats.json"
    assert main(["trace", "stats", str(shared_traces / name), "--json", str(out)]) == 0
    stats = json.loads(out.read_text())
    assert stats["count"] == count
    assert stats["input"]["median"] == pytest.approx(in_median, abs=1)
    assert stats["output"]["median"] == pytest.approx(out_median, abs=1)


def test_azure_stats_mean_and_rate(shared_traces):
    stats = trace_stats(load_trace(shared_traces / "azure_conv_2023.csv"))
    assert stats["input"]["mean"] == pytest.approx(1155, abs=1)
    assert stats["output"]["mean"] == pytest.approx(211, abs=1)
    assert stats["input"]["p90"] == pytest.approx(2735, abs=2)
    assert stats["rate_rps"] == pytest.approx(5.5, abs=0.05)  # the data README's 5.5 req/s
    assert stats["duration_s"] == pytest.approx(3501.7, abs=0.1)  # first to last arrival


def test_take_and_head_keep_columns_aligned(tmp_path):
    path = write(tmp_path / "a.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,2\n1,3,4\n2,5,6\n")
    trace = load_trace(path)
    sub = trace.take(np.array([2, 0]))
    assert sub.prompt_tokens.tolist() == [5, 1] and sub.output_tokens.tolist() == [6, 2]
    assert len(trace.head(2)) == 2


AZURE = "arrived_at,num_prefill_tokens,num_decode_tokens\n0.0,10,5\n1.5,20,7\n"


@pytest.mark.parametrize("gz", [False, True])
def test_byte_order_mark_and_crlf_keep_the_timestamps(tmp_path, gz):
    """A BOM glued onto `arrived_at` used to hide the timestamp column (read as a lengths CSV,
    replayed with Poisson arrivals instead of the trace's)."""
    data = ("\ufeff" + AZURE.replace("\n", "\r\n")).encode("utf-8")
    path = tmp_path / ("bom.csv.gz" if gz else "bom.csv")
    path.write_bytes(gzip.compress(data) if gz else data)
    trace = load_trace(path)
    assert trace.report.format == "azure"
    assert trace.arrival_s.tolist() == [0.0, 1.5] and trace.prompt_tokens.tolist() == [10, 20]


def test_byte_order_mark_on_jsonl(tmp_path):
    path = tmp_path / "m.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"timestamp": 0, "input_length": 3, "output_length": 2}\r\n')
    assert load_trace(path).prompt_tokens.tolist() == [3]


@pytest.mark.parametrize(
    ("name", "content", "message"),
    [
        (
            "huge.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1e20,5\n",
            ":2: field 'num_prefill_tokens'",
        ),
        ("inf.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,10,inf\n", "finite"),
        (
            "t.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n1e300,10,5\n",
            ":3: field 'arrived_at'",
        ),
        ("tnan.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\nnan,10,5\n", "field 'arrived_at'"),
        (
            "hash.jsonl",
            '{"timestamp": 0, "input_length": 1, "output_length": 1, "hash_ids": 7}\n',
            ":1: field 'hash_ids': expected a list of integers",
        ),
        (
            "bool.jsonl",
            '{"timestamp": 0, "input_length": true, "output_length": 1}\n',
            "field 'input_length'",
        ),
        ("digits.jsonl", '{"timestamp": 0, "input_length": ' + "9" * 5000 + ', "output_length": 1}\n', ":1:"),
        ("ms.jsonl", '{"timestamp": 1e300, "input_length": 1, "output_length": 1}\n', "field 'timestamp'"),
        (
            "skipped.csv",
            "arrived_at,num_prefill_tokens,num_decode_tokens\n0,0,5\n1,3,0\n",
            "no usable rows: all 2 skipped",
        ),
        ("nul.csv", "arrived_at,num_prefill_tokens,num_decode_tokens\n0,1,1\n1,2\x00,3\n", ":3:"),
        (
            "alp.jsonl",
            '{"instruction": "hi", "output_tokens": 100000000000000000000}\n',
            "field 'output_tokens'",
        ),
        (
            "log.jsonl",
            '{"request_id": "a", "outcome": "dropped", "arrival_s": NaN, "prompt_tokens": 1,'
            ' "output_tokens": 0, "first_token_s": null, "finish_s": null}\n',
            ":1: field 'arrival_s'",
        ),
    ],
)
def test_out_of_range_and_wrongly_typed_values_name_file_line_and_field(tmp_path, name, content, message):
    path = write(tmp_path / name, content)
    with pytest.raises(TraceError) as err:
        load_trace(path)
    assert message in str(err.value) and str(path) in str(err.value)


@pytest.mark.parametrize("damage", ["flip", "truncate"])
def test_damaged_gzip_is_a_trace_error(tmp_path, damage):
    data = bytearray(gzip.compress(AZURE.encode() * 50))
    if damage == "flip":
        data[len(data) // 2] ^= 0xFF
    else:
        data = data[: len(data) // 2]
    path = tmp_path / "a.csv.gz"
    path.write_bytes(bytes(data))
    with pytest.raises(TraceError, match=r"a\.csv\.gz: cannot read"):
        load_trace(path)


def test_cli_on_a_file_whose_rows_are_all_skipped(tmp_path, capsys):
    path = write(tmp_path / "zero.csv", "num_prefill_tokens,num_decode_tokens\n5,0\n")
    assert main(["trace", "stats", str(path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "zero.csv: no usable rows" in err[0]


@pytest.mark.parametrize(
    "moment", ["1900-01-01 00:00:00", "9999-01-01 00:00:00", "1969-12-31 23:59:59+00:00"]
)
def test_a_date_time_is_held_to_the_range_numeric_timestamps_are(tmp_path, moment):
    path = write(tmp_path / "raw.csv", f"TIMESTAMP,ContextTokens,GeneratedTokens\n{moment},10,5\n")
    with pytest.raises(TraceError, match=r"raw\.csv:2: field 'TIMESTAMP': date-time out of range"):
        load_trace(path)


def test_azures_seven_digit_fraction_keeps_its_utc_offset(tmp_path):
    """`...46.6805900+05:00` was cut to 26 characters, dropping the offset: read as a naive local
    time, five hours away from the next row, which kept its offset."""
    path = write(
        tmp_path / "raw.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.6805900+05:00,10,1\n"
        "2023-11-16 18:15:47+05:00,20,2\n"
        "2023-11-16 13:15:48.0000000+00:00,30,3\n",
    )
    assert load_trace(path).arrival_s.tolist() == pytest.approx([0.0, 0.31941, 1.31941])


def test_a_date_time_without_an_offset_is_utc_wherever_the_trace_is_loaded(tmp_path, monkeypatch):
    """Read as local time, two rows 90 minutes apart in UTC were 150 minutes apart in New York,
    across the night its clocks went back."""
    import time

    path = write(
        tmp_path / "raw.csv",
        "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-05 01:30:00,10,1\n2023-11-05 03:00:00,20,2\n",
    )
    monkeypatch.setenv("TZ", "EST5EDT,M3.2.0,M11.1.0")  # POSIX rules: no time-zone database needed
    time.tzset()
    try:
        arrivals = load_trace(path).arrival_s.tolist()
    finally:
        monkeypatch.undo()
        time.tzset()
    assert arrivals == [0.0, 5400.0]
