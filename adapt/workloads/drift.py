"""Drift scenarios: workloads whose traffic changes part-way through, from real length data.

A learned scheduler part is fitted to the traffic it has seen; these workloads change that traffic
at a known time so the cost of a stale part, and what retraining buys back, can be measured
(`experiments.drift_study`). The first two stale EWSJF's queue layout (`ewsjf-meta-policy`),
which Refine-and-Prune fits to the prompt lengths of the request log:

- `drift-chat-to-summaries` (abrupt): a chat service (ShareGPT rows with 32-512-token prompts)
  starts, at `shift_s`, to also take long-input summarisation requests (arXiv rows with
  1024-4096-token prompts), `long_share` of the traffic at the same arrival rate. A layout fitted on
  chat alone has no queue for the long prompts: they join its top queue (Algorithm 2 sends a
  length above the last queue there), where short chats queue behind them and EWSJF's per-queue
  score (which favours short heads) stops telling them apart.
- `drift-chat-to-summaries-gradual`: the same shift, the long share ramping up linearly over
  `ramp_s` seconds instead of at once (a client migrating its traffic).

The third stales JITServe's length bound (`qrf-length`), fitted to prompts and the lengths of
their answers:

- `drift-shorter-answers`: JITServe's mix (`jitserve_mix`) whose latency and deadline requests
  are, from the shift on, answered by another model: the same AlpacaEval instructions answered
  by GPT-4 0613 (median 252 tokens) instead of GPT-4 1106-preview (median 471). A bound
  fitted on the first model's answers now covers every answer and is about twice too high, so
  GMAX reserves time for tokens that never come (`experiments.bound_staleness` measured what that
  costs: 8% of token goodput at 3 jobs/s, nothing when answers get longer instead).

Each is a pure function of (rate, number of requests, seed) like every named workload; the shift
is placed at `shift_share` of the expected duration (num_requests / rate), so a scenario scales
with its size. `pre_shift_lengths` draws prompt lengths of the traffic before the shift from
another seed, and `model_answers` a model's answers to AlpacaEval's instructions: what a
champion serving the traffic before the shift was trained on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from adapt.requests import Request
from adapt.traces import Trace, load_trace, split_by_instruction
from adapt.workloads.builders import build_requests, poisson_arrivals

_DATA = Path(__file__).parent / "data"
SHORT_RANGE = (32, 512)  # ShareGPT chat prompts, as in ewsjf-mixed
LONG_RANGE = (1024, 4096)  # arXiv summarisation prompts, as in ewsjf-mixed
MAX_OUTPUT = 1024
VERBOSE_MODEL = ("gpt4_1106_preview",)  # AlpacaEval generators: answers before the model change
TERSE_MODEL = ("gpt4_0613",)  # and after it


def _rows(file: str, low: int, high: int) -> Trace:
    trace = load_trace(_DATA / file)
    return trace.take(np.flatnonzero((trace.prompt_tokens >= low) & (trace.prompt_tokens <= high)))


def long_share_at(times: np.ndarray, shift_s: float, ramp_s: float, long_share: float) -> np.ndarray:
    """Share of long (summarisation) requests at each arrival time: 0 before `shift_s`, then
    `long_share` at once (`ramp_s` 0) or rising linearly to it over `ramp_s` seconds."""
    if ramp_s <= 0:
        return np.where(times >= shift_s, long_share, 0.0)
    return long_share * np.clip((times - shift_s) / ramp_s, 0.0, 1.0)


def shift_time(rate: float, num_requests: int, shift_share: float) -> float:
    """When the traffic changes: `shift_share` of the expected duration num_requests / rate."""
    return shift_share * num_requests / rate


def chat_to_summaries(
    rate: float,
    num_requests: int,
    seed: int,
    *,
    shift_share: float = 1 / 3,
    ramp_share: float = 0.0,
    long_share: float = 0.3,
) -> list[Request]:
    """Chat traffic that gains long-input summarisation requests at the shift (see module doc).
    `ramp_share`: the ramp's length as a share of the expected duration (0: abrupt). Labels:
    `short` (chat) and `long` (summarisation); Poisson arrivals at `rate` throughout."""
    rng = np.random.default_rng(seed)
    arrivals = poisson_arrivals(num_requests, rate, rng)
    duration = num_requests / rate
    shares = long_share_at(arrivals, shift_share * duration, ramp_share * duration, long_share)
    is_long = rng.random(num_requests) < shares
    short = _rows("sharegpt_lengths.csv.gz", *SHORT_RANGE)
    long = _rows("arxiv_summarization_lengths.csv.gz", *LONG_RANGE)
    prompts = np.empty(num_requests, dtype=np.int64)
    outputs = np.empty(num_requests, dtype=np.int64)
    for mask, source in ((~is_long, short), (is_long, long)):
        picks = rng.integers(0, len(source), size=int(mask.sum()))
        prompts[mask] = source.prompt_tokens[picks]
        outputs[mask] = np.minimum(source.output_tokens[picks], MAX_OUTPUT)
    labels = ["long" if flag else "short" for flag in is_long]
    return build_requests(Trace("chat-to-summaries", prompts, outputs), arrivals, labels=labels)


def chat_to_summaries_gradual(rate: float, num_requests: int, seed: int) -> list[Request]:
    """`chat_to_summaries` with the long share ramping up over a third of the duration."""
    return chat_to_summaries(rate, num_requests, seed, ramp_share=1 / 3)


def pre_shift_lengths(count: int, seed: int) -> np.ndarray:
    """Prompt lengths of the traffic before the shift (chat only)."""
    rng = np.random.default_rng(seed)
    short = _rows("sharegpt_lengths.csv.gz", *SHORT_RANGE)
    return short.prompt_tokens[rng.integers(0, len(short), size=count)].astype(np.float64)


def answered_by(trace: Trace, generators: tuple[str, ...]) -> Trace:
    """The rows of an AlpacaEval trace answered by one of `generators` (a name the data lacks is
    an error, with the names it has)."""
    names = np.asarray(trace.columns["generator"])
    missing = sorted(set(generators) - set(names.tolist()))
    if missing:
        raise ValueError(
            f"no answers from {', '.join(missing)}; the data has {', '.join(sorted(set(names)))}"
        )
    return trace.take(np.flatnonzero(np.isin(names, generators)))


def model_answers(generators: tuple[str, ...], part: str = "all", trace: Trace | None = None) -> Trace:
    """A model's AlpacaEval answers (from `trace` when given, already loaded): to every instruction
    (`"all"`), to the training ones (`"train"`, `split_by_instruction`) or to the held-out ones
    (`"test"`)."""
    if trace is None:
        trace = load_trace(_DATA / "alpaca_eval_lengths.jsonl.gz")
    if part != "all":
        train, test = split_by_instruction(trace)
        trace = {"train": train, "test": test}[part]
    return answered_by(trace, generators)


def shorter_answers(
    rate: float,
    num_requests: int,
    seed: int,
    *,
    shift_share: float = 1 / 3,
    before: tuple[str, ...] = VERBOSE_MODEL,
    after: tuple[str, ...] = TERSE_MODEL,
) -> list[Request]:
    """`jitserve_mix` whose latency and deadline requests are answered by `before`'s model until
    the shift and by `after`'s from then on (see module doc); the arrivals, classes, SLOs and
    compound programs are the mix's own throughout. The prompts are every AlpacaEval instruction,
    not only the held-out ones `jitserve-mix` serves: a retrain splits its logs by instruction
    (`instruction_split`), and logs of held-out instructions alone would leave it none to fit on."""
    from adapt.workloads import jitserve_mix  # the package imports this module

    alpaca = load_trace(_DATA / "alpaca_eval_lengths.jsonl.gz")  # loaded (and tokenised) once
    old = jitserve_mix(rate, num_requests, seed, answers=model_answers(before, trace=alpaca))
    new = jitserve_mix(rate, num_requests, seed, answers=model_answers(after, trace=alpaca))
    shift_s = shift_time(rate, num_requests, shift_share)
    return [
        was if was.program is not None or was.arrival_s < shift_s else now
        for was, now in zip(old, new, strict=True)
    ]
