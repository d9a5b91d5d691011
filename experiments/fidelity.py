"""`adapt fidelity`: is the replayed policy the one that runs live, and does replay predict it?

    adapt fidelity --policy P | --policies a,b,c [--rate R] [--requests N] [--model DIR]
                   [--kv-blocks B] [--repeat] [--calibrate fcfs|own] [--embed-prompts]
                   [--keep DIR [--reuse]] [--json OUT]

For each policy, real vLLM (in-process engine core, `PolicyScheduler`, async scheduling, prefix
caching off, a KV cache of `--kv-blocks` blocks of 32 tokens: small enough that chunked prefill and
preemption both happen) serves a slice of the bundled Azure conversation trace open-loop: real
arrival gaps time-scaled to `--rate`, real prompt and output lengths cut by 4 (clipped) to fit the
tiny model's 1,024-token context, a prompt of exactly that many token ids, an output of exactly
that many tokens (`ignore_eos`), and a seeded SLO mix (a TBT target on half the requests, a
deadline on a quarter) so that SLO-aware policies have something to act on. Two measurements:

1. **Decision conformance** (`adapt.conformance`): the run's decision log is replayed in lockstep
   with trace-driven time; `decision_agreement` is the share of steps on which replay scheduled,
   preempted and freed exactly what vLLM did, and `first_divergence` the first step where not.
2. **Latency fidelity, out of sample**: run A (FCFS, other trace rows) calibrates -- `cost-model`
   is fitted on its step log (step time by batch, plus each arrival's intake between steps); each
   policy's run (B) is then predicted by an ordinary replay with that cost model and the engine's
   limits, and every request's TTFT and E2E is compared with what its client measured (median and
   P90 absolute % error, signed bias). A request's latency counts from its open-loop arrival time,
   as a server's would: the engine takes it in between steps, and replay models that wait. A second
   FCFS run on A's rows measures the machine's drift between runs (reported beside the errors; the
   cost model is then fitted on both runs). The replay's policy rankings (mean E2E, median TTFT)
   are compared with the live ones (Kendall tau). Each run also reports the share of its live step
   time spent in the policy (not charged by replay) and the machine's load average: another
   process on the machine stretches live steps, and the drift figure shows it. A policy with
   model calls off the step (SageSched's embeddings) is replayed with the live run's mean wait
   for them as `prediction_delay_s`.

`--embed-prompts` sends every request with its prompt's MiniLM vector in its extra args, as `adapt
serve --embed-prompts` does from the API server: the vectors are computed here before the runs
(untimed), from the very text the engine detokenises for the policy, so the engine's cores do no
embedding. On this 2-core CPU, MiniLM in the engine's worker takes cores from vLLM's forward pass
and stretches live steps beyond what their batches explain (a GPU node's forward does not run on
those cores); with the vectors arriving, what is left to predict is the scheduler itself. The
API server's hold is not part of these runs (`adapt replay --intake-delay` charges it).

**At the run's own machine speed.** A machine shared with other work runs slower in one run than in
the next (the FCFS repeat measures it: 1.5-4.5% on a quiet day, 10-60% on a busy one), and every
replay step inherits that error. Each policy's run is therefore also predicted at its own speed:
one factor per run, its steps' measured time over the cost model's time for the same batches
(`FittedCostModel.speed_factor`), the cost model scaled by it (`at_speed`). The factor reads how
fast the machine ran, not what the policy decided (its latencies and order are still the replay's
own), but it does absorb the policy's CPU time, so the uncorrected figures stay the headline.

`--repeat` serves each policy's requests a second time and compares the live engine with itself,
request by request, as replay is compared with it: the noise floor below which no replay can
predict. `--calibrate own` fits each policy's cost model on its own run A (the policy serving A's
rows) instead of FCFS's: what an operator has once the policy has served (its `adapt serve` logs),
and the only calibration that sees what a policy costs live beyond its batches (its CPU time, a
model thread sharing the cores).

Without `--model` a tiny random model is generated (DESIGN.md section 6).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from adapt.cli.usage import write_json

ERROR_KEYS = (  # what `error_summary` gives, for replay against live or live against its repeat
    "e2e_median_abs_pct_error",
    "e2e_p90_abs_pct_error",
    "ttft_median_abs_pct_error",
    "e2e_bias_pct",
)
SCALE_TO_CONTEXT = 1024
BLOCK_SIZE = 32  # the CPU attention backend needs a multiple of 32
CALIBRATION_OFFSET = 0
PREDICTED_OFFSET = 5000


def workload(requests: int, rate: float, offset: int) -> list[dict[str, Any]]:
    """Rows [offset, offset + n) of the Azure trace: arrival, prompt, output and an SLO per request."""
    from adapt.traces import load_trace
    from adapt.workloads import bundled
    from adapt.workloads.builders import scale_to_rate

    azure = load_trace(bundled("azure_conv_2023.csv.gz"))
    rows = slice(offset, offset + requests)
    arrivals = scale_to_rate(azure.arrival_s[rows] - azure.arrival_s[offset], rate)
    prompts = np.clip(azure.prompt_tokens[rows] // 4, 8, 700)  # 4x shorter, as the context is
    outputs = np.clip(azure.output_tokens[rows] // 4, 4, SCALE_TO_CONTEXT - 700)
    draws = np.random.default_rng(offset).random(len(prompts))
    result = []
    for a, p, o, u in zip(arrivals, prompts, outputs, draws, strict=True):
        slo = (
            {"tbt_s": 0.05} if u < 0.5 else ({"deadline_s": 5.0, "slo_kind": "deadline"} if u < 0.75 else {})
        )
        result.append({"arrival_s": float(a), "prompt": int(p), "output": int(o), "slo": slo})
    return result


def prompt_token_ids(rows: list[dict[str, Any]]) -> list[list[int]]:
    """The prompt each row is served with: random token ids (a seeded stream over the rows in
    order), as many as the row's prompt length. A row with a `system` entry ([seed, length])
    opens with that shared system prompt -- the same tokens in every row that names it -- and is
    still as long as its prompt length in all. One function for the engine worker and
    `prompt_vectors`, so that what is embedded is what is served. A row that `follows` an
    earlier one (a conversation's next turn) is sent after that one's prompt and answer, known
    only once it is served: here it is its new message alone."""
    rng = np.random.default_rng(0)
    prompts = []
    for row in rows:
        system: list[int] = []
        if row.get("system"):
            seed, length = row["system"]
            if length >= row["prompt"]:
                raise ValueError(f"a system prompt of {length} tokens in a prompt of {row['prompt']}")
            system = np.random.default_rng(seed).integers(5, 500, size=length).tolist()
        prompts.append(system + rng.integers(5, 500, size=row["prompt"] - len(system)).tolist())
    return prompts


def prompt_vectors(rows: list[dict[str, Any]], model: str, kept: Path, reuse: bool) -> np.ndarray:
    """MiniLM's vector of each row's prompt as the engine gives it to a policy that reads prompts:
    the token ids decoded by the served model's tokenizer, special tokens skipped
    (`PolicyScheduler._prompt_text`). Saved to `kept`; with `reuse`, read from there: a kept run
    is compared with its requests exactly, and MiniLM's last bits can differ with another torch,
    device or thread count."""
    if reuse and kept.is_file():
        return np.load(kept)
    from transformers import AutoTokenizer

    from predictors.embedding import embed

    if any(row.get("follows") is not None for row in rows):
        raise ValueError(
            "a conversation's next turn holds its earlier answers: it cannot be embedded before serving"
        )
    tokenizer = AutoTokenizer.from_pretrained(model)
    vectors = embed([tokenizer.decode(ids, skip_special_tokens=True) for ids in prompt_token_ids(rows)])
    np.save(kept, vectors)
    return vectors


def with_prompt_vectors(rows: list[dict[str, Any]], vectors: np.ndarray) -> list[dict[str, Any]]:
    """`rows`, each request's extra args carrying its prompt's vector (`adapt_embedding`), as
    `adapt serve --embed-prompts` sends it on to the engine."""
    from serving_hooks.xargs import EMBEDDING_FIELD, encode_embedding

    return [
        {**row, "slo": {**(row["slo"] or {}), EMBEDDING_FIELD: encode_embedding(vector)}}
        for row, vector in zip(rows, vectors, strict=True)
    ]


class Conversations:
    """The worker's view of which rows are a conversation's next turn (`follows`: an earlier
    row's index): such a row is sent once the turn it follows is answered, with that turn's
    whole prompt and answer before its own message, as a chat client sends its history."""

    def __init__(self, rows: list[dict[str, Any]], own_tokens: list[list[int]]) -> None:
        for index, row in enumerate(rows):
            if row.get("follows") is not None and not 0 <= row["follows"] < index:
                raise ValueError(f"row {index} follows row {row['follows']}: a turn follows an earlier row")
        self.rows, self.own_tokens = rows, own_tokens
        self.sent: dict[int, list[int]] = {}
        self.answers: dict[int, tuple[list[int], float]] = {}  # row -> its answer, and when it came

    def ready(self, index: int, now: float) -> bool:
        follows = self.rows[index].get("follows")
        return self.rows[index]["arrival_s"] <= now and (follows is None or follows in self.answers)

    def arrival_s(self, index: int) -> float:
        follows = self.rows[index].get("follows")
        answered = self.answers[follows][1] if follows is not None else 0.0
        return max(self.rows[index]["arrival_s"], answered)

    def prompt(self, index: int) -> list[int]:
        follows = self.rows[index].get("follows")
        history = [] if follows is None else self.sent[follows] + self.answers[follows][0]
        self.sent[index] = history + self.own_tokens[index]
        return self.sent[index]

    def answered(self, request_id: str, token_ids: list[int], now: float) -> None:
        self.answers[int(request_id.removeprefix("r"))] = (token_ids, now)


def worker(model: str, policy: str, rows: list[dict[str, Any]], out: Path, settings: dict[str, int]) -> None:
    """Serve `rows` open-loop in this process (each added when its arrival time comes) and write
    the decision log, the replay config, the client's times and the monitor's step log. A row
    that `follows` row j is a conversation's next turn: sent once j's answer has come (or at its
    own arrival time, if later), with j's prompt and answer before its own message. Before a row
    with `reset_prefix_cache` is sent, the engine's prefix cache is reset with its running
    requests preempted (`/reset_prefix_cache?reset_running_requests=true`)."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["ADAPT_POLICY"] = policy
    os.environ["ADAPT_LOG_DIR"] = str(out)
    os.environ["ADAPT_RECORD_DECISIONS"] = "1"
    from serving_hooks.xargs import EMBEDDING_FIELD

    if any(EMBEDDING_FIELD in (row["slo"] or {}) for row in rows):
        # as `adapt serve --embed-prompts` runs the engine: what still needs embedding (nothing,
        # when every request brings its vector) is embedded in a child process, not in the engine's
        os.environ.setdefault("ADAPT_EMBEDDING_PROCESS", "1")
    from vllm import LLM, SamplingParams

    llm = LLM(
        model=model,
        max_model_len=SCALE_TO_CONTEXT,
        max_num_seqs=settings["max_num_seqs"],
        max_num_batched_tokens=settings["token_budget"],
        block_size=BLOCK_SIZE,
        num_gpu_blocks_override=settings["kv_blocks"],
        enable_prefix_caching=bool(settings.get("prefix_caching", False)),
        enforce_eager=True,
        dtype="float32",
        gpu_memory_utilization=0.3,
        async_scheduling=True,
        scheduler_cls="serving_hooks.vllm_adapter.PolicyScheduler",
    )
    engine = llm.llm_engine
    scheduler = engine.engine_core.engine_core.scheduler
    prompts = prompt_token_ids(rows)
    conversations = Conversations(rows, prompts)
    pending = list(enumerate(rows))
    seen: dict[str, list[float | None]] = {}  # request id -> [arrival, first token, finish], client side
    started = time.monotonic()
    while pending or engine.has_unfinished_requests():
        now = time.monotonic() - started
        for index, row in [(i, row) for i, row in pending if conversations.ready(i, now)]:
            pending.remove((index, row))
            if row.get("reset_prefix_cache"):  # an operator's reset, just before this row is sent
                engine.reset_prefix_cache(reset_running_requests=True)
            params = SamplingParams(max_tokens=row["output"], ignore_eos=True, extra_args=row["slo"] or None)
            engine.add_request(f"r{index}", {"prompt_token_ids": conversations.prompt(index)}, params)
            # Arrived when the open-loop schedule says, not when this loop got to add it: a server
            # also only takes a request in between steps, and that wait is part of its latency.
            seen[f"r{index}"] = [conversations.arrival_s(index), None, None]
        if engine.has_unfinished_requests():
            for output in engine.step():  # what a client would receive, when it would receive it
                times, now = seen[output.request_id], time.monotonic() - started
                if times[1] is None and output.outputs and output.outputs[0].token_ids:
                    times[1] = now
                if output.finished:
                    times[2] = now
                    conversations.answered(output.request_id, list(output.outputs[0].token_ids), now)
        elif pending:
            time.sleep(max(0.0, pending[0][1]["arrival_s"] - (time.monotonic() - started)))
    scheduler._flush_logs()
    for queue in scheduler.prediction_queues:  # no model thread left running at exit
        queue.close()
    (out / "client.json").write_text(json.dumps(seen))
    (out / "decisions.json").write_text(json.dumps(scheduler.decisions))
    config = dataclasses.asdict(scheduler.replay_config())
    summary = {"policy_errors": scheduler.policy_errors, "predictions": scheduler.prediction_summary()}
    (out / "engine.json").write_text(json.dumps({**config, **summary}))


def serve(
    model: str,
    policy: str,
    rows: list[dict[str, Any]],
    out: Path,
    settings: dict[str, int],
    reuse: bool = False,
) -> None:
    """One live run in a fresh process (vLLM's engine state must not leak between runs). With
    `reuse`, a finished run already in `out` for the same rows and settings is kept as it is (to
    re-analyse kept runs); one for other rows or settings is an error, never silently reused."""
    if reuse and (out / "engine.json").is_file():
        kept = json.loads((out / "workload.json").read_text())
        if kept != {"rows": rows, "settings": settings}:
            raise ValueError(
                f"{out} holds a run of other requests or engine settings; remove it or drop --reuse"
            )
        return
    out.mkdir(parents=True, exist_ok=True)
    (out / "workload.json").write_text(json.dumps({"rows": rows, "settings": settings}))
    command = [sys.executable, "-m", "experiments.fidelity", "--worker", str(out), "--model", model]
    command += ["--policy", policy]
    done = subprocess.run(command, capture_output=True, text=True, timeout=1800)
    (out / "engine.log").write_text(done.stderr)
    if done.returncode != 0 or not (out / "engine.json").is_file():
        raise RuntimeError(f"engine run of {policy} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")


def engine_config(out: Path) -> Any:
    from adapt.replay.engine import EngineConfig

    fields = json.loads((out / "engine.json").read_text())
    fields.pop("policy_errors")
    predictions = fields.pop("predictions", None)
    if predictions:  # the live prediction latency, requests gone before theirs counted
        fields["prediction_delay_s"] = predictions.get("delay_estimate_s", predictions["mean_wait_s"])
    return EngineConfig(**fields)


def conformance(out: Path, policy: str) -> Any:
    """Replay the run's decision log in lockstep and compare (`adapt.conformance`)."""
    from adapt.conformance import compare, replay_decisions
    from serving_hooks.policies import make_policy_from_spec

    live = json.loads((out / "decisions.json").read_text())
    replayed = replay_decisions(live, make_policy_from_spec(policy), engine_config(out))
    return compare(live, replayed)


def real_requests(out: Path) -> list[dict[str, Any]]:
    """Each request's lengths and SLO (the engine's request log) with its times as the client saw
    them: arrival when the open-loop schedule sent it, first token and finish when `engine.step()`
    returned them."""
    client = json.loads((out / "client.json").read_text())
    records = []
    for path in sorted(out.glob("requests-*.jsonl")):
        records += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for record in records:  # the engine core's id is the client's plus "-<random suffix>"
        client_id = record["request_id"].rsplit("-", 1)[0]
        record["arrival_s"], record["first_token_s"], record["finish_s"] = client[client_id]
    return sorted(records, key=lambda r: r["arrival_s"])


def step_log(*runs: Path) -> Any:
    """The step logs the monitor wrote in `runs`' directories, as one frame."""
    import pandas as pd

    from adapt.steplog import load_step_log

    return pd.concat(
        [load_step_log(p) for out in runs for p in sorted(out.glob("steps-*.jsonl"))], ignore_index=True
    )


def fit_cost_model(runs: list[Path], kv_capacity: int) -> Any:
    """`cost-model` fitted to the step logs of `runs` (run A, and its repeat when there is one:
    two runs average the machine's drift between them)."""
    from predictors.cost_model import FittedCostModel

    return FittedCostModel(kv_capacity).fit(step_log(*runs))


def policy_share(steps: Any) -> float:
    """Share of a live run's step time (its `step_log`) spent in the policy (`adapt.steplog.POLICY_S`):
    time the replay does not charge, so an error of about this size is the policy's, not the cost
    model's."""
    from adapt.steplog import POLICY_S

    return float(steps[POLICY_S].sum() / steps["duration_s"].sum())


def predict(out: Path, cost: Any, policy: str) -> dict[str, Any]:
    """Replay run `out`'s requests (arrival, prompt, output, SLO) with `cost` and compare each
    request's TTFT and E2E with its client's measurement."""
    from adapt.conformance import logged_embedding
    from adapt.predictions import Delayed, PredictionStats
    from adapt.replay.engine import ReplayEngine
    from adapt.requests import Request
    from serving_hooks.policies import make_policy_from_spec
    from serving_hooks.xargs import slo_from_extra_args

    real = real_requests(out)
    rows = json.loads((out / "workload.json").read_text())["rows"]
    # The prompt text the live engine gave a policy that reads it (its token ids, detokenised) and
    # the vector a request arrived with, from the decision log: replay must use the same.
    arrived = {
        arrival[0]: arrival[4]
        for step in json.loads((out / "decisions.json").read_text())
        for arrival in step["arrived"]
    }
    requests = []
    for record in real:
        row = rows[int(record["request_id"].rsplit("-", 1)[0][1:])]
        slo = slo_from_extra_args(row["slo"] or None)
        extra = arrived.get(record["request_id"], {})
        requests.append(
            Request(
                record["request_id"], record["arrival_s"], row["prompt"], row["output"], slo=slo,
                max_tokens=row["output"], prompt_text=extra.get("prompt_text"),
                prompt_embedding=logged_embedding(extra.get("prompt_embedding")),
            )
        )  # fmt: skip
    config = engine_config(out)
    queues: list[Any] = []  # the replay's prediction queues, for their prior/prediction split

    def delayed(function: Any) -> Any:
        queues.append(Delayed(function, delay_s=config.prediction_delay_s))
        return queues[-1]

    result = ReplayEngine(make_policy_from_spec(policy), cost, config, predictions=delayed).run(requests)
    simulated = {r.request_id: r for r in result.records}
    errors: dict[str, list[float]] = {"ttft": [], "e2e": []}  # signed: (simulated - real) / real
    live = {"ttft": [], "e2e": []}
    sim = {"ttft": [], "e2e": []}
    for record in real:  # latency is compared on requests served by both engines; drops are counted
        s = simulated.get(record["request_id"])
        if record["outcome"] == "dropped" or s is None or s.dropped is not None or s.finish_s is None:
            continue
        for key, end in (("ttft", "first_token_s"), ("e2e", "finish_s")):
            measured, predicted = record[end] - record["arrival_s"], getattr(s, end) - s.arrival_s
            live[key].append(measured)
            sim[key].append(predicted)
            if measured > 0:
                errors[key].append((predicted - measured) / measured)
    preempted_live = sum(r.get("preemptions", 0) for r in real)
    dropped_live = sum(r["outcome"] == "dropped" for r in real)
    dropped_replay = sum(r.dropped is not None for r in result.records)

    live_predictions = json.loads((out / "engine.json").read_text()).get("predictions")
    replay_predictions = PredictionStats.combined([q.stats for q in queues]).summary() if queues else None

    def summary(
        values: dict[str, list[float]], preemptions: int, dropped: int, predictions: Any
    ) -> dict[str, Any]:
        return {
            "ttft_p50": float(np.median(values["ttft"])),
            "e2e_mean": float(np.mean(values["e2e"])),
            "preemptions": preemptions,
            "dropped": dropped,
            # share of requests first scheduled on a prior (off-step predictions; None: none made)
            "prior_share": None if not predictions else predictions["share_on_prior"],
        }

    return {
        **error_summary(errors),
        "compared_requests": len(errors["e2e"]),
        "live": summary(live, preempted_live, dropped_live, live_predictions),
        "replay": summary(sim, result.preemptions, dropped_replay, replay_predictions),
    }


def error_summary(errors: dict[str, list[float]]) -> dict[str, float]:
    """Median and P90 absolute % error, and the signed median (bias), of per-request relative
    errors (`errors["e2e"]`, `errors["ttft"]`): replay against live, or live against its repeat."""
    e2e, ttft = np.abs(errors["e2e"]), np.abs(errors["ttft"])
    return {
        "e2e_median_abs_pct_error": 100 * float(np.median(e2e)),
        "e2e_p90_abs_pct_error": 100 * float(np.percentile(e2e, 90)),
        "ttft_median_abs_pct_error": 100 * float(np.median(ttft)),
        "e2e_bias_pct": 100 * float(np.median(errors["e2e"])),
    }


def live_repeat(out: Path, repeat: Path) -> dict[str, float]:
    """The live engine's own noise floor for a policy: the same requests served twice, each
    request's E2E and TTFT in the repeat compared with the first run's, as replay is compared. An
    order-sensitive policy under overload can serve a request first in one run and last in the
    next; replay cannot predict a request more closely than the engine repeats itself."""
    first = {r["request_id"].rsplit("-", 1)[0]: r for r in real_requests(out)}
    again = [r for r in real_requests(repeat) if r["outcome"] != "dropped"]
    errors: dict[str, list[float]] = {"ttft": [], "e2e": []}
    for record in again:
        before = first.get(record["request_id"].rsplit("-", 1)[0])
        if before is None or before["outcome"] == "dropped":
            continue
        for key, end in (("ttft", "first_token_s"), ("e2e", "finish_s")):
            measured, repeated = before[end] - before["arrival_s"], record[end] - record["arrival_s"]
            if measured > 0:
                errors[key].append((repeated - measured) / measured)
    return {
        **error_summary(errors),
        # the repeat's own summary, for the live engine's ranking against itself
        "ttft_p50": float(np.median([r["first_token_s"] - r["arrival_s"] for r in again])),
        "e2e_mean": float(np.mean([r["finish_s"] - r["arrival_s"] for r in again])),
    }


@contextlib.contextmanager
def _runs_directory(keep: str | None) -> Iterator[str]:
    """Where the live runs go: `--keep DIR` (kept, to re-analyse the logs) or a temporary directory."""
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="adapt-fidelity-") as tmp:
            yield tmp
        return
    Path(keep).mkdir(parents=True, exist_ok=True)
    yield keep


def run(args: argparse.Namespace, progress=print) -> dict[str, Any]:
    policies = args.policies
    settings = {
        "max_num_seqs": args.max_num_seqs,
        "token_budget": args.token_budget,
        "kv_blocks": args.kv_blocks,
    }
    with _runs_directory(args.keep) as tmp:
        model = args.model
        if model is None and args.reuse and (Path(tmp) / "tiny" / "config.json").is_file():
            model = str(Path(tmp) / "tiny")  # the kept runs' own model
        elif model is None:
            from serving_hooks.tiny_model import make_tiny_model

            model = str(make_tiny_model(Path(tmp) / "tiny"))
        calibration = workload(args.requests, args.rate, CALIBRATION_OFFSET)
        predicted = workload(args.requests, args.rate, PREDICTED_OFFSET)
        if args.embed_prompts:
            progress(f"embedding {2 * args.requests} prompts with MiniLM (as the API server would) ...")
            vectors_a = prompt_vectors(calibration, model, Path(tmp) / "vectors-A.npy", args.reuse)
            vectors_b = prompt_vectors(predicted, model, Path(tmp) / "vectors-B.npy", args.reuse)
            calibration = with_prompt_vectors(calibration, vectors_a)
            predicted = with_prompt_vectors(predicted, vectors_b)
        progress(f"run A (calibration, fcfs): {args.requests} requests at {args.rate} req/s ...")
        serve(model, "fcfs", calibration, Path(tmp) / "A", settings, args.reuse)
        config = engine_config(Path(tmp) / "A")
        capacity = int(config.kv_capacity_tokens)
        cost = fit_cost_model([Path(tmp) / "A"], capacity)
        drift = None
        if args.drift:
            progress("run A again (the machine's drift between runs) ...")
            serve(model, "fcfs", calibration, Path(tmp) / "A2", settings, args.reuse)
            drift = predict(Path(tmp) / "A2", cost, "fcfs")["e2e_median_abs_pct_error"]
            cost = fit_cost_model([Path(tmp) / "A", Path(tmp) / "A2"], capacity)
        results = []
        for policy in policies:
            name = policy.replace(":", "_")
            policy_cost = cost
            if args.calibrate == "own" and policy != "fcfs":
                progress(f"run A ({policy}'s own calibration): {args.requests} requests ...")
                serve(model, policy, calibration, Path(tmp) / f"A-{name}", settings, args.reuse)
                policy_cost = fit_cost_model([Path(tmp) / f"A-{name}"], capacity)
            progress(f"run B ({policy}): {args.requests} requests at {args.rate} req/s ...")
            out = Path(tmp) / f"B-{name}"
            serve(model, policy, predicted, out, settings, args.reuse)
            load = os.getloadavg()[0]  # other work on the machine slows live steps, not replayed ones
            repeat = None
            if args.repeat:
                progress(f"run B again ({policy}: the live engine's own noise floor) ...")
                serve(model, policy, predicted, Path(tmp) / f"B2-{name}", settings, args.reuse)
                repeat = live_repeat(out, Path(tmp) / f"B2-{name}")
            agreement = conformance(out, policy)
            steps = step_log(out)
            speed = policy_cost.speed_factor(steps)
            at_speed = predict(out, policy_cost.at_speed(speed), policy)
            result = {
                "policy": policy,
                "rate": args.rate,
                "requests": args.requests,
                "decision_agreement": agreement.agreement,
                "steps": agreement.steps,
                "first_divergence": None if agreement.first_divergence is None else agreement.describe(),
                **predict(out, policy_cost, policy),
                "calibrated_on": policy if policy_cost is not cost else "fcfs",
                "embed_prompts": args.embed_prompts,
                "machine_speed": speed,  # the run's steps' measured time / the cost model's
                "at_measured_speed": {key: at_speed[key] for key in (*ERROR_KEYS, "replay")},
                "live_repeat": repeat,
                "policy_errors": json.loads((out / "engine.json").read_text())["policy_errors"],
                "calibration_drift_e2e_pct": drift,
                "machine_load_1m": load,
                "policy_share_of_step_time": policy_share(steps),
            }
            progress(
                f"  {policy}: decisions {agreement.identical}/{agreement.steps} identical;"
                f" E2E |err| median {result['e2e_median_abs_pct_error']:.1f}%"
            )
            results.append(result)

    rankings = {key: rank(results, key, args.repeat) for key in ("e2e_mean", "ttft_p50")}
    return {
        "results": results,
        "rankings": rankings,
        "drift_e2e_pct": drift,
        "settings": settings,
        "embed_prompts": args.embed_prompts,
    }


def rank(results: list[dict[str, Any]], key: str, repeat: bool) -> dict[str, Any]:
    """The policies ordered by `key` (lowest first) live, in replay and in replay at each run's
    measured speed (with `repeat`, live again), and Kendall's tau of each order against live's."""
    from scipy.stats import kendalltau

    def order(values: list[float]) -> list[str]:
        return [r["policy"] for _, r in sorted(zip(values, results, strict=True), key=lambda x: x[0])]

    def tau(a: list[float], b: list[float]) -> float:
        return float(kendalltau(a, b).statistic) if len(results) > 1 else 1.0

    live = [r["live"][key] for r in results]
    sim = [r["replay"][key] for r in results]
    sim_at_speed = [r["at_measured_speed"]["replay"][key] for r in results]
    ranking = {
        "live": order(live),
        "replay": order(sim),
        "kendall_tau": tau(live, sim),
        "replay_at_measured_speed": order(sim_at_speed),
        "at_measured_speed_kendall_tau": tau(live, sim_at_speed),
    }
    if repeat:  # does the live engine rank the policies the same way twice?
        again = [r["live_repeat"][key] for r in results]
        ranking |= {"live_repeat": order(again), "live_repeat_kendall_tau": tau(live, again)}
    return ranking


def print_at_measured_speed(report: dict[str, Any]) -> None:
    """The errors of the replay at each run's own machine speed (in sample: the factor comes from
    the run's steps), beside the out-of-sample table."""
    print(
        "replay at each run's measured machine speed (its steps' measured time / the cost model's"
        " for the same batches; the factor includes the policy's own CPU time):"
    )
    print(
        f"{'policy':<12}{'speed':>7}{'E2E |err|':>11}{'E2E P90':>9}{'TTFT |err|':>11}{'E2E bias':>10}"
        f"{'live E2E':>10}{'sim E2E':>9}"
    )
    for r in report["results"]:
        corrected = r["at_measured_speed"]
        print(
            f"{r['policy']:<12}{r['machine_speed']:>7.3f}{corrected['e2e_median_abs_pct_error']:>10.1f}%"
            f"{corrected['e2e_p90_abs_pct_error']:>8.1f}%{corrected['ttft_median_abs_pct_error']:>10.1f}%"
            f"{corrected['e2e_bias_pct']:>+9.1f}%{r['live']['e2e_mean']:>10.3f}{corrected['replay']['e2e_mean']:>9.3f}"
        )


def print_table(report: dict[str, Any]) -> None:
    print(
        f"{'policy':<12}{'decisions':>10}{'steps':>7}{'E2E |err|':>11}{'E2E P90':>9}{'TTFT |err|':>11}"
        f"{'E2E bias':>10}{'live E2E':>10}{'sim E2E':>9}{'live pre':>9}{'sim pre':>8}{'live drop':>10}"
        f"{'sim drop':>9}{'policy':>8}{'load':>6}"
    )
    for r in report["results"]:
        print(
            f"{r['policy']:<12}{r['decision_agreement']:>10.3f}{r['steps']:>7}"
            f"{r['e2e_median_abs_pct_error']:>10.1f}%{r['e2e_p90_abs_pct_error']:>8.1f}%"
            f"{r['ttft_median_abs_pct_error']:>10.1f}%{r['e2e_bias_pct']:>+9.1f}%"
            f"{r['live']['e2e_mean']:>10.3f}{r['replay']['e2e_mean']:>9.3f}"
            f"{r['live']['preemptions']:>9}{r['replay']['preemptions']:>8}"
            f"{r['live']['dropped']:>10}{r['replay']['dropped']:>9}"
            f"{100 * r['policy_share_of_step_time']:>7.1f}%{r['machine_load_1m']:>6.2f}"
        )
    print("errors over requests served by both engines; drop: requests refused by admission control")
    if report["embed_prompts"]:
        print("every request arrived with its prompt's vector (--embed-prompts): no embedding in the engine")
    print("policy: share of live step time in the policy (not charged by replay); load: 1-min load average")
    if report["drift_e2e_pct"] is not None:
        print(f"machine drift (FCFS on run A's rows, again): E2E median |err| {report['drift_e2e_pct']:.1f}%")
    for r in report["results"]:
        if r["live_repeat"] is not None:
            floor = r["live_repeat"]
            print(
                f"{r['policy']}: live run repeated (noise floor) E2E |err| median"
                f" {floor['e2e_median_abs_pct_error']:.1f}%, P90 {floor['e2e_p90_abs_pct_error']:.1f}%,"
                f" TTFT |err| median {floor['ttft_median_abs_pct_error']:.1f}%"
            )
    print_at_measured_speed(report)
    for name, ranking in report["rankings"].items():
        print(
            f"ranking by {name}: live {ranking['live']}; replay {ranking['replay']};"
            f" tau {ranking['kendall_tau']:.2f}; at measured speed {ranking['replay_at_measured_speed']},"
            f" tau {ranking['at_measured_speed_kendall_tau']:.2f}"
        )
        if "live_repeat" in ranking:
            print(
                f"  live again: {ranking['live_repeat']}; tau live vs live again"
                f" {ranking['live_repeat_kendall_tau']:.2f}"
            )
    for r in report["results"]:
        live, replay = r["live"]["prior_share"], r["replay"]["prior_share"]
        if live is not None and replay is not None:
            print(f"{r['policy']}: first scheduled on a prior, live {live:.3f} vs replay {replay:.3f}")
    for r in report["results"]:
        if r["first_divergence"]:
            print(f"{r['policy']}: {r['first_divergence']}")


def execute(args: argparse.Namespace, policies: list[str]) -> dict[str, Any]:
    """`adapt fidelity`: measure, print the table, write `--json` (its `OUTPUT` flag type checked
    the path before the live runs)."""
    args.policies = policies
    report = run(args, progress=lambda line: print(line, flush=True))
    print_table(report)
    if args.json is not None:
        payload = report["results"][0] if len(policies) == 1 else report
        write_json(args.json, payload)
    return report


def main() -> None:
    """The engine worker of one live run (`serve`); users run `adapt fidelity`."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--worker", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--policy", required=True)
    args = parser.parse_args()
    out = Path(args.worker)
    spec = json.loads((out / "workload.json").read_text())
    worker(args.model, args.policy, spec["rows"], out, spec["settings"])


if __name__ == "__main__":
    main()
