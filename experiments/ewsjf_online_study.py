"""ewsjf-online study: does the live meta-optimiser hold the champion at steady load and follow a shift?

    python -m experiments.ewsjf_online_study [--fast] [--seeds 0,1,2] [--window N] [--json OUT]

(a) steady: `ewsjf-mixed` at its default rate (40 req/s), `ewsjf` with the champion -- a layout
    fitted by Refine-and-Prune on pre-run prompt lengths of another seed, as the other studies fit
    theirs -- against `ewsjf-online` starting from the same champion. Headline: short-request mean
    TTFT and the share of requests served. ewsjf-online pays for exploring (half its windows run a
    candidate), so "within noise" is judged against the champion's own seed-to-seed spread.
(b) shift: `drift-chat-to-summaries` (chat, then 30% long summarisation prompts a third of the
    way in) with the stale pre-shift champion against `ewsjf-online` starting from it. Headline:
    short-request mean TTFT of the requests arriving after the shift; plus every adoption (when,
    which kind, whether its layout has queues for the 1024-4096-token prompts) and, as a check that
    an adopted layout was the better one, the headline of `ewsjf` replaying this run's post-shift
    requests with the last adopted layout against the stale one.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapt.cli.usage import COUNT, OUTPUT, SEED_LIST, write_json
from adapt.replay.cost import roofline
from adapt.replay.engine import ReplayEngine
from adapt.replay.metrics import ReplayResult
from adapt.requests import Request
from adapt.workloads import WORKLOADS
from adapt.workloads.drift import LONG_RANGE, pre_shift_lengths, shift_time
from pipelines.ewsjf import history_lengths
from predictors.ewsjf_meta import EwsjfMetaPolicy
from serving_hooks.policies.ewsjf import EWSJF
from serving_hooks.policies.ewsjf_online import OnlineEWSJF

TRAIN_LENGTHS = 2000  # pre-run prompt lengths each champion is fitted on
SHIFT_SHARE = 1 / 3  # where drift-chat-to-summaries shifts (its default)


@dataclass(frozen=True)
class Size:
    steady_requests: int
    shift_requests: int


FULL = Size(4000, 5400)
FAST = Size(1500, 2160)


def _short_ttft(
    result: ReplayResult, start_s: float = -np.inf, end_s: float = np.inf, label: str = "short"
) -> float:
    """Mean TTFT of the requests labelled `label` arriving in [start_s, end_s)."""
    table = result.table
    arrival = table.column("arrival_s")
    labels = np.array(table.vocabulary("label"), dtype=object)[table.column("label")]
    chosen = (labels == label) & (arrival >= start_s) & (arrival < end_s)
    return float(np.mean(table.column("first_token_s")[chosen] - arrival[chosen]))


def _run(workload: str, policy: Any, requests: list[Request]) -> ReplayResult:
    spec = WORKLOADS[workload]
    return ReplayEngine(policy, roofline(spec.model, spec.gpu, tp=spec.tp), spec.engine_config()).run(
        requests
    )


def _online(champion: EwsjfMetaPolicy, window: int, seed: int) -> OnlineEWSJF:
    return OnlineEWSJF(champion, window=window, seed=seed)


def steady_cell(seed: int, size: Size, window: int) -> dict[str, Any]:
    spec = WORKLOADS["ewsjf-mixed"]
    requests = spec.build(spec.rate, size.steady_requests, seed)
    champion = EwsjfMetaPolicy().fit(history_lengths(TRAIN_LENGTHS, seed=1000 + seed))
    cell: dict[str, Any] = {"champion_queues": len(champion.queues_)}
    online = _online(champion, window, seed)
    for arm, policy in (("ewsjf", EWSJF(champion)), ("ewsjf-online", online)):
        result = _run("ewsjf-mixed", policy, requests)
        metrics = result.metrics()
        cell[arm] = {
            "short_ttft_mean": _short_ttft(result),
            "served_share": metrics["completed"] / metrics["num_requests"],
            "long_ttft_p99": metrics["by_class"]["long"]["ttft_p99"],
        }
    cell["candidates"] = len(online.evaluations)
    cell["adoptions"] = _adoptions(online, 0.0)
    return cell


def _adoptions(policy: OnlineEWSJF, shift_s: float) -> list[dict[str, Any]]:
    return [
        {
            "at_s": a["at_s"],
            "after_shift_s": a["at_s"] - shift_s,
            "kind": a["kind"],
            "score": a["score"],
            "threshold": a["threshold"],
            "queues": len(a["queues"]),
            "covers_long": _covers_long(a["queues"]),
        }
        for a in policy.adoptions
    ]


def _covers_long(queues: list[list[float]]) -> bool:
    """Whether a layout has a queue of its own for the long prompts (one starting at 512 tokens or
    more that reaches into 1024-4096), rather than long prompts joining the top chat queue."""
    return any(low >= LONG_RANGE[0] / 2 and high >= LONG_RANGE[0] for low, high in queues)


def shift_cell(seed: int, size: Size, window: int) -> dict[str, Any]:
    name = "drift-chat-to-summaries"
    spec = WORKLOADS[name]
    requests = spec.build(spec.rate, size.shift_requests, seed)
    shift_s = shift_time(spec.rate, size.shift_requests, SHIFT_SHARE)
    stale = EwsjfMetaPolicy().fit(pre_shift_lengths(TRAIN_LENGTHS, 1000 + seed))
    online = _online(stale, window, seed)
    cell: dict[str, Any] = {"shift_s": shift_s, "stale_queues": len(stale.queues_)}
    for arm, policy in (("stale", EWSJF(stale)), ("ewsjf-online", online)):
        result = _run(name, policy, requests)
        cell[arm] = {
            "short_ttft_before": _short_ttft(result, end_s=shift_s),
            "short_ttft_after": _short_ttft(result, start_s=shift_s),
            "long_ttft_after": _short_ttft(result, start_s=shift_s, label="long"),
        }
    cell["candidates"] = len(online.evaluations)
    cell["adoptions"] = _adoptions(online, shift_s)
    layouts = [a for a in online.adoptions if a["kind"] == "layout" and a["at_s"] >= shift_s]
    cell["final_queues"] = len(online.incumbent.queues_)
    cell["final_covers_long"] = _covers_long([[q.low, q.high] for q in online.incumbent.queues_])
    if layouts:  # was the adopted layout the better one? Replay the post-shift requests with each.
        after = [
            dataclasses.replace(r, arrival_s=r.arrival_s - shift_s)
            for r in requests
            if r.arrival_s >= shift_s
        ]
        adopted = EwsjfMetaPolicy(**stale.get_params())
        adopted.queues_ = online.incumbent.queues_
        cell["post_shift_replay"] = {
            "stale": _short_ttft(_run(name, EWSJF(stale), after)),
            "adopted": _short_ttft(_run(name, EWSJF(adopted), after)),
        }
    return cell


def _spread(values: list[float]) -> dict[str, float]:
    return {"mean": float(np.mean(values)), "sd": float(np.std(values, ddof=1)) if len(values) > 1 else 0.0}


def summarise_steady(cells: dict[int, dict[str, Any]]) -> dict[str, Any]:
    """Means over seeds; ewsjf-online is within noise when its mean paired difference from the
    champion (same seed, same requests) is no larger than the champion's seed-to-seed sd."""
    champion = [c["ewsjf"]["short_ttft_mean"] for c in cells.values()]
    online = [c["ewsjf-online"]["short_ttft_mean"] for c in cells.values()]
    difference = float(np.mean(np.subtract(online, champion)))
    spread = _spread(champion)
    return {
        "workload": "ewsjf-mixed",
        "rate": WORKLOADS["ewsjf-mixed"].rate,
        "short_ttft_mean": {"ewsjf": spread, "ewsjf-online": _spread(online)},
        "served_share": {
            arm: float(np.mean([c[arm]["served_share"] for c in cells.values()]))
            for arm in ("ewsjf", "ewsjf-online")
        },
        "mean_difference": difference,
        "within_seed_spread": abs(difference) <= spread["sd"],
        "adoptions": sum(len(c["adoptions"]) for c in cells.values()),
        "candidates": sum(c["candidates"] for c in cells.values()),
        "per_seed": {str(seed): cell for seed, cell in cells.items()},
    }


def summarise_shift(cells: dict[int, dict[str, Any]]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "workload": "drift-chat-to-summaries",
        "rate": WORKLOADS["drift-chat-to-summaries"].rate,
    }
    for arm in ("stale", "ewsjf-online"):
        summary[arm] = {
            key: float(np.mean([c[arm][key] for c in cells.values()]))
            for key in ("short_ttft_before", "short_ttft_after", "long_ttft_after")
        }
    summary["layout_adoptions_after_shift"] = sum(
        1 for c in cells.values() for a in c["adoptions"] if a["kind"] == "layout" and a["after_shift_s"] >= 0
    )
    summary["seeds_ending_with_long_queues"] = sum(c["final_covers_long"] for c in cells.values())
    summary["candidates"] = sum(c["candidates"] for c in cells.values())
    summary["per_seed"] = {str(seed): cell for seed, cell in cells.items()}
    return summary


def table(steady: dict[str, Any], shift: dict[str, Any]) -> str:
    rows = [
        "(a) steady: ewsjf-mixed, short-request mean TTFT (s), per seed",
        f"{'seed':<6}{'ewsjf':>10}{'online':>10}{'served':>9}{'cands':>7}{'adopted':>9}"
        f"{'long p99 ewsjf / online':>26}",
    ]
    for seed, c in steady["per_seed"].items():
        rows.append(
            f"{seed:<6}{c['ewsjf']['short_ttft_mean']:>10.3f}{c['ewsjf-online']['short_ttft_mean']:>10.3f}"
            f"{c['ewsjf-online']['served_share']:>9.3f}{c['candidates']:>7}{len(c['adoptions']):>9}"
            f"{c['ewsjf']['long_ttft_p99']:>17.1f} / {c['ewsjf-online']['long_ttft_p99']:.1f}"
        )
    sd = steady["short_ttft_mean"]["ewsjf"]["sd"]
    rows.append(
        f"online - champion {steady['mean_difference']:+.3f} s, champion seed sd {sd:.3f} s:"
        f" within spread {steady['within_seed_spread']}"
    )
    rows += [
        "(b) shift: drift-chat-to-summaries, after the shift: short-request mean TTFT (s),"
        " long-request mean TTFT stale/online (s)",
        f"{'seed':<6}{'stale':>10}{'online':>10}{'long':>14}{'cands':>7}  adoptions (s from shift, kind,"
        " queues, long queue)",
    ]
    for seed, c in shift["per_seed"].items():
        adopted = ", ".join(
            f"{a['after_shift_s']:+.0f} {a['kind']} {a['queues']}q {'yes' if a['covers_long'] else 'no'}"
            for a in c["adoptions"]
        )
        replay = c.get("post_shift_replay")
        check = (
            f"; replayed post-shift: stale {replay['stale']:.3f} adopted {replay['adopted']:.3f}"
            if replay
            else ""
        )
        rows.append(
            f"{seed:<6}{c['stale']['short_ttft_after']:>10.3f}{c['ewsjf-online']['short_ttft_after']:>10.3f}"
            f"{c['stale']['long_ttft_after']:>7.2f}/{c['ewsjf-online']['long_ttft_after']:<6.2f}"
            f"{c['candidates']:>7}  {adopted or 'none'}{check}"
        )
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true", help="1,500 steady and 2,160 shift requests")
    parser.add_argument("--seeds", type=SEED_LIST, default="0,1,2")
    parser.add_argument("--window", type=COUNT, default=100, help="ewsjf-online's window (arrivals)")
    parser.add_argument("--json", type=OUTPUT, default=None)
    args = parser.parse_args(argv)
    size = FAST if args.fast else FULL
    seeds = args.seeds
    steady, shift = {}, {}
    for seed in seeds:
        started = time.perf_counter()
        steady[seed] = steady_cell(seed, size, args.window)
        shift[seed] = shift_cell(seed, size, args.window)
        print(f"seed {seed}: {time.perf_counter() - started:.0f} s", file=sys.stderr, flush=True)
    out = {
        "settings": {"window": args.window, "fast": args.fast, "seeds": seeds},
        "steady": summarise_steady(steady),
        "shift": summarise_shift(shift),
    }
    print(table(out["steady"], out["shift"]))
    if args.json is not None:
        write_json(args.json, out)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
