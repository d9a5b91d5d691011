"""The `adapt` command. Each subcommand is a thin shell over a library function.

Errors a user can fix (a bad file, a bad flag value, a bad alias, a component that fails its checks)
print one line on stderr and exit 2; anything else is a bug, reported in one line with exit 70
(EX_SOFTWARE). `adapt --debug ...` shows the traceback of either. Commands keep their own documented
exit codes (retrain: 1 a component failed, 75 locked; fidelity: 1 a policy error; conformance: 1 a
step decided differently). Heavy imports (vLLM, MLflow, torch) happen inside the subcommands that
need them, so `adapt trace stats` answers in well under a second.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from adapt.cli.usage import (
    COUNT,
    DURATION,
    OUTPUT,
    OUTPUT_DIR,
    POSITIVE,
    RATE,
    Parser,
    UsageError,
    add_api_key_argument,
    add_parallel_arguments,
    given,
    integer,
    number,
    write_json,
)
from adapt.traces import FORMATS, load_trace, trace_stats

if TYPE_CHECKING:
    from pipelines.catalogue import CatalogueEntry, TrainOptions

MARGIN = number(0.0, low_open=False)  # a relative improvement a candidate must show
EXIT_USAGE, EXIT_BUG = 2, 70  # 70: EX_SOFTWARE (sysexits.h)
SLAI_OVERLAP_HELP = (
    "slai: the replay's roofline form -- one per step, or linear and attention added as the SLAI"
    " paper's batch-time model does (adapt/replay/cost.py)"
)


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def cmd_trace_stats(args: argparse.Namespace) -> int:
    trace = load_trace(args.file, args.format, tokenizer=args.tokenizer)
    stats = trace_stats(trace)
    if trace.report is not None:
        print(trace.report.summary(), file=sys.stderr)
    print(f"count       {_fmt(stats['count'])}")
    print(f"duration_s  {_fmt(stats['duration_s'])}")
    print(f"rate_rps    {_fmt(stats['rate_rps'])}")
    for side in ("input", "output"):
        s = stats[side]
        print(
            f"{side:<11} mean {_fmt(s['mean'])}  median {_fmt(s['median'])}"
            f"  p90 {_fmt(s['p90'])}  p99 {_fmt(s['p99'])}"
        )
    if args.json is not None:
        write_json(args.json, stats)
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from adapt.cli.replay import run_replay_command

    return run_replay_command(args)


def cmd_quickstart(args: argparse.Namespace) -> int:
    from experiments.quickstart import run_quickstart

    return run_quickstart(fast=args.fast, out_dir=args.out, serve=args.serve, jobs=args.jobs)


def _registry(args: argparse.Namespace):
    from adapt.registry import Registry

    return Registry(args.tracking_uri)


def cmd_models_list(args: argparse.Namespace) -> int:
    registry = _registry(args)
    names = registry.names()
    if not names:
        print("no registered models yet (train one, e.g. adapt train ...)")
        return 0
    print(
        f"{'name':<20}{'versions':>9}  {'champion':>8}  {'previous':>8}  {'challenger':>10}"
        "  key metrics (champion)"
    )
    for name in names:
        versions = registry.versions(name)
        by_alias = {alias: v for v in versions for alias in v.aliases}
        champion = by_alias.get("champion")
        metrics = ", ".join(
            f"{k}={v:.4g}" for k, v in sorted((champion.metrics if champion else {}).items())[:4]
        )
        cells = [
            str(by_alias[a].version) if a in by_alias else "-" for a in ("champion", "previous", "challenger")
        ]
        print(f"{name:<20}{len(versions):>9}  {cells[0]:>8}  {cells[1]:>8}  {cells[2]:>10}  {metrics}")
    return 0


def cmd_models_show(args: argparse.Namespace) -> int:
    registry = _registry(args)
    for info in registry.versions(args.name):
        aliases = f" [{', '.join(info.aliases)}]" if info.aliases else ""
        print(f"{args.name} v{info.version}{aliases}  run {info.run_id}")
        for key in (
            "adapt.schema_version",
            "adapt.data_window",
            "adapt.data_hash",
            "adapt.git_commit",
            "adapt.rolled_back",
        ):
            if key in info.tags:
                print(f"    {key.removeprefix('adapt.')}: {info.tags[key]}")
        for key, value in sorted(info.metrics.items()):
            print(f"    {key}: {value:.6g}")
    return 0


def cmd_models_promote(args: argparse.Namespace) -> int:
    _registry(args).promote(args.name, args.version, alias=args.alias)
    print(f"{args.name}: version {args.version} is now {args.alias}")
    return 0


def cmd_models_rollback(args: argparse.Namespace) -> int:
    version = _registry(args).rollback(args.name)
    print(f"{args.name}: rolled back; champion is version {version}")
    return 0


def _print_outcome(name: str, outcome) -> None:
    shown = ", ".join(f"{k}={v:.4g}" for k, v in outcome.metrics.items() if isinstance(v, float))
    print(f"{name}: registered version {outcome.version} ({shown})")
    if outcome.champion_metrics is not None:
        champ = ", ".join(f"{k}={v:.4g}" for k, v in outcome.champion_metrics.items() if isinstance(v, float))
        print(f"  champion on the same data: {champ}")
    print(f"  promoted to champion: {'yes' if outcome.promoted else 'no'}")
    if outcome.policy_config_version is not None:
        print(f"  policy-config: registered version {outcome.policy_config_version}")


def cmd_train(args: argparse.Namespace) -> int:
    from pipelines.catalogue import entry

    component = entry(args.component)
    if component.needs_data and not args.data:
        raise UsageError(f"{args.component}: --data is required ({component.data_help})")
    options = _train_options(args, component)
    _print_outcome(args.component, component.train(_registry(args), options))
    return 0


def _train_options(args: argparse.Namespace, component: CatalogueEntry) -> TrainOptions:
    """The `TrainOptions` given on the command line (a flag left out is None there, so the field
    keeps its default), refusing any the component does not read: `train slai-offset --data X`
    once exited 0 and registered a version as if X had been used. `--jobs` counts as given when it
    differs from its default (every core), as `adapt tune` reads it."""
    from dataclasses import fields

    from adapt.parallel import default_jobs
    from pipelines.catalogue import SHARED_OPTIONS, TrainOptions

    names = [field.name for field in fields(TrainOptions)]
    values = {name: getattr(args, name) for name in names if getattr(args, name) is not None}
    given = [name for name in values if not (name == "jobs" and values[name] == default_jobs())]
    read = SHARED_OPTIONS | component.options
    unused = [_train_flag(name) for name in given if name not in read]
    if unused:
        takes = ", ".join(_train_flag(name) for name in names if name in read)
        raise UsageError(
            f"train {component.name}: {', '.join(unused)} not used by this component (it reads {takes})"
        )
    return TrainOptions(**values)


def _train_flag(option: str) -> str:
    """The `adapt train` flag that sets a `TrainOptions` field."""
    return "--no-replay" if option == "replay" else f"--{option.replace('_', '-')}"


def cmd_evaluate(args: argparse.Namespace) -> int:
    from pipelines.catalogue import entry

    evaluate = entry(args.component).evaluate
    assert evaluate is not None  # argparse's choices are the evaluable components
    metrics = evaluate(_registry(args), args.data, alias=args.alias, version=args.version)
    if args.component == "semantic-history":  # scored next to its two baselines: one row each
        print(f"{args.component} on {args.data} (leave-one-prompt-out, {int(metrics['prompts'])} prompts)")
        print(f"{'predictor':<12}{'wasserstein':>14}{'crps':>10}{'bucket_overlap':>16}{'mean_abs_error':>16}")
        for mode, prefix in (("semantic", ""), ("length", "length_"), ("point", "point_")):
            row = [
                metrics[f"{prefix}{k}"] for k in ("wasserstein", "crps", "bucket_overlap", "mean_abs_error")
            ]
            print(f"{mode:<12}{row[0]:>14.1f}{row[1]:>10.1f}{row[2]:>16.3f}{row[3]:>16.1f}")
    else:
        print(f"{args.component} on {args.data}")
        for key, value in metrics.items():
            print(f"  {key}: {value:.4g}")
    if args.json_out is not None:
        write_json(args.json_out, metrics)
    return 0


# The options each tuner honours, beyond --rate and --num-requests; `_refuse_unused` refuses the
# others when given, rather than let a flag do nothing (`--storage` on slai once did).
TUNER_OPTIONS: dict[str, frozenset[str]] = {
    "slai": frozenset({"trials", "overlap", "jobs"}),
    "ewsjf": frozenset({"trials", "storage", "jobs"}),
    "ewsjf --online": frozenset(),
    "jitserve": frozenset({"trials", "jobs"}),
}


def _refuse_unused(args: argparse.Namespace, tuner: str) -> None:
    from adapt.parallel import default_jobs
    from adapt.replay.cost import DEFAULT_OVERLAP

    given = {
        "trials": args.trials is not None,
        "storage": args.storage is not None,
        "overlap": args.overlap != DEFAULT_OVERLAP,
        "jobs": args.jobs != default_jobs(),
    }
    unused = [
        f"--{option}"
        for option, was_given in given.items()
        if was_given and option not in TUNER_OPTIONS[tuner]
    ]
    if unused:
        raise UsageError(f"tune {tuner}: {', '.join(unused)} not used by this tuner")


def cmd_tune(args: argparse.Namespace) -> int:
    """Every tuner registers a policy-config; slai's and ewsjf's also the best component version.
    `--trials` not given, each tuner runs its own default number."""
    workload = {"slai": "slai-tiers", "ewsjf": "ewsjf-mixed", "jitserve": "jitserve-mix"}[args.policy]
    if args.workload not in (None, workload):
        raise UsageError(f"tune {args.policy}: only --workload {workload} (or, for ewsjf, --trace FILE)")
    if args.online and args.policy != "ewsjf":
        raise UsageError(f"tune {args.policy}: --online is ewsjf's (ewsjf-online in replay)")
    if args.trace and (args.policy != "ewsjf" or args.online):
        raise UsageError(
            f"tune {args.policy}{' --online' if args.online else ''}: --trace is for ewsjf's offline study;"
            " slai and jitserve tune for their workload's SLO tiers and classes, which a trace does not carry"
        )
    _refuse_unused(args, "ewsjf --online" if args.online else args.policy)
    trials = {} if args.trials is None else {"trials": args.trials}

    if args.policy == "jitserve":
        from pipelines.jitserve_tune import tune_jitserve

        outcome = tune_jitserve(
            _registry(args), rate=args.rate, num_requests=args.num_requests, jobs=args.jobs, **trials
        )
        print(f"  policy-config: registered version {outcome.version} (not promoted)")
        for key, value in sorted(outcome.metrics.items()):
            print(f"    {key}: {value:.4g}")
        return 0
    if args.policy == "ewsjf" and args.online:
        from pipelines.ewsjf import online_tune_ewsjf

        outcome = online_tune_ewsjf(
            _registry(args), rate=given(args.rate, 12.0), num_requests=given(args.num_requests, 4000)
        )
    elif args.policy == "ewsjf":
        from pipelines.ewsjf import trace_traffic, tune_ewsjf

        traffic = None
        if args.trace:
            traffic = trace_traffic(load_trace(args.trace), args.rate, args.num_requests, seed=0)
        outcome = tune_ewsjf(
            _registry(args),
            rate=given(args.rate, 40.0),
            num_requests=given(args.num_requests, 1500),
            storage=args.storage,
            jobs=args.jobs,
            traffic=traffic,
            **trials,
        )
    else:
        from pipelines.slai import TUNE_RATE, TUNE_REQUESTS, train_slai_offset

        outcome = train_slai_offset(
            _registry(args),
            rate=given(args.rate, TUNE_RATE),
            num_requests=given(args.num_requests, TUNE_REQUESTS),
            overlap=args.overlap,
            promote_if_better=True,
            with_policy_config=True,
            jobs=args.jobs,
            **trials,
        )
    _print_outcome("ewsjf-meta-policy" if args.policy == "ewsjf" else "slai-offset", outcome)
    return 0


def cmd_retrain(args: argparse.Namespace) -> int:
    from pipelines.catalogue import retrainers
    from pipelines.retrain import (
        EXIT_FAILED,
        EXIT_LOCKED,
        EXIT_OK,
        RetrainLocked,
        cron_times,
        every,
        format_result,
        retrain_loop,
        retrain_once,
    )
    from pipelines.watch import QualityWatch

    if args.watch is not None and args.once:
        raise UsageError("--watch: needs --every or --schedule (it acts between scheduled passes)")
    chosen = retrainers()
    if args.only is not None:
        names = [name.strip() for name in args.only.split(",") if name.strip()]
        unknown = [name for name in names if name not in chosen]
        if unknown or not names:
            expected = ", ".join(chosen)
            raise UsageError(f"--only: unknown {unknown or args.only!r}; expected some of {expected}")
        chosen = {name: chosen[name] for name in names}
    registry = _registry(args)
    if not args.once:
        fire_times = cron_times(args.schedule) if args.schedule else every(args.every)
        watch = None
        if args.watch is not None:
            urls = [url.strip() for url in args.watch.split(",") if url.strip()]
            watch = QualityWatch(urls, registry, api_key=args.watch_api_key)
        retrain_loop(
            registry,
            args.data_dir,
            chosen,
            fire_times,
            margin=args.margin,
            watch=watch,
            watch_interval_s=args.watch_interval,
        )
        return EXIT_OK
    try:
        results = retrain_once(registry, args.data_dir, chosen, margin=args.margin)
    except RetrainLocked as exc:
        print(f"adapt: {exc}", file=sys.stderr)
        return EXIT_LOCKED
    for result in results:
        print(format_result(result))
    return EXIT_FAILED if any(r.status == "failed" for r in results) else EXIT_OK


def cmd_compare(args: argparse.Namespace) -> int:
    from experiments.compare import METRICS, run_compare

    if args.metric not in METRICS:
        raise UsageError(f"--metric: expected one of {', '.join(METRICS)}, got {args.metric!r}")
    return run_compare(args.experiment, args.metric, args.out, args.json, log=not args.no_mlflow)


def cmd_serve(args: argparse.Namespace) -> int:
    from serving_hooks.server import serve

    extra = list(args.vllm_args)
    if extra and extra[0] == "--":
        extra = extra[1:]
    return serve(
        args.model,
        args.policy,
        host=args.host,
        port=args.port,
        watch_interval_s=args.watch_interval,
        log_dir=args.log_dir,
        log_prompts=args.log_prompts,
        log_decisions=args.log_decisions,
        follow_policy_config=args.follow_policy_config,
        metrics=args.metrics,
        drift_margin=args.drift_margin,
        embed_prompts=args.embed_prompts,
        extra=extra,
    )


def cmd_status(args: argparse.Namespace) -> int:
    from adapt.cli.status import run_status

    fleet = [url.strip() for url in args.fleet.split(",") if url.strip()] if args.fleet else None
    if args.fleet is not None and not fleet:
        raise UsageError("--fleet: give the replicas' URLs, comma-separated")
    return run_status(args.url, args.watch, fleet, args.api_key)


def cmd_tiny_model(args: argparse.Namespace) -> int:
    from serving_hooks.tiny_model import make_tiny_model

    print(f"tiny model written to {make_tiny_model(args.dir)}")
    return 0


def cmd_conformance(args: argparse.Namespace) -> int:
    from adapt.cli.conformance import run_conformance

    return run_conformance(args.log_dir, args.policy, args.json)


def cmd_fidelity(args: argparse.Namespace) -> int:
    from experiments.fidelity import execute

    names = [p for p in (args.policies or args.policy or "").split(",") if p]
    if not names:
        raise UsageError("adapt fidelity: give --policy P or --policies a,b,c")
    if args.reuse and not args.keep:
        raise UsageError("adapt fidelity: --reuse re-analyses the runs kept by --keep DIR; give --keep")
    if args.model is not None and not (Path(args.model) / "config.json").is_file():
        raise UsageError(
            f"adapt fidelity: --model {args.model}: no model directory there (no config.json); nothing"
            " is downloaded: give a local model, or leave --model out for a generated tiny model"
        )
    from serving_hooks.policies import check_policy, make_policy_from_spec

    for name in names:  # a bad or unservable spec fails now, not after minutes of earlier runs
        check_policy(make_policy_from_spec(name), "vllm")
    report = execute(args, names)
    errors = sum(r["policy_errors"] for r in report["results"])
    return 1 if errors else 0


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="adapt", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--tracking-uri",
        help="MLflow tracking URI (default: $MLFLOW_TRACKING_URI, else sqlite under mlruns/)",
    )
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    trace = sub.add_parser("trace", help="inspect traces").add_subparsers(dest="trace_command", required=True)
    stats = trace.add_parser("stats", help="count, duration, rate, input/output length percentiles")
    stats.add_argument("file")
    stats.add_argument("--format", choices=FORMATS, help="override format detection")
    stats.add_argument("--tokenizer", default="minilm-wordpiece", help="for text datasets")
    stats.add_argument("--json", type=OUTPUT, metavar="OUT")
    stats.set_defaults(func=cmd_trace_stats)

    from adapt.cli.replay import add_replay_arguments
    from adapt.replay.cost import add_overlap_argument

    replay = sub.add_parser("replay", help="replay a trace or workload under several policies")
    add_replay_arguments(replay)
    replay.set_defaults(func=cmd_replay)

    models = sub.add_parser("models", help="registered components: list, show, promote, roll back")
    models_sub = models.add_subparsers(dest="models_command", required=True)
    models_sub.add_parser("list", help="every component: versions, aliases, key metrics").set_defaults(
        func=cmd_models_list
    )
    show = models_sub.add_parser("show", help="every version of one component")
    show.add_argument("name")
    show.set_defaults(func=cmd_models_show)
    promote = models_sub.add_parser("promote", help="point an alias (default champion) at a version")
    promote.add_argument("name")
    promote.add_argument("version", type=COUNT)
    promote.add_argument("--alias", default="champion")
    promote.set_defaults(func=cmd_models_promote)
    rollback = models_sub.add_parser("rollback", help="restore the previous champion")
    rollback.add_argument("name")
    rollback.set_defaults(func=cmd_models_rollback)

    train = sub.add_parser("train", help="fit a component, log and register it (optionally promote)")
    from pipelines.catalogue import CATALOGUE, evaluable

    train.add_argument("component", choices=list(CATALOGUE))
    train.add_argument(
        "--data",
        help="training data: "
        + "; ".join(
            f"{name}: {e.data_help}" for name, e in CATALOGUE.items() if not e.data_help.startswith("none")
        ),
    )
    train.add_argument(
        "--test-share",
        type=number(0.0, 1.0),
        help="semantic-history, qrf-length, neural-length: share of instructions held out (default 0.3)",
    )
    train.add_argument("--promote-if-better", action="store_true")
    train.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        default=None,  # None: not given (`_train_options`), so the component's default applies
        help="semantic-history, qrf-length, neural-length, pattern-graph: skip the replay check (the"
        " policy the component drives, replayed with candidate and champion; a candidate that"
        " schedules worse is not promoted)",
    )
    train.add_argument("--margin", type=MARGIN, default=0.0, help="relative improvement required to promote")
    train.add_argument("--rate", type=RATE, help="slai-offset: arrival rate to tune at (default 2.0)")
    train.add_argument("--num-requests", type=COUNT, help="slai-offset: requests per replay (default 800)")
    train.add_argument("--trials", type=COUNT, help="slai-offset: Optuna trials (default 20)")
    add_overlap_argument(train, help=SLAI_OVERLAP_HELP)
    add_parallel_arguments(train, ray=False)
    train.set_defaults(func=cmd_train, overlap=None)  # None: not given (`_train_options`)

    evaluate = sub.add_parser("evaluate", help="score a registered component on any data file")
    evaluate.add_argument("component", choices=evaluable())
    evaluate.add_argument(
        "--data", required=True, help="prompt/response file (alpaca format); pattern-graph: JSONL graphs"
    )
    which = evaluate.add_mutually_exclusive_group()
    which.add_argument("--alias", default="champion", help="an alias (default: champion)")
    which.add_argument("--version", type=COUNT, help="a version number instead of an alias")
    evaluate.add_argument(
        "--json", dest="json_out", type=OUTPUT, metavar="OUT", help="also write the metrics here"
    )
    evaluate.set_defaults(func=cmd_evaluate)

    tune = sub.add_parser("tune", help="Bayesian optimisation of a policy on replay; registers the best")
    tune.add_argument("policy", choices=["slai", "ewsjf", "jitserve"])
    tune_source = tune.add_mutually_exclusive_group()
    tune_source.add_argument("--workload")
    tune_source.add_argument("--trace")
    tune.add_argument(
        "--trials",
        type=COUNT,
        help="Optuna trials (default: the tuner's own: 20 for slai and ewsjf, 24 for jitserve)",
    )
    tune.add_argument("--rate", type=RATE)
    tune.add_argument("--num-requests", type=COUNT)
    add_overlap_argument(tune, help=SLAI_OVERLAP_HELP)
    tune.add_argument(
        "--storage",
        help="ewsjf: Optuna storage URL (e.g. sqlite:///mlruns/optuna.db, postgresql://...), one study"
        " several machines work",
    )
    tune.add_argument(
        "--online",
        action="store_true",
        help="ewsjf: run ewsjf-online in replay (paired windows of arrivals) and register its incumbent",
    )
    add_parallel_arguments(tune, ray=False)
    tune.set_defaults(func=cmd_tune)

    retrain = sub.add_parser("retrain", help="refit components whose data moved; gate; promote")
    when = retrain.add_mutually_exclusive_group(required=True)
    when.add_argument(
        "--once", action="store_true", help="one pass (exit 0 ok, 1 a component failed, 75 locked)"
    )
    when.add_argument("--schedule", metavar="CRON", help='in-process scheduler, e.g. "0 * * * *"')
    when.add_argument(
        "--every", type=DURATION, metavar="SECONDS", help="in-process, a pass SECONDS after the last ended"
    )
    retrain.add_argument(
        "--data-dir", default="mlruns/data", help="steps*.csv|jsonl|parquet and requests*.jsonl"
    )
    retrain.add_argument("--margin", type=MARGIN, default=0.0)
    retrain.add_argument(
        "--only", metavar="NAME,NAME,...", help="refit only these components (default: every one with data)"
    )
    retrain.add_argument(
        "--watch",
        metavar="URL,URL,...",
        help="with --every/--schedule: poll these servers' status; a drift alarm retrains early, a"
        " promoted version doing worse online than its predecessor is rolled back (pipelines/watch.py)",
    )
    retrain.add_argument(
        "--watch-interval", type=DURATION, default=10.0, metavar="S", help="poll every S seconds (10)"
    )
    add_api_key_argument(retrain, "--watch-api-key", "the servers'")
    retrain.set_defaults(func=cmd_retrain)

    compare = sub.add_parser("compare", help="replay runs side by side (policies x workloads), plots vs load")
    compare.add_argument(
        "--experiment", default="quickstart", help="MLflow experiment (replay's default: replay)"
    )
    compare.add_argument("--metric", default="ttlt_mean")
    compare.add_argument("--out", type=OUTPUT_DIR, default="reports/compare")
    compare.add_argument("--json", type=OUTPUT, metavar="OUT")
    compare.add_argument("--no-mlflow", action="store_true", help="do not log the comparison as a run")
    compare.set_defaults(func=cmd_compare)

    serve = sub.add_parser(
        "serve",
        help="vLLM's OpenAI server scheduled by an adapt policy, components following the registry",
    )
    serve.add_argument("--model", required=True, help="model directory (or name vLLM can load offline)")
    serve.add_argument("--policy", required=True, help="policy spec, e.g. jitserve or sarathi:order=spf")
    serve.add_argument("--watch-interval", type=POSITIVE, default=5.0, help="registry poll interval (s)")
    serve.add_argument("--log-dir", help="write requests-*.jsonl and steps-*.jsonl here (for adapt retrain)")
    serve.add_argument(
        "--log-prompts",
        action="store_true",
        help="include prompt text in the request log (adapt retrain then refits the prompt components)",
    )
    serve.add_argument(
        "--log-decisions",
        action="store_true",
        help="with --log-dir: also write every step's decisions (decisions-*.jsonl), for adapt"
        " conformance to replay (with prefix caching on, each prompt's block hashes go with it)",
    )
    serve.add_argument(
        "--follow-policy-config",
        action="store_true",
        help="serve the policy the policy-config champion names, swapping live when it moves"
        " (--policy serves while none is registered)",
    )
    serve.add_argument(
        "--no-metrics",
        dest="metrics",
        action="store_false",
        help="do not record the adapt_* Prometheus metrics (vLLM's own stay on /metrics)",
    )
    serve.add_argument(
        "--drift-margin",
        type=number(0.0, 1.0, low_open=False),
        help="drift alarm when online length-bound coverage falls this far below the held-out"
        " coverage registered for the serving version (default 0.05)",
    )
    serve.add_argument(
        "--embed-prompts",
        action="store_true",
        help="embed each prompt (MiniLM) in the API server before it reaches the engine, so the"
        " policy's first decision uses its embedding (the request waits for it; sagesched)",
    )
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=integer(1, 65535), default=8000)
    serve.add_argument("vllm_args", nargs=argparse.REMAINDER, help="-- then any vLLM serve arguments")
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser(
        "status", help="a running adapt serve: policy, versions, swaps, SLOs, prediction quality, step time"
    )
    from adapt.cli.status import DEFAULT_URL

    status.add_argument("url", nargs="?", default=DEFAULT_URL, help="the server's base URL")
    status.add_argument("--watch", type=POSITIVE, metavar="SECONDS", help="refresh every SECONDS")
    status.add_argument(
        "--fleet",
        metavar="URL,URL,...",
        help="summarise these replicas instead (exit 1 if one does not answer)",
    )
    add_api_key_argument(status, "--api-key", "the server's")
    status.set_defaults(func=cmd_status)

    conformance = sub.add_parser(
        "conformance",
        help="replay a server's decision log (adapt serve --log-decisions) step by step: did the"
        " replay decide as vLLM did? (exit 1 if not)",
    )
    conformance.add_argument("--log-dir", required=True, help="the server's --log-dir")
    conformance.add_argument(
        "--policy",
        help="the policy spec to replay from each run's start (default: the one the log names;"
        " component versions always come from the log)",
    )
    conformance.add_argument("--json", type=OUTPUT, help="write the report here")
    conformance.set_defaults(func=cmd_conformance)

    fidelity = sub.add_parser(
        "fidelity", help="live vLLM vs replay: step-by-step decision agreement and latency error per policy"
    )
    fidelity.add_argument("--policy", help="one policy spec (NAME or NAME:key=value)")
    fidelity.add_argument("--policies", help="comma-separated policy specs")
    fidelity.add_argument("--requests", type=COUNT, default=300)
    fidelity.add_argument("--rate", type=RATE, default=20.0, help="arrival rate, req/s (default 20)")
    fidelity.add_argument("--max-num-seqs", type=COUNT, default=16)
    fidelity.add_argument("--token-budget", type=COUNT, default=2048, help="vLLM's max_num_batched_tokens")
    fidelity.add_argument("--kv-blocks", type=COUNT, default=128, help="KV cache size in 32-token blocks")
    fidelity.add_argument("--no-drift", dest="drift", action="store_false", help="skip the repeat of run A")
    fidelity.add_argument(
        "--repeat", action="store_true", help="serve each policy twice: the live engine's own noise floor"
    )
    fidelity.add_argument(
        "--calibrate",
        choices=("fcfs", "own"),
        default="fcfs",
        help="fit the cost model on FCFS's run A (default) or on each policy's own run A",
    )
    fidelity.add_argument(
        "--embed-prompts",
        action="store_true",
        help="requests arrive with their prompts' MiniLM vectors, as adapt serve --embed-prompts"
        " sends them (embedded before the runs): the engine's cores do no embedding",
    )
    fidelity.add_argument("--model", help="model directory (default: a generated tiny model)")
    fidelity.add_argument("--keep", metavar="DIR", help="keep the live runs' logs here (default: deleted)")
    fidelity.add_argument(
        "--reuse",
        action="store_true",
        help="with --keep: re-analyse runs already kept there instead of serving again",
    )
    fidelity.add_argument("--json", type=OUTPUT, help="write the report here (one policy: its record alone)")
    fidelity.set_defaults(func=cmd_fidelity)

    tiny = sub.add_parser("tiny-model", help="a tiny random Llama + tokenizer for trying vLLM on a CPU")
    tiny.add_argument("dir")
    tiny.set_defaults(func=cmd_tiny_model)

    quick = sub.add_parser("quickstart", help="end to end on the bundled data")
    quick.add_argument("--fast", action="store_true", help="smaller workloads (under 90 s on 2 cores)")
    quick.add_argument(
        "--out", type=OUTPUT_DIR, default="reports/quickstart", help="where the report and plots go"
    )
    quick.add_argument(
        "--serve",
        action="store_true",
        help="then start adapt serve on a tiny model, drive load, promote a component live",
    )
    add_parallel_arguments(quick, ray=False)
    quick.set_defaults(func=cmd_quickstart)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    debug = "--debug" in argv[: argv.index("--")] if "--" in argv else "--debug" in argv
    try:
        args = build_parser().parse_args(argv)
        func: Callable[[argparse.Namespace], int] = args.func
        if args.tracking_uri:
            os.environ["MLFLOW_TRACKING_URI"] = args.tracking_uri
        return func(args)
    except KeyboardInterrupt:
        print("adapt: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:
        if debug:
            raise
        user = _is_user_error(exc)
        kind = "error" if user else f"internal error ({type(exc).__name__}; --debug shows where)"
        print(f"adapt: {kind}: {_one_line(exc)}", file=sys.stderr)
        return EXIT_USAGE if user else EXIT_BUG


def _is_user_error(exc: Exception) -> bool:
    """What a user can fix: a bad value (ValueError: trace, validation, usage and component errors
    are ones), a file that is missing or unreadable (OSError), or an error this project or MLflow
    raises on purpose (a registry, policy or MLflow error: an unknown alias, `--alias ../../x`)."""
    if isinstance(exc, ValueError | OSError):
        return True
    modules = (cls.__module__ for cls in type(exc).__mro__)
    return any(m.split(".")[0] in PROJECT_PACKAGES for m in modules)


PROJECT_PACKAGES = frozenset({"adapt", "predictors", "serving_hooks", "pipelines", "experiments", "mlflow"})


def _one_line(exc: Exception) -> str:
    """MLflow and pandas messages run over several lines; the CLI's errors are one."""
    return " ".join(str(exc).split()) or type(exc).__name__
