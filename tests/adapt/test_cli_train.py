"""`adapt train` hands each component the options it reads and refuses the rest: a flag it ignored
once exited 0 and registered a version as if it had been used."""

import dataclasses

import pytest

import adapt.cli
from adapt.cli import main
from adapt.parallel import default_jobs
from adapt.replay.cost import DEFAULT_OVERLAP
from pipelines.catalogue import CATALOGUE, TrainOptions
from pipelines.outcome import TrainOutcome


@pytest.fixture
def trained(monkeypatch) -> dict[str, TrainOptions]:
    """Every component's pipeline replaced by one that records the options it was given."""
    seen: dict[str, TrainOptions] = {}

    def recorder(name: str):
        def train(registry, options: TrainOptions) -> TrainOutcome:
            seen[name] = options
            return TrainOutcome(version=1, promoted=False, metrics={}, champion_metrics=None)

        return train

    for name, entry in CATALOGUE.items():
        monkeypatch.setitem(CATALOGUE, name, dataclasses.replace(entry, train=recorder(name)))
    monkeypatch.setattr(adapt.cli, "_registry", lambda args: None)
    return seen


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["slai-offset", "--data", "x", "--no-replay"], "train slai-offset: --data, --no-replay not used"),
        (["ewsjf-meta-policy", "--data", "x"], "train ewsjf-meta-policy: --data not used"),
        (["ewsjf-meta-policy", "--trials", "3"], "--trials not used by this component"),
        (["cost-model", "--data", "x", "--test-share", "0.2"], "--test-share not used"),
        (["cost-model", "--data", "x", "--no-replay"], "--no-replay not used"),
        (["qrf-length", "--rate", "3"], "--rate not used"),
        (["semantic-history", "--num-requests", "50"], "--num-requests not used"),
        (["neural-length", "--overlap", DEFAULT_OVERLAP], "--overlap not used"),
        (["pattern-graph", "--test-share", "0.2", "--jobs", str(default_jobs() + 1)], "--test-share, --jobs"),
    ],
)
def test_an_option_the_component_does_not_read_is_refused(trained, capsys, args, message):
    assert main(["train", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("adapt: error: ") and message in err[0], err
    assert "(it reads --" in err[0]
    assert trained == {}  # refused before anything ran


def test_the_options_a_component_reads_reach_it_and_the_rest_keep_their_defaults(trained):
    args = ["slai-offset", "--trials", "3", "--rate", "1.5", "--num-requests", "40", "--overlap", "step"]
    assert main(["train", *args, "--jobs", "1", "--promote-if-better"]) == 0
    slai = trained["slai-offset"]
    assert (slai.trials, slai.rate, slai.num_requests, slai.overlap, slai.jobs) == (3, 1.5, 40, "step", 1)
    assert slai.promote_if_better
    assert main(["train", "slai-offset"]) == 0
    assert (trained["slai-offset"].trials, trained["slai-offset"].overlap) == (20, DEFAULT_OVERLAP)
    assert main(["train", "qrf-length", "--data", "d.jsonl", "--test-share", "0.2", "--no-replay"]) == 0
    qrf = trained["qrf-length"]
    assert (qrf.data, qrf.test_share, qrf.replay) == ("d.jsonl", 0.2, False)
    assert main(["train", "pattern-graph", "--margin", "0.1"]) == 0
    assert (trained["pattern-graph"].test_share, trained["pattern-graph"].replay) == (0.3, True)
    assert main(["train", "ewsjf-meta-policy", "--promote-if-better"]) == 0


def test_the_documented_train_invocations_pass_the_check(trained):
    """README's `adapt train` lines and the quickstart's components, as they are typed."""
    for args in (
        ["cost-model", "--data", "steps.csv", "--promote-if-better"],
        ["slai-offset", "--overlap", "step"],
        ["ewsjf-meta-policy"],
        ["semantic-history"],
        ["qrf-length", "--data", "f.jsonl", "--test-share", "0.3", "--margin", "0.02"],
        ["neural-length", "--no-replay"],
        ["pattern-graph", "--data", "graphs.jsonl"],
    ):
        assert main(["train", *args]) == 0, args
