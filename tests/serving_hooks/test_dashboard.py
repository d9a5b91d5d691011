"""The Grafana dashboard and the Prometheus example in deploy/ match what the server exports:
every panel queries only `adapt_*` series a `SchedulerMetrics` defines (under their exposition
names: `_total` for counters, `_bucket`/`_sum`/`_count` for histograms)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

from serving_hooks.metrics import SchedulerMetrics

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def _exported() -> set[str]:
    return {
        family.name + suffix
        for family in SchedulerMetrics().registry.collect()
        for suffix in SUFFIXES[family.type]
    }


def test_every_panel_queries_series_the_server_exports():
    dashboard = json.loads((DEPLOY / "grafana" / "adapt-dashboard.json").read_text())
    exported = _exported()
    assert dashboard["panels"] and dashboard["templating"]["list"][0]["type"] == "datasource"
    queried = set()
    for panel in dashboard["panels"]:
        names = {name for target in panel["targets"] for name in re.findall(r"\badapt_\w+", target["expr"])}
        assert names, f"panel {panel['title']!r} queries no adapt_* series"
        assert names <= exported, f"panel {panel['title']!r}: not exported: {sorted(names - exported)}"
        assert panel["datasource"]["uid"] == "${datasource}"
        queried |= names
    for name in (
        "adapt_step_seconds_bucket",
        "adapt_slo_requests_total",
        "adapt_length_bound_coverage",
        "adapt_component_swaps_total",
        "adapt_length_bound_drift_alarm",
    ):
        assert name in queried


def test_names_scripts_rely_on_are_exported():
    exported = _exported()
    assert {
        "adapt_step_seconds_bucket",
        "adapt_component_swaps_total",
        "adapt_component_failed_swaps_total",
        "adapt_slo_requests_total",
        "adapt_length_bound_coverage",
    } <= exported


def test_prometheus_example_scrapes_the_servers_metrics_route():
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    job = config["scrape_configs"][0]
    assert job["metrics_path"] == "/metrics" and job["static_configs"][0]["targets"]
