"""Workload generation: arrival processes, time-scaling, mixing sources, SLO/tier assignment.

Everything takes an explicit seed or `numpy.random.Generator`, so a workload is a pure function of
its arguments: the same seed gives the same requests, which is what makes policy comparisons on
"the identical request sequence" possible.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from adapt.requests import SLO, Request
from adapt.traces import Trace


def poisson_arrivals(n: int, rate: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times of a Poisson process at `rate` per second, starting at 0."""
    return gamma_arrivals(n, rate, cv=1.0, rng=rng)


def gamma_arrivals(n: int, rate: float, cv: float, rng: np.random.Generator) -> np.ndarray:
    """n arrival times with Gamma inter-arrival gaps: mean 1/rate, coefficient of variation `cv`.

    cv = 1 is Poisson; cv > 1 is bursty (BurstGPT and the Azure traces show cv of 2-4).
    """
    if n < 0:
        raise ValueError(f"n: must be >= 0, got {n}")
    if not rate > 0:
        raise ValueError(f"rate: must be > 0, got {rate}")
    if not cv > 0:
        raise ValueError(f"cv: must be > 0, got {cv}")
    if n == 0:
        return np.zeros(0)
    shape = 1.0 / (cv * cv)
    gaps = rng.gamma(shape, scale=1.0 / (rate * shape), size=n)
    gaps[0] = 0.0
    return np.cumsum(gaps)


def scale_to_rate(arrivals: np.ndarray, rate: float) -> np.ndarray:
    """Stretch or compress real arrival times so their mean rate becomes `rate`, keeping burstiness."""
    if not rate > 0:
        raise ValueError(f"rate: must be > 0, got {rate}")
    arrivals = np.asarray(arrivals, dtype=np.float64)
    if len(arrivals) < 2:
        return arrivals - (arrivals[0] if len(arrivals) else 0.0)
    span = arrivals[-1] - arrivals[0]
    if span <= 0:
        raise ValueError("cannot scale a trace whose arrivals all share one timestamp")
    current = (len(arrivals) - 1) / span
    return (arrivals - arrivals[0]) * (current / rate)


@dataclass(frozen=True)
class SLOClass:
    """One share of a workload: requests in it get `slo` and are reported under `label`."""

    label: str
    weight: float
    slo: SLO


def assign_classes(n: int, classes: Sequence[SLOClass], rng: np.random.Generator) -> np.ndarray:
    """Index into `classes` for each of n requests, drawn by weight."""
    weights = np.asarray([c.weight for c in classes], dtype=np.float64)
    if len(weights) == 0 or np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError("classes: need at least one class and non-negative weights with a positive sum")
    return rng.choice(len(classes), size=n, p=weights / weights.sum())


def mix_traces(
    sources: Sequence[tuple[Trace, float]], n: int, rng: np.random.Generator
) -> tuple[Trace, list[str]]:
    """Draw n rows from several traces in proportion to their weights; returns the rows and a
    source label per row (the trace's name), so `by_class` can report per source."""
    if not sources:
        raise ValueError("sources: need at least one trace")
    weights = np.asarray([w for _, w in sources], dtype=np.float64)
    if np.any(weights < 0) or weights.sum() <= 0:
        raise ValueError("sources: weights must be non-negative with a positive sum")
    which = rng.choice(len(sources), size=n, p=weights / weights.sum())
    prompts = np.empty(n, dtype=np.int64)
    outputs = np.empty(n, dtype=np.int64)
    texts: list[str | None] = [None] * n
    labels = [""] * n
    for k, (trace, _) in enumerate(sources):
        rows = np.flatnonzero(which == k)
        if len(rows) == 0:
            continue
        if len(trace) == 0:
            raise ValueError(f"sources: trace {trace.name!r} is empty")
        picks = rng.integers(0, len(trace), size=len(rows))
        prompts[rows] = trace.prompt_tokens[picks]
        outputs[rows] = trace.output_tokens[picks]
        for row, pick in zip(rows, picks, strict=True):
            labels[row] = trace.name
            if trace.prompt_text is not None:
                texts[row] = trace.prompt_text[pick]
    has_text = all(t is not None for t in texts)
    mixed = Trace(
        name="+".join(t.name for t, _ in sources),
        prompt_tokens=prompts,
        output_tokens=outputs,
        prompt_text=texts if has_text else None,  # type: ignore[arg-type]
    )
    return mixed, labels


def build_requests(
    trace: Trace,
    arrivals: np.ndarray | None = None,
    *,
    classes: Sequence[SLOClass] | None = None,
    labels: Sequence[str] | None = None,
    max_total_tokens: int | None = None,
    rng: np.random.Generator | None = None,
    id_prefix: str = "r",
) -> list[Request]:
    """Turn trace rows into `Request`s with arrivals, SLO classes and labels.

    `arrivals` defaults to the trace's own timestamps. `max_total_tokens` caps prompt+output the way
    a serving context window does (the output is cut first, then the prompt).
    """
    arrivals = trace.arrival_s if arrivals is None else np.asarray(arrivals, dtype=np.float64)
    if arrivals is None:
        raise ValueError(f"trace {trace.name!r} has no timestamps: pass arrivals (e.g. poisson_arrivals)")
    if len(arrivals) != len(trace):
        raise ValueError(f"arrivals: {len(arrivals)} times for {len(trace)} requests")
    if classes and rng is None:
        raise ValueError("rng: needed to assign classes")
    class_idx = assign_classes(len(trace), classes, rng) if classes else None
    requests = []
    for i in range(len(trace)):
        prompt, output = int(trace.prompt_tokens[i]), int(trace.output_tokens[i])
        if max_total_tokens is not None and prompt + output > max_total_tokens:
            output = max(1, max_total_tokens - prompt)
            prompt = min(prompt, max_total_tokens - output)
        slo_class = classes[class_idx[i]] if class_idx is not None else None
        label = slo_class.label if slo_class is not None else (labels[i] if labels is not None else None)
        requests.append(
            Request(
                request_id=f"{id_prefix}{i}",
                arrival_s=float(arrivals[i]),
                prompt_tokens=prompt,
                output_tokens=output,
                slo=slo_class.slo if slo_class is not None else SLO(),
                prompt_text=trace.prompt_text[i] if trace.prompt_text is not None else None,
                label=label,
            )
        )
    return requests


def trace_requests(trace: Trace, rate: float | None, seed: int) -> list[Request]:
    """The requests `adapt replay --trace` replays from a user's trace: its own timestamps
    (time-scaled to `rate` when given, keeping their burstiness), or for a length-only trace, which
    has none, Poisson arrivals at `rate` drawn with `seed`. One function, so a study replays a
    user's trace exactly as the command does."""
    if trace.arrival_s is not None:
        arrivals = trace.arrival_s if rate is None else scale_to_rate(trace.arrival_s, rate)
        return build_requests(trace, arrivals)
    if rate is None:
        raise ValueError(f"{trace.name}: this trace has no timestamps; a rate is needed for Poisson arrivals")
    return build_requests(trace, poisson_arrivals(len(trace), rate, np.random.default_rng(seed)))
