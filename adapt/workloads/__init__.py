"""Named workloads: real length data, a generated arrival process, SLO classes and an engine preset.

Each workload is a pure function of (rate, number of requests, seed), so every policy in one
`adapt replay` call sees the identical request sequence. Length data comes from the files bundled
under `adapt/workloads/data/` (slices of ../shared/data, sources in adapt/workloads/data/README.md).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from adapt.replay.engine import EngineConfig
from adapt.requests import SLO, Request
from adapt.traces import Trace, load_trace
from adapt.workloads.builders import SLOClass, build_requests, poisson_arrivals, scale_to_rate
from adapt.workloads.drift import chat_to_summaries, chat_to_summaries_gradual, shorter_answers

DATA_DIR = Path(__file__).parent / "data"


def bundled(name: str) -> Path:
    """Path of a bundled data file, e.g. bundled('azure_conv_2023.csv.gz')."""
    path = DATA_DIR / name
    if not path.is_file():
        raise FileNotFoundError(f"bundled data file missing: {path}")
    return path


@dataclass(frozen=True)
class WorkloadSpec:
    """A named workload's defaults: the engine preset it is meant for, its rate and size, and the
    engine setting every policy is compared under on it.

    `token_budget` (vLLM's `max_num_batched_tokens`) is the budget at which the best non-oracle
    baseline does best on this workload (`python -m experiments.engine_settings`), so a learned
    policy is measured against the best-configured engine, never against a worse setting. A policy
    that needs its own budget declares it (`Policy.token_budget`: `sarathi` is fcfs at 512)."""

    name: str
    description: str
    model: str
    gpu: str
    tp: int
    rate: float
    num_requests: int
    build: Callable[[float, int, int], list[Request]]
    token_budget: int = 2048

    def engine_config(self, **changes: Any) -> EngineConfig:
        """The replay engine settings every policy runs under on this workload."""
        return EngineConfig(token_budget=self.token_budget, **changes)

    def info(self, rate: float, num_requests: int, seed: int) -> dict[str, Any]:
        data = {k: v for k, v in asdict(self).items() if k != "build"}
        data.update(rate=rate, num_requests=num_requests, seed=seed)
        return data


def _rows_in_range(trace: Trace, low: int, high: int) -> Trace:
    keep = np.flatnonzero((trace.prompt_tokens >= low) & (trace.prompt_tokens <= high))
    if len(keep) == 0:
        raise ValueError(f"{trace.name}: no rows with prompt length in [{low}, {high}]")
    return trace.take(keep)


def ewsjf_mixed(
    rate: float,
    num_requests: int,
    seed: int,
    short_share: float = 0.8,
    short_range: tuple[int, int] = (32, 512),
    long_range: tuple[int, int] = (1024, 4096),
    max_output: int = 1024,
) -> list[Request]:
    """EWSJF's mixed workload: 80% short interactive prompts (ShareGPT rows with prompts in
    32-512 tokens) and 20% long batch prompts (arXiv-summarisation rows in 1024-4096), a bimodal
    32-4096 input distribution as in the paper, Poisson arrivals. Outputs are the rows' real
    output lengths capped at `max_output`."""
    rng = np.random.default_rng(seed)
    short = _rows_in_range(load_trace(bundled("sharegpt_lengths.csv.gz")), *short_range)
    long = _rows_in_range(load_trace(bundled("arxiv_summarization_lengths.csv.gz")), *long_range)
    is_short = rng.random(num_requests) < short_share
    prompts = np.empty(num_requests, dtype=np.int64)
    outputs = np.empty(num_requests, dtype=np.int64)
    for mask, source in ((is_short, short), (~is_short, long)):
        picks = rng.integers(0, len(source), size=int(mask.sum()))
        prompts[mask] = source.prompt_tokens[picks]
        outputs[mask] = np.minimum(source.output_tokens[picks], max_output)
    trace = Trace("ewsjf-mixed", prompts, outputs)
    labels = ["short" if s else "long" for s in is_short]
    return build_requests(trace, poisson_arrivals(num_requests, rate, rng), labels=labels)


def slai_tiers(
    rate: float,
    num_requests: int,
    seed: int,
    paying_share: float = 0.05,
    paying_tbt_s: float = 0.1,
    free_tbt_s: float = 0.5,
    max_total_tokens: int = 8192,
) -> list[Request]:
    """SLAI's tiered workload: ShareGPT prompt/output lengths (the paper's openchat_sharegpt4 has
    the same distribution), total capped at 8192, Poisson arrivals, a share of paying users with a
    0.1 s TBT SLO and free users with 0.5 s."""
    rng = np.random.default_rng(seed)
    source = load_trace(bundled("sharegpt_lengths.csv.gz"))
    trace = source.take(rng.integers(0, len(source), size=num_requests))
    classes = [
        SLOClass("paying", paying_share, SLO(kind="latency", tbt_s=paying_tbt_s, tier="paying")),
        SLOClass("free", 1.0 - paying_share, SLO(kind="latency", tbt_s=free_tbt_s, tier="free")),
    ]
    arrivals = poisson_arrivals(num_requests, rate, rng)
    return build_requests(trace, arrivals, classes=classes, max_total_tokens=max_total_tokens, rng=rng)


def azure_conv(rate: float, num_requests: int, seed: int) -> list[Request]:
    """The real Azure LLM inference trace (conversation, 2023): real arrivals and lengths, the
    first `num_requests` rows, time-scaled to `rate` (the original runs at 5.5 req/s)."""
    trace = load_trace(bundled("azure_conv_2023.csv.gz")).head(num_requests)
    return build_requests(trace, scale_to_rate(trace.arrival_s, rate))


def answer_rows(answers: Trace | None) -> Trace:
    """The prompt/answer rows a mix draws its text requests from: AlpacaEval's held-out
    instructions (`split_by_instruction`) by default, else `answers` -- which needs prompt texts,
    and loses its empty answers (a request log can hold one; a replayed request needs a token)."""
    from adapt.traces import split_by_instruction

    if answers is None:
        return split_by_instruction(load_trace(bundled("alpaca_eval_lengths.jsonl.gz")))[1]
    if answers.prompt_text is None:
        raise ValueError(f"answers: {answers.name} has no prompt texts")
    answers = answers.take(np.flatnonzero(answers.output_tokens > 0))
    if not len(answers):
        raise ValueError(f"answers: {answers.name} has no answer of one token or more")
    return answers


def sagesched_mix(
    rate: float,
    num_requests: int,
    seed: int,
    shares: tuple[float, float, float] = (0.6, 0.2, 0.2),
    max_total_tokens: int = 8192,
    answers: Trace | None = None,
) -> list[Request]:
    """SageSched's hybrid workload: real AlpacaEval prompts with the real length of one of 24
    models' responses (label `alpaca`), chat requests with ShareGPT lengths (`chat`) and
    long-input/short-output arXiv summarisation requests (`summarize`), 60/20/20 by default, Poisson.

    Only instructions in the held-out split (`instruction_split`, 30%) are drawn, so a
    `semantic-history` trained by `adapt train semantic-history` has never seen them and learns them
    online, as a deployment would. ShareGPT/arXiv rows carry no text; predictors see their length only.
    Alpaca prompts are counted with the MiniLM tokenizer, the others with Llama-2's. `answers`, when
    given, replaces AlpacaEval as what the `alpaca` requests draw their prompts and lengths from
    (another model's answers, or a server's logged traffic); the chat and summarisation rows stay."""
    rng = np.random.default_rng(seed)
    alpaca = answer_rows(answers)
    chat = load_trace(bundled("sharegpt_lengths.csv.gz"))
    summarize = load_trace(bundled("arxiv_summarization_lengths.csv.gz"))
    sources = (("alpaca", alpaca), ("chat", chat), ("summarize", summarize))
    kind = rng.choice(len(sources), size=num_requests, p=np.asarray(shares) / sum(shares))
    prompts = np.empty(num_requests, dtype=np.int64)
    outputs = np.empty(num_requests, dtype=np.int64)
    texts: list[str | None] = [None] * num_requests
    for k, (_, source) in enumerate(sources):
        rows = np.flatnonzero(kind == k)
        picks = rng.integers(0, len(source), size=len(rows))
        prompts[rows] = source.prompt_tokens[picks]
        outputs[rows] = source.output_tokens[picks]
        if source.prompt_text is not None:
            for row, pick in zip(rows, picks, strict=True):
                texts[row] = source.prompt_text[pick]
    trace = Trace("sagesched-mix", prompts, outputs, prompt_text=texts)
    labels = [sources[k][0] for k in kind]
    arrivals = poisson_arrivals(num_requests, rate, rng)
    return build_requests(trace, arrivals, labels=labels, max_total_tokens=max_total_tokens)


JITSERVE_SLOS: dict[str, SLO] = {
    "latency": SLO(kind="latency", ttft_s=2.0, tbt_s=0.1),
    "deadline": SLO(kind="deadline", deadline_s=20.0),
}


def jitserve_mix(
    rate: float,
    num_requests: int,
    seed: int,
    shares: tuple[float, float, float] = (1.0, 1.0, 1.0),
    arrivals: str = "azure",
    answers: Trace | None = None,
) -> list[Request]:
    """JITServe's three request patterns, 1:1:1 by default (paper section 6.1):

    - `latency`: TTFT 2 s, TBT 100 ms; `deadline`: whole response within 20 s -- both real
      AlpacaEval prompts with the real length of one of 24 models' responses, held-out
      instructions only (`instruction_split`), so a `qrf-length` trained on the rest never saw them;
    - `compound`: a generated chatbot-compound, deep-research or agentic-codegen program
      (`adapt.workloads.compound`, shapes and lengths after the paper's Table 2), deadline
      20 s per LLM stage; its later calls arrive as their parents finish.

    `num_requests` counts jobs (a compound job expands into its calls). Job arrivals follow the
    real Azure conversation trace's timestamps time-scaled to `rate` (`arrivals="azure"`), or a
    Poisson process (`arrivals="poisson"`). `answers`, when given, replaces AlpacaEval as what the
    latency and deadline requests draw their prompts and lengths from (it needs prompt texts):
    the same mix and SLOs over another model's answers, or a server's own logged traffic."""
    from adapt.workloads.compound import generate_programs, program_requests

    rng = np.random.default_rng(seed)
    if arrivals == "azure":
        azure = load_trace(bundled("azure_conv_2023.csv.gz"))
        if num_requests > len(azure):
            raise ValueError(f"num_requests: the Azure trace has {len(azure)} arrivals, asked {num_requests}")
        times = scale_to_rate(azure.arrival_s[:num_requests], rate)
    elif arrivals == "poisson":
        times = poisson_arrivals(num_requests, rate, rng)
    else:
        raise ValueError(f"arrivals: expected azure or poisson, got {arrivals!r}")
    answers = answer_rows(answers)
    kinds = rng.choice(3, size=num_requests, p=np.asarray(shares) / sum(shares))
    programs = iter(generate_programs(int((kinds == 2).sum()), seed=seed + 7919))
    requests: list[Request] = []
    for i, (kind, at) in enumerate(zip(kinds, times, strict=True)):
        if kind == 2:
            program_id, stages = next(programs)
            requests.extend(program_requests(program_id, stages, float(at)))
            continue
        label = "latency" if kind == 0 else "deadline"
        row = int(rng.integers(0, len(answers)))
        requests.append(
            Request(
                f"r{i}",
                float(at),
                int(answers.prompt_tokens[row]),
                int(answers.output_tokens[row]),
                slo=JITSERVE_SLOS[label],
                prompt_text=answers.prompt_text[row],  # type: ignore[index]
                label=label,
            )
        )
    return requests


# Each workload's token budget is the one its best non-oracle baseline did best with, measured by
# `python -m experiments.engine_settings --seeds 1` (quickstart sizes and rates, held-out seed 1,
# default cost model): ewsjf-mixed short TTFT fastserve 0.61 s at 2048 vs 2.11 s at 512;
# azure-conv mean TTLT spf 38.9 s at 512 vs 77.4 s at 2048; sagesched-mix mean TTLT spf 40.6 s at
# 512 vs 57.2 s; jitserve-mix goodput plas 0.96 M at 512 vs spf 0.93 M at 2048. slai-tiers is the
# exception: its baselines' median TTFT is better at 2048 (fastserve 0.42 s vs spf 0.62 s at 512),
# but there no policy keeps the paying tier's P99 TBT under its 0.1 s target (one 2048-token step
# outlasts it on the RTX 6000 Ada: spf and slai 0.169 s at 2.8 req/s, 400 requests), while at 512
# slai does (0.071 s) -- a TBT-SLO workload needs a budget whose step fits its tightest TBT, as
# Sarathi-Serve and SLAI run it.
WORKLOADS: dict[str, WorkloadSpec] = {
    "ewsjf-mixed": WorkloadSpec(
        "ewsjf-mixed",
        "80% short / 20% long prompts (32-4096 tokens), Poisson; llama-2-13b on 4 x A100",
        "llama-2-13b",
        "a100-80g",
        4,
        40.0,
        4000,
        ewsjf_mixed,
        token_budget=2048,
    ),
    "slai-tiers": WorkloadSpec(
        "slai-tiers",
        "ShareGPT lengths, 5% paying (TBT 0.1 s) / 95% free (TBT 0.5 s), Poisson; mistral-7b on RTX 6000 Ada",
        "mistral-7b",
        "rtx6000ada",
        1,
        0.8,
        800,
        slai_tiers,
        token_budget=512,
    ),
    "azure-conv": WorkloadSpec(
        "azure-conv",
        "real Azure conversation trace (2023), real arrivals time-scaled; llama-2-13b on 2 x A100",
        "llama-2-13b",
        "a100-80g",
        2,
        5.53,
        19366,
        azure_conv,
        token_budget=512,
    ),
    "sagesched-mix": WorkloadSpec(
        "sagesched-mix",
        "60% AlpacaEval prompts (real responses' lengths) / 20% ShareGPT chat / 20% arXiv"
        " summarisation, Poisson; llama-3-8b on 1 x A40 (the paper's testbed)",
        "llama-3-8b",
        "a40",
        1,
        3.0,
        2000,
        sagesched_mix,
        token_budget=512,
    ),
    "jitserve-mix": WorkloadSpec(
        "jitserve-mix",
        "latency (TTFT 2 s, TBT 0.1 s) / deadline (20 s) AlpacaEval requests and compound programs"
        " (chatbot, deep research, agentic codegen; 20 s per stage) 1:1:1, Azure arrivals;"
        " llama-3-8b on 1 x A100 (the paper's smallest model)",
        "llama-3-8b",
        "a100-80g",
        1,
        2.0,
        1500,
        jitserve_mix,
        token_budget=512,
    ),
    # Drift scenarios (`adapt.workloads.drift`): ewsjf-mixed's sources and engine, chat traffic that
    # gains 30% long-input summarisation a third of the way in. At 12 req/s the post-shift traffic
    # is a little above what EWSJF sustains (short TTFT rises window after window whatever the
    # layout), which is where the layout matters: measured with `experiments.drift_study`, a stale
    # chat layout serves the short requests 1.4-5x slower than the retraining loop's layouts; at
    # 11 req/s the engine keeps up and the stale layout costs 0-30% (seeds 0 and 1).
    "drift-chat-to-summaries": WorkloadSpec(
        "drift-chat-to-summaries",
        "ShareGPT chat, then (a third of the way in, abruptly) 30% arXiv summarisation; stales"
        " EWSJF's queue layout; llama-2-13b on 4 x A100",
        "llama-2-13b",
        "a100-80g",
        4,
        12.0,
        5400,
        chat_to_summaries,
        token_budget=2048,
    ),
    "drift-chat-to-summaries-gradual": WorkloadSpec(
        "drift-chat-to-summaries-gradual",
        "ShareGPT chat, then 0 -> 30% arXiv summarisation over the middle third; stales EWSJF's"
        " queue layout; llama-2-13b on 4 x A100",
        "llama-2-13b",
        "a100-80g",
        4,
        12.0,
        5400,
        chat_to_summaries_gradual,
        token_budget=2048,
    ),
    # jitserve-mix's engine at 1.5x its default rate, where `experiments.bound_staleness` measured a
    # bound gone twice too high to cost JITServe 8% of its token goodput (at 2 jobs/s: 1%).
    "drift-shorter-answers": WorkloadSpec(
        "drift-shorter-answers",
        "jitserve-mix whose latency and deadline requests, a third of the way in, are answered by a"
        " model with answers about half as long (AlpacaEval: GPT-4 1106-preview, then 0613); stales"
        " JITServe's length bound; llama-3-8b on 1 x A100",
        "llama-3-8b",
        "a100-80g",
        1,
        3.0,
        1350,
        shorter_answers,
        token_budget=512,
    ),
}


def get_workload(name: str) -> WorkloadSpec:
    if name not in WORKLOADS:
        raise ValueError(f"workload: unknown {name!r}; expected one of {', '.join(WORKLOADS)}")
    return WORKLOADS[name]
