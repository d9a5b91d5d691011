"""`experiments.history_staleness`: the model-change drift for SageSched's semantic history."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import history_staleness


@pytest.mark.slow
def test_a_small_run_reports_mean_ttlt_per_arm(tmp_path, capsys):
    out = tmp_path / "staleness.json"
    argv = ["--rates", "4.5", "--requests", "150", "--seeds", "5", "--jobs", "1", "--json", str(out)]
    assert history_staleness.main(argv) == 0
    report = json.loads(out.read_text())
    assert (report["old"], report["new"]) == (["phi-2"], ["Yi-34B-Chat"])
    (cell,) = report["cells"]
    assert (cell["rate"], cell["seed"], set(cell["ttlt_mean"])) == (4.5, 5, set(history_staleness.ARMS))
    assert all(value > 0 for value in cell["ttlt_mean"].values())
    assert report["stale_over_fresh"]["4.5"] == [cell["ttlt_mean"]["stale"] / cell["ttlt_mean"]["fresh"]]
    assert np.isclose(report["mean"]["4.5"]["fresh"], cell["ttlt_mean"]["fresh"])
    assert f"| 4.5 | {cell['ttlt_mean']['stale']:.2f} |" in capsys.readouterr().out
