"""`adapt replay`: one request sequence, several policies, a table, JSON and MLflow runs."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

from adapt.cli.usage import (
    COUNT,
    DELAY,
    DURATION,
    NAME_LIST,
    OUTPUT,
    RATE,
    SEED,
    UsageError,
    add_parallel_arguments,
    given,
    write_json,
)
from adapt.replay.cells import ReplayCell, replay_cells
from adapt.replay.cluster import ROUTERS
from adapt.replay.cost import GPUS, MODELS, add_overlap_argument
from adapt.replay.engine import EngineConfig
from adapt.replay.runner import ReplaySetup, log_to_mlflow
from adapt.requests import Request
from adapt.traces import load_trace
from adapt.workloads import WORKLOADS, WorkloadSpec, get_workload
from adapt.workloads.builders import trace_requests
from serving_hooks.policies import (
    POLICIES,
    PolicySpec,
    component_references,
    make_policy_from_spec,
    parse_policy_spec,
    pin_policy_config,
    pinned_aliases,
)

# A generated workload is built in memory before it replays; more than this is a typo, not a study.
MAX_GENERATED = 10_000_000
TABLE_COLUMNS = (
    ("completed", "done"),
    ("dropped", "dropped"),
    ("ttft_mean", "ttft_mean"),
    ("ttft_p99", "ttft_p99"),
    ("tbt_p99", "tbt_p99"),
    ("ttlt_mean", "ttlt_mean"),
    ("throughput_tps", "tok/s"),
    ("slo_attainment", "slo"),
    ("goodput_tokens", "goodput_tok"),
    ("preemptions", "preempt"),
    ("sim_wall_s", "wall_s"),
)


def add_replay_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--trace", metavar="FILE", help="any supported trace file (see adapt trace stats)")
    source.add_argument("--workload", choices=sorted(WORKLOADS), help="a named workload")
    parser.add_argument(
        "--policies",
        type=NAME_LIST,
        default="fcfs,sjf-oracle",
        help=(
            f"comma-separated NAME or NAME:key=value:..., NAME from {','.join(POLICIES)}; or"
            " policy-config@vN / policy-config@ALIAS, a registered policy-config"
        ),
    )
    parser.add_argument("--rate", type=RATE, help="arrivals per second (a trace is time-scaled to it)")
    parser.add_argument("--duration", type=DURATION, help="keep arrivals in the first S seconds")
    parser.add_argument("--num-requests", type=COUNT, help="first N requests of a trace, or N generated")
    parser.add_argument("--model", choices=sorted(MODELS), help="model preset (default: the workload's)")
    parser.add_argument("--gpu", choices=sorted(GPUS), help="GPU preset (default: the workload's)")
    parser.add_argument(
        "--tp",
        type=COUNT,
        help="tensor-parallel degree, dividing the model's heads (default: the workload's)",
    )
    parser.add_argument(
        "--token-budget",
        type=COUNT,
        help="max tokens per step for every policy (vLLM max_num_batched_tokens; default: the workload's"
        " engine setting, 2048 for a trace); a policy with its own (sarathi) keeps it",
    )
    parser.add_argument(
        "--max-running", type=COUNT, default=256, help="max running sequences (vLLM max_num_seqs)"
    )
    parser.add_argument(
        "--prediction-delay",
        type=DELAY,
        default=0.0,
        metavar="S",
        help="seconds from a request's arrival until its policy's model prediction (SageSched's"
        " embedding) is ready; it is ranked on a prior until then (default 0: at once)",
    )
    parser.add_argument(
        "--intake-delay",
        type=DELAY,
        default=0.0,
        metavar="S",
        help="seconds from a request's arrival until the engine sees it: the API server's wait under"
        " `adapt serve --embed-prompts` (its status shows prompt_embedder.mean_wait_s); latencies count"
        " from the arrival (default 0)",
    )
    parser.add_argument("--replicas", type=COUNT, default=1, help="engine replicas behind a router")
    parser.add_argument("--router", choices=ROUTERS, default="least-outstanding")
    parser.add_argument("--decode-attention", choices=("sum", "max"), default="sum", help="see cost.py")
    add_overlap_argument(parser)
    parser.add_argument(
        "--cost-model",
        default="roofline",
        help="roofline (default), or a registered cost-model fitted to a real engine: champion or a version",
    )
    parser.add_argument("--seed", type=SEED, default=0)
    parser.add_argument("--json", type=OUTPUT, metavar="OUT", help="write {workload, policies} JSON here")
    parser.add_argument("--no-mlflow", action="store_true", help="do not log runs to MLflow")
    parser.add_argument("--experiment", default="replay", help="MLflow experiment name")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    add_parallel_arguments(parser)
    parser.add_argument(
        "--keep-token-times",
        action="store_true",
        help="keep every TBT sample for exact TBT percentiles (memory grows with the trace; by"
        " default a sketch within 1e-4 relative, memory bounded by what is in flight)",
    )


def _trace_setup(args: argparse.Namespace) -> ReplaySetup:
    trace = load_trace(args.trace)
    if args.num_requests is not None:
        trace = trace.head(args.num_requests)
    if trace.arrival_s is None and args.rate is None:
        raise UsageError(f"{args.trace}: this trace has no timestamps; pass --rate for Poisson arrivals")
    requests = trace_requests(trace, args.rate, args.seed)
    info = {"name": Path(args.trace).name, "trace": str(args.trace), "rate": args.rate, "seed": args.seed}
    return ReplaySetup(
        requests,
        info,
        given(args.model, "llama-2-13b"),
        given(args.gpu, "a100-80g"),
        given(args.tp, 1),
    )


def _workload_setup(args: argparse.Namespace) -> ReplaySetup:
    spec = get_workload(args.workload)
    rate = given(args.rate, spec.rate)
    if args.num_requests is not None:
        wanted: float = args.num_requests
    else:
        wanted = spec.num_requests if args.duration is None else args.duration * rate * 1.2
    if wanted > MAX_GENERATED:
        raise UsageError(
            f"--num-requests/--duration: {args.workload} would generate {wanted:.4g} requests; at most"
            f" {MAX_GENERATED:,} (replay a trace file for more)"
        )
    num = math.ceil(wanted)
    requests = spec.build(rate, num, args.seed)
    if args.num_requests is None and args.duration is not None:
        num, requests = _reach_duration(spec, rate, args.seed, args.duration, num, requests)
    info = spec.info(rate, num, args.seed)
    if args.duration is not None:  # num_requests becomes the count kept; this one rebuilds them
        info["generated_requests"] = num
    return ReplaySetup(
        requests, info, given(args.model, spec.model), given(args.gpu, spec.gpu), given(args.tp, spec.tp)
    )


def _reach_duration(
    spec: WorkloadSpec, rate: float, seed: int, duration: float, num: int, requests: list[Request]
) -> tuple[int, list[Request]]:
    """`--duration S` keeps the arrivals before S; if every generated request arrived before S, the
    window's end would be empty where the arrival process has more. So the count doubles, and the
    workload is generated afresh, until an arrival reaches S (or the source has no more: azure-conv's
    trace ends). A generator draws per count -- a larger count is another sequence, not a longer
    one -- so the requests are those of the first count in num * 2**k that reaches S: the same for
    the same workload, rate, seed and S, and `generated_requests` in the workload info."""
    while max((r.arrival_s for r in requests), default=0.0) < duration and num < MAX_GENERATED:
        more = min(2 * num, MAX_GENERATED)
        grown = spec.build(rate, more, seed)
        if len(grown) <= len(requests):
            break
        num, requests = more, grown
    return num, requests


def check_tp(model: str, tp: int) -> None:
    spec = MODELS[model]
    if not spec.splits_over(tp):
        valid = ", ".join(str(d) for d in range(1, spec.heads + 1) if spec.splits_over(d))
        raise UsageError(
            f"--tp: {model} has {spec.heads} attention heads and {spec.kv_heads} KV heads, which {tp}"
            f" GPUs cannot split evenly; expected one of {valid}"
        )


def build_setup(args: argparse.Namespace) -> ReplaySetup:
    setup = _trace_setup(args) if args.trace else _workload_setup(args)
    check_tp(setup.model, setup.tp)
    if args.duration is not None:
        setup.requests = [r for r in setup.requests if r.arrival_s < args.duration]
        setup.workload["duration_s"] = args.duration
    if not setup.requests:
        raise UsageError("no requests to replay (check --duration / --num-requests)")
    setup.workload.update(model=setup.model, gpu=setup.gpu, tp=setup.tp, num_requests=len(setup.requests))
    return setup


def format_table(results: dict[str, dict[str, Any]]) -> str:
    width = max(12, *(len(name) + 1 for name in results))
    header = f"{'policy':<{width}}" + "".join(f"{title:>14}" for _, title in TABLE_COLUMNS)
    lines = [header, "-" * len(header)]
    for name, metrics in results.items():
        cells = []
        for key, _ in TABLE_COLUMNS:
            value = metrics.get(key)
            if value is None:
                cells.append(f"{'-':>14}")
            elif isinstance(value, float):
                cells.append(f"{value:>14.3f}")
            else:
                cells.append(f"{value:>14,}")
        lines.append(f"{name:<{width}}" + "".join(cells))
    return "\n".join(lines)


def pin_component_aliases(policies: list[str]) -> dict[str, tuple[tuple[str, str], ...]]:
    """Per policy spec, the versions its components' aliases point at now (`champion` where the
    spec names none: what `adapt serve --policy SPEC` would serve), said on stderr; a learned
    policy whose alias carries no version runs without that component, and says so too."""
    from adapt.registry import Registry, version_of

    pins: dict[str, tuple[tuple[str, str], ...]] = {}
    registry, resolved = None, {}  # an alias read once for every spec: one version across the cells
    for spec in policies:
        name, params = parse_policy_spec(spec)
        references = component_references(name, params)
        if not references:
            pins[spec] = ()
            continue
        registry = registry or Registry()
        pins[spec] = pinned_aliases(name, references, registry, resolved)
        pinned = dict(pins[spec])
        said = []
        for attribute, (component, reference) in references.items():
            if attribute in pinned:
                said.append(f"{attribute}={pinned[attribute]} ({component}@{reference})")
            elif version_of(reference) is not None:
                said.append(f"{attribute}={reference}")
            else:
                said.append(f"{attribute}: none ({component}@{reference} names no version)")
        print(f"{spec} runs with {', '.join(said)}", file=sys.stderr)
    return pins


def run_replay_command(args: argparse.Namespace) -> int:
    policies = list(args.policies)
    given_specs, resolved = list(policies), {}  # resolved: policy-config@vN -> the spec it runs
    for index, spec in enumerate(given_specs):
        try:
            policies[index], runs = pin_policy_config(spec)
            parse_policy_spec(policies[index])
            make_policy_from_spec(policies[index])
        except ValueError as exc:
            raise UsageError(f"--policies: {exc}") from exc
        if runs is not None:
            resolved[policies[index]] = runs
    repeated = sorted({p for p in policies if policies.count(p) > 1})
    if repeated:  # one result and one MLflow run per policy: a second copy would overwrite the first
        raise UsageError(f"--policies: {', '.join(repeated)} given twice (after pinning aliases to versions)")
    for spec, pinned in zip(given_specs, policies, strict=True):
        if pinned in resolved:
            alias = "" if spec == pinned else f" is {pinned}, which"
            print(f"{spec}{alias} runs {resolved[pinned]}", file=sys.stderr)
    pins = pin_component_aliases(policies)
    setup = build_setup(args)
    budget = given(args.token_budget, setup.workload.get("token_budget", EngineConfig.token_budget))
    setup.workload.update(token_budget=budget, max_running=args.max_running)
    if args.intake_delay:  # a setting the runs differ by: in the JSON and the MLflow params
        setup.workload["intake_delay_s"] = args.intake_delay
    print(
        f"replaying {len(setup.requests):,} requests ({setup.workload.get('name')}) on {setup.model} /"
        f" {setup.tp} x {setup.gpu}, {args.replicas} replica(s), every policy at token budget {budget} and"
        f" max running {args.max_running}: {', '.join(policies)}",
        file=sys.stderr,
    )
    config = EngineConfig(
        token_budget=budget,
        max_running=args.max_running,
        keep_token_times=args.keep_token_times,
        prediction_delay_s=args.prediction_delay,
        intake_delay_s=args.intake_delay,
    )
    cost = None
    if args.cost_model != "roofline":
        from adapt.registry import Registry

        if args.cost_model.isdigit():
            cost = Registry().load("cost-model", version=int(args.cost_model))
        else:
            cost = Registry().load("cost-model", alias=args.cost_model)
        setup.workload["cost_model"] = f"cost-model v{cost.metadata['registry_version']}"
    else:  # which roofline form, so that runs replayed under different ones are told apart
        setup.workload.update(decode_attention=args.decode_attention, overlap=args.overlap)
    options = {
        "replicas": args.replicas,
        "router": args.router,
        "decode_attention": args.decode_attention,
        "overlap": args.overlap,
        "seed": args.seed,
    }
    cells = [
        ReplayCell(policy, policy, setup, PolicySpec(policy, pins[policy]), config, cost, options)
        for policy in policies
    ]
    replayed = replay_cells(cells, jobs=args.jobs, progress=not args.quiet, ray=args.ray)
    results: dict[str, dict[str, Any]] = {}
    policy_params: dict[str, dict[str, Any]] = {}  # what each ran: component versions, settings
    for policy, result in zip(policies, replayed, strict=True):
        results[policy] = result.metrics()
        policy_params[policy] = result.policy_params
        if policy in resolved:  # what the registered version ran, in the JSON and the MLflow run
            results[policy]["policy_config"] = resolved[policy]
        if not args.no_mlflow:
            log_to_mlflow(args.experiment, setup.workload, policy, results[policy], result.policy_params)
    print(format_table(results))
    for policy, metrics in results.items():
        if metrics["dropped"]:
            causes = ", ".join(f"{n} {cause}" for cause, n in metrics["dropped_by_reason"].items())
            print(f"{policy}: {metrics['dropped']} dropped ({causes})", file=sys.stderr)
    if args.json is not None:
        document = {"workload": setup.workload, "policies": results, "policy_params": policy_params}
        write_json(args.json, document, default=str)
    return 0
