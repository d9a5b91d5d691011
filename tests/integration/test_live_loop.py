"""The online-adaptation loop, live: `adapt serve --log-dir` under traffic that shifts, `adapt
retrain --every` beside it reading the server's own logs and gating on the server's own engine;
what it promotes is hot-swapped while requests flow, and none of them fails."""

from __future__ import annotations

import json
import re

import pytest

from experiments import live_loop

pytestmark = pytest.mark.slow


def test_the_loop_retrains_from_the_servers_logs_and_swaps_under_load_without_failing_a_request(tmp_path):
    out, runs = tmp_path / "report.json", tmp_path / "runs"
    live_loop.main(["--fast", "--arms", "loop", "--json", str(out), "--keep", str(runs)])
    arm = json.loads(out.read_text())["arms"]["loop"]
    assert arm["failed"] == 0 and arm["requests"] == live_loop.FAST.num_requests
    logged = (runs / "loop" / "logs").glob("requests-*.jsonl")
    assert sum(len(path.read_text().splitlines()) for path in logged) == arm["requests"]

    # Each pass refits the server's cost model from its step log, then gates the layout on it.
    layouts = [line for line in arm["retrain"] if line.startswith(live_loop.COMPONENT)]
    assert layouts and all("on the server's engine (cost-model v" in line for line in layouts), arm["retrain"]
    promoted = {int(v) for v in re.findall(r"registered v(\d+) \(promoted\)", "\n".join(layouts))}
    # What the server swapped to is what the gate promoted, never the champion it started with.
    assert {swap["version"] for swap in arm["swaps"]} <= promoted
    assert all(swap["version"] > arm["champion"] for swap in arm["swaps"])
