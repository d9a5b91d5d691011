"""`adapt status [URL] [--watch SECONDS]`: what a running `adapt serve` is doing, in a terminal;
`adapt status --fleet URL,URL,...`: one row per replica and the components whose versions differ.

One screen from two reads of the server: `GET /v1/adapt/status` (policy, component versions --
and a promoted version loaded but not yet applied, which an idle engine applies with its next
request -- swaps, drift alarms, the policy's own state; written by the engine core,
`serving_hooks.live`) and
`GET /metrics` (the `adapt_*` series, parsed with prometheus_client's own parser): SLO
attainment by class, the online prediction quality next to the held-out figure, step times, queue
and errors. Counters are totals since the server started, as Prometheus holds them; rates are
Grafana's job (`deploy/grafana/adapt-dashboard.json`). A server started with `--no-metrics` still
answers the status part. A server started with vLLM's `--api-key` answers the status only with one
of its keys (`--api-key KEY`, by default the `VLLM_API_KEY` environment variable, as vLLM reads it);
`/metrics` it answers to anyone.
"""

from __future__ import annotations

import math
import sys
import time
from collections import defaultdict
from typing import Any

DEFAULT_URL = "http://127.0.0.1:8000"
TIMEOUT_S = 5.0

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _get_metrics(url: str) -> bytes | None:
    """The server's `/metrics` text; None when it answers 404 or 503 there (no metrics to read, e.g.
    started with `--no-metrics`): the status part still shows."""
    from serving_hooks.http import NoStatusRoute, StatusNotReady, Unreachable, get_body

    address = f"{url.rstrip('/')}/metrics"
    try:
        return get_body(address, TIMEOUT_S)
    except (StatusNotReady, NoStatusRoute):
        return None
    except Unreachable as exc:
        raise Unreachable(f"{exc}; is adapt serve running there?") from None


def scrape(url: str) -> Samples:
    """Every sample of the server's `/metrics`, by name (parsed with prometheus_client's parser)."""
    from prometheus_client.parser import text_string_to_metric_families

    metrics_text = _get_metrics(url)
    samples: Samples = defaultdict(list)
    for family in text_string_to_metric_families((metrics_text or b"").decode()):
        for sample in family.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def read_server(url: str, api_key: str | None = None) -> tuple[dict[str, Any] | None, Samples]:
    """(status JSON, every sample of /metrics by name). The status is None while the engine has
    not written one, or when the server does not serve the route: the metrics still show. A keyed
    server's 401 is an error (`ApiKeyRequired`), not a missing status: it says how to give the key."""
    samples = scrape(url)
    from serving_hooks.http import NoStatusRoute, StatusNotReady, read_status

    try:
        return read_status(url, TIMEOUT_S, api_key), samples
    except (StatusNotReady, NoStatusRoute):
        return None, samples


def _by(samples: Samples, name: str, label: str) -> dict[str, float]:
    """Values of one series summed over every label but `label`."""
    totals: dict[str, float] = defaultdict(float)
    for labels, value in samples.get(name, []):
        totals[labels.get(label, "")] += value
    return dict(totals)


def _total(samples: Samples, name: str) -> float:
    return sum(value for _, value in samples.get(name, []))


def _mean_ms(samples: Samples, name: str) -> str:
    count = _total(samples, f"{name}_count")
    return f"{1000 * _total(samples, f'{name}_sum') / count:.2f} ms" if count else "-"


def _fraction(value: float | None) -> str:
    """A gauge's value; '-' when there is none (NaN: e.g. a new version's empty window)."""
    return "-" if value is None or math.isnan(value) else f"{value:.3f}"


def render(status: dict[str, Any] | None, samples: Samples, now: float | None = None) -> str:
    """The terminal summary of one read (see the module docstring)."""
    now = time.time() if now is None else now
    lines = []
    policy = (status or {}).get("policy") or next(
        (labels["policy"] for labels, value in samples.get("adapt_policy_info", []) if value == 1), "-"
    )
    lines.append(f"policy      {policy}")
    if status is not None:
        lines.append(
            f"swaps       {status.get('swaps', 0)} ok, {status.get('failed_swaps', 0)} failed"
            f" (policy swaps {status.get('policy_swaps', 0)})"
        )
    versions = _versions(status, samples)
    swaps = _by(samples, "adapt_component_swaps_total", "component")
    failed = _by(samples, "adapt_component_failed_swaps_total", "component")
    last = _by(samples, "adapt_component_last_swap_timestamp_seconds", "component")
    loaded = (status or {}).get("loaded") or {}
    for name, version in sorted(versions.items()):
        since = f", last swap {now - last[name]:.0f} s ago" if name in last else ""
        counts = f"  swaps {swaps[name]:.0f}, failed {failed.get(name, 0):.0f}" if name in swaps else ""
        # A slot loads a promoted version at once; the engine applies it at its next step.
        pending = loaded.get(name, version)
        staged = f"  (v{pending} loaded: live at the next step)" if pending != version else ""
        lines.append(f"  {name:<20} v{version if version is not None else '-'}{counts}{since}{staged}")
    # The policy's own state (`Policy.describe()`), its plain figures: e.g. ewsjf-online's adoptions
    state = ((status or {}).get("policy_state")) or {}
    shown = [f"{k}={v}" for k, v in state.items() if k != "policy" and not isinstance(v, dict | list)]
    if shown:
        lines.append("state       " + ", ".join(shown))
    if not any(name.startswith("adapt_") for name in samples):
        lines.append("(no adapt_* metrics: the server runs with --no-metrics or is not adapt serve)")
        return "\n".join(lines)

    outcomes: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for labels, value in samples.get("adapt_slo_requests_total", []):
        outcomes[labels["slo_class"]][labels["outcome"]] += value
    goodput = _by(samples, "adapt_goodput_tokens_total", "slo_class")
    lines.append("SLO         class         requests   met  violated  dropped  attainment  goodput tokens")
    for kind, counts in sorted(outcomes.items()):
        total = sum(counts.values())
        attainment = counts["met"] / total if total else None
        lines.append(
            f"            {kind:<12}{total:>10.0f}{counts['met']:>6.0f}{counts['violated']:>10.0f}"
            f"{counts['dropped']:>9.0f}{_fraction(attainment):>12}{goodput.get(kind, 0):>16.0f}"
        )
    quality = (status or {}).get("quality") or {}
    coverage = _by(samples, "adapt_length_bound_coverage", "component")
    ranks = _by(samples, "adapt_length_rank_correlation", "component")
    if coverage or ranks:
        lines.append("quality     component           window  coverage  held-out  over-est  rank corr  drift")
        held = _by(samples, "adapt_length_bound_heldout_coverage", "component")
        over = _by(samples, "adapt_length_bound_overestimate_ratio", "component")
        window = _by(samples, "adapt_length_bound_window_requests", "component")
        alarm = _by(samples, "adapt_length_bound_drift_alarm", "component")
        for name in sorted({*coverage, *ranks}):
            count = window.get(name, quality.get(name, {}).get("requests", 0))
            lines.append(
                f"            {name:<20}{count:>6.0f}{_fraction(coverage.get(name)):>10}"
                f"{_fraction(held.get(name)):>10}{_fraction(over.get(name)):>10}"
                f"{_fraction(ranks.get(name)):>11}  {'ALARM' if alarm.get(name) == 1 else 'ok'}"
            )
    drift = (status or {}).get("drift_alarms") or []
    if drift:
        lines.append(f"DRIFT       online coverage below held-out: {', '.join(drift)}")
    for name, share in sorted(_by(samples, "adapt_semantic_neighbour_share", "component").items()):
        lines.append(f"neighbours  {name}: {share:.3f} of requests with text had enough close neighbours")
    predictions = (status or {}).get("predictions")
    if predictions:  # `adapt.predictions.PredictionStats.summary`
        lines.append(
            f"predictions off the step: {predictions['submitted']} submitted, first scheduled on a"
            f" prior {_fraction(predictions['share_on_prior'])}, mean wait"
            f" {1000 * predictions['mean_wait_s']:.1f} ms, refused {predictions['refused']}"
            f", {predictions.get('supplied', 0)} came embedded"
        )
    embedder = (status or {}).get("prompt_embedder")
    if embedder:  # `serving_hooks.prompt_embedder.PromptEmbedder.summary` (adapt serve --embed-prompts)
        state = "ready" if embedder["ready"] else f"not loaded ({embedder['load_error'] or 'loading'})"
        lines.append(
            f"embedding before the engine: {state}, {embedder['embedded']} embedded,"
            f" {embedder['passed_through']} went on without, {embedder['failed']} failed,"
            f" {embedder['waiting']} waiting"
        )
    preempted = _by(samples, "adapt_requests_preempted_total", "cause")
    dropped = _by(samples, "adapt_requests_dropped_total", "reason")
    lines.append(
        f"steps       policy {_mean_ms(samples, 'adapt_step_seconds')} per step (mean),"
        f" engine step {_mean_ms(samples, 'adapt_engine_step_seconds')},"
        f" FCFS fallbacks {_total(samples, 'adapt_fallback_steps_total'):.0f},"
        f" policy errors {_total(samples, 'adapt_policy_errors_total'):.0f}"
    )
    waiting = _by(samples, "adapt_waiting_requests", "slo_class")
    lines.append(
        f"queue       running {_total(samples, 'adapt_running_requests'):.0f},"
        f" waiting {', '.join(f'{k} {v:.0f}' for k, v in sorted(waiting.items()) if v) or '0'},"
        f" KV usage {_total(samples, 'adapt_kv_usage_ratio'):.2f}"
    )
    lines.append(
        f"requests    admitted {_total(samples, 'adapt_requests_admitted_total'):.0f},"
        f" preempted {', '.join(f'{k} {v:.0f}' for k, v in sorted(preempted.items())) or '0'},"
        f" dropped {', '.join(f'{k} {v:.0f}' for k, v in sorted(dropped.items())) or '0'}"
    )
    return "\n".join(lines)


Read = tuple[str, dict[str, Any] | None, Samples, str | None]  # url, status, samples, error


def read_fleet(urls: list[str], api_key: str | None = None) -> list[Read]:
    """Every replica's read; one that does not answer is a row with its error, not a failure."""
    reads = []
    for url in urls:
        try:
            status, samples = read_server(url, api_key)
            reads.append((url, status, samples, None))
        except ConnectionError as exc:
            reads.append((url, None, {}, str(exc)))
    return reads


def _versions(status: dict[str, Any] | None, samples: Samples) -> dict[str, int]:
    versions = {**(status or {}).get("components", {})}
    for name, value in _by(samples, "adapt_component_version", "component").items():
        if not math.isnan(value):  # NaN: a component a policy swap retired (`serving_hooks.metrics`)
            versions.setdefault(name, int(value))
    return versions


def render_fleet(reads: list[Read]) -> str:
    """One row per replica (policy, versions, swaps, requests, SLO attainment, drift alarms), then
    every component whose replicas serve different versions: the split an operator acts on."""
    header = f"{'replica':<29}{'policy':<14}{'versions':<31}{'swaps':>5}{'requests':>11}{'attainment':>12}"
    lines = [header]
    serving: dict[str, dict[int, list[str]]] = defaultdict(lambda: defaultdict(list))
    for url, status, samples, error in reads:
        if error is not None:
            lines.append(f"{url:<29}UNREACHABLE: {error}")
            continue
        versions = _versions(status, samples)
        for name, version in versions.items():
            serving[name][version].append(url)
        outcomes = _by(samples, "adapt_slo_requests_total", "outcome")
        total = sum(outcomes.values())
        attainment = outcomes.get("met", 0) / total if total else None
        policy = (status or {}).get("policy", "-")
        listed = ", ".join(f"{name} v{version}" for name, version in sorted(versions.items())) or "-"
        swaps = f"{(status or {}).get('swaps', 0)}/{(status or {}).get('failed_swaps', 0)}"
        drift = (status or {}).get("drift_alarms") or []
        lines.append(
            f"{url:<29}{policy:<14}{listed:<31}{swaps:>5}{total:>11.0f}{_fraction(attainment):>12}"
            + (f"  DRIFT {', '.join(drift)}" if drift else "")
        )
    for name, by_version in sorted(serving.items()):
        if len(by_version) > 1:
            split = "; ".join(
                f"v{version} on {len(urls)} ({', '.join(urls)})"
                for version, urls in sorted(by_version.items())
            )
            lines.append(f"SPLIT       {name}: {split}")
    lines.append("swaps: ok/failed; attainment: SLO met over every request that left, all classes")
    return "\n".join(lines)


def run_status(
    url: str, watch_s: float | None, fleet: list[str] | None = None, api_key: str | None = None
) -> int:
    """Print the summary (of one server, or of a fleet: exit 1 if a replica does not answer)
    once, or every `watch_s` seconds until interrupted; the status asked with `api_key`."""
    while True:
        if fleet:
            reads = read_fleet(fleet, api_key)
            text, code = render_fleet(reads), int(any(error for *_, error in reads))
        else:
            text, code = render(*read_server(url, api_key)), 0
        if watch_s is None:
            print(text)
            return code
        title = "fleet" if fleet else url
        sys.stdout.write("\033[2J\033[H" + f"{title}  {time.strftime('%H:%M:%S')}\n" + text + "\n")
        sys.stdout.flush()
        time.sleep(watch_s)
