"""`experiments.bench_embed_placement`: its arguments are checked before any server starts (the
measurement itself serves two real servers per round; its figures are in docs/benchmarks.md)."""

import json

import pytest

from experiments.bench_embed_placement import engine_ttft_mean, main, median_of


@pytest.mark.parametrize(
    "argv", [["--placements", "gpu"], ["--placements", ","], ["--rate", "0"], ["--repeats", "0"]]
)
def test_bad_arguments_stop_before_anything_is_served(argv, capsys):
    with pytest.raises(SystemExit) as stopped:
        main(argv)
    assert stopped.value.code == 2 and "error:" in capsys.readouterr().err


def test_a_figure_is_the_median_of_the_rounds_that_have_it():
    rounds = [{"ttft_p50": 0.3}, {"ttft_p50": None}, {"ttft_p50": 0.1}, {"ttft_p50": 0.2}]
    assert median_of(rounds, "ttft_p50") == 0.2
    assert median_of([{"ttft_p50": None}], "ttft_p50") is None


def test_the_engines_ttft_counts_from_when_the_engine_got_each_finished_request(tmp_path):
    records = [
        {"request_id": "a", "arrival_s": 10.0, "first_token_s": 10.5, "outcome": "finished"},
        {"request_id": "b", "arrival_s": 11.0, "first_token_s": 11.25, "outcome": "finished"},
        {"request_id": "c", "arrival_s": 12.0, "first_token_s": None, "outcome": "dropped"},
    ]
    (tmp_path / "requests-000001.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    (tmp_path / "steps-000001.jsonl").write_text("")
    assert engine_ttft_mean(tmp_path) == 0.375
    assert engine_ttft_mean(tmp_path / "none") is None
