"""bench_throughput's summary: each policy's ratio is taken against the default of the same round."""

from experiments.bench_throughput import DEFAULT, round_order, summarise


def result(
    tokens_per_s: float, most_running: int = 64, errors: int = 0, finished: int = 10, cut_short: int = 0
) -> dict:
    return {
        "tokens_per_s": tokens_per_s,
        "most_running": most_running,
        "policy_errors": errors,
        "finished": finished,
        "cut_short": cut_short,
    }


def test_ratios_are_per_round_and_the_median_is_reported():
    runs = {
        DEFAULT: [result(100.0), result(50.0), result(80.0)],  # the machine slowed in round 2
        "sagesched": [result(95.0), result(49.0), result(60.0, errors=1, finished=9, cut_short=4)],
    }
    report = summarise(runs)
    assert report[DEFAULT]["round_ratios"] == [1.0, 1.0, 1.0]
    assert report["sagesched"]["round_ratios"] == [0.95, 0.98, 0.75]
    assert report["sagesched"]["ratio_to_default"] == 0.95  # median of the rounds' ratios
    assert report["sagesched"]["tok_per_s"] == 60.0  # median tokens/s (60, 49, 95 -> 60)
    assert report["sagesched"]["policy_errors"] == 1 and report["sagesched"]["finished"] == 9  # worst round
    assert report["sagesched"]["cut_short"] == 4  # the median round's drops, beside its tokens/s


def test_the_table_shows_what_the_model_delivered_and_its_failures():
    """A model that fails every batch costs no CPU: its policy's tokens/s would then measure the
    policy without its model, so the report says how many results came and how many batches failed."""
    runs = {
        DEFAULT: [result(100.0), result(100.0)],
        "sagesched": [
            {**result(94.0), "predicted": 0, "prediction_errors": 12},
            {**result(93.0), "predicted": 0, "prediction_errors": 9},
        ],
    }
    report = summarise(runs)
    assert report["sagesched"]["predicted"] == 0 and report["sagesched"]["prediction_errors"] == 12
    assert report[DEFAULT]["predicted"] is None and report[DEFAULT]["prediction_errors"] == 0


def test_each_configuration_takes_every_place_in_the_rounds():
    configs = [DEFAULT, "fcfs", "sagesched"]
    rounds = [round_order(configs, repeat) for repeat in range(3)]
    assert all(sorted(order) == sorted(configs) for order in rounds)
    for place in range(3):
        assert sorted(order[place] for order in rounds) == sorted(configs)


def test_an_even_number_of_rounds_reports_the_middle_of_the_two_middle_ratios():
    runs = {DEFAULT: [result(100.0)] * 4, "fcfs": [result(90.0), result(100.0), result(95.0), result(99.0)]}
    assert summarise(runs)["fcfs"]["ratio_to_default"] == 0.97
