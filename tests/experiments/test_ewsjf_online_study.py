"""The ewsjf-online study end to end on a small size: its JSON's shape and what every cell holds."""

import json

from experiments import ewsjf_online_study as study


def test_study_writes_steady_and_shift_per_seed(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(study, "FAST", study.Size(300, 600))
    out = tmp_path / "online.json"
    assert study.main(["--fast", "--seeds", "0,1", "--window", "20", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    steady, shift = result["steady"], result["shift"]
    assert set(steady["per_seed"]) == set(shift["per_seed"]) == {"0", "1"}
    for cell in steady["per_seed"].values():
        assert cell["ewsjf"]["served_share"] == cell["ewsjf-online"]["served_share"] == 1.0
        assert cell["candidates"] >= 1
    assert isinstance(steady["within_seed_spread"], bool)
    for cell in shift["per_seed"].values():
        assert cell["shift_s"] == 600 / 12 / 3
        assert {"short_ttft_before", "short_ttft_after", "long_ttft_after"} <= set(cell["ewsjf-online"])
        assert all(a["kind"] in ("scoring", "layout") for a in cell["adoptions"])
    assert "(b) shift" in capsys.readouterr().out
