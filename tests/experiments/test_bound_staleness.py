"""`experiments.bound_staleness`: the model-upgrade drift for JITServe's length bound, on real answers."""

from __future__ import annotations

import json

import numpy as np
import pytest

from experiments import bound_staleness


@pytest.mark.slow
def test_a_small_run_reports_coverage_and_goodput_per_arm(tmp_path, capsys):
    """The forest fitted on the old model's answers covers the new, longer ones worse than the
    refit does (real AlpacaEval lengths: gpt4_0613 answers about half as long as gpt4_1106_preview)."""
    out = tmp_path / "staleness.json"
    argv = ["--rates", "2.0", "--requests", "120", "--seeds", "5", "--json", str(out)]
    assert bound_staleness.main(argv) == 0
    report = json.loads(out.read_text())
    assert report["coverage"]["stale"] < report["coverage"]["fresh"] - 0.2
    (cell,) = report["cells"]
    assert set(cell["goodput"]) == set(bound_staleness.ARMS)
    assert all(0.0 < share <= 1.0 for share in cell["served"].values())
    ratio = cell["goodput"]["stale"] / cell["goodput"]["fresh"]
    assert report["stale_over_fresh"]["2.0"] == [ratio]
    assert np.isclose(report["mean"]["2.0"]["oracle"], cell["goodput"]["oracle"])
    assert f"| 2.0 | {cell['goodput']['stale'] / 1e6:.3f} |" in capsys.readouterr().out
