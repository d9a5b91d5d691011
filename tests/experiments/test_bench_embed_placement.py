"""`experiments.bench_embed_placement`: its arguments are checked before any server starts (the
measurement itself serves two real servers per round; its figures are in the README)."""

import pytest

from experiments.bench_embed_placement import main, median_of


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
