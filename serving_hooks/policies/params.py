"""Policy parameters checked where they enter: a `name:key=value` spec, a policy-config, a tuner.

A spec's values are parsed as JSON, so `token_budget=1.5`, `offset=NaN` or `token_budget=0` used to
reach a constructor as they were and fail much later (or, worse, not at all: a budget of 0 meant the
engine's). `check_params` refuses them at once with one line naming the parameter and what it
allows. The type comes from the constructor's annotation (only plain scalars are checked: int,
float, bool, str, None; components, callables and containers are the constructor's business); the
range from `RANGES`, by name, because a parameter name means the same in every policy (a
`token_budget` is always tokens per step). A number not listed must be finite and non-negative:
every numeric policy parameter is a count, a time, a rate, a weight or a probability.
"""

from __future__ import annotations

import inspect
import math
import numbers
from dataclasses import dataclass
from typing import Any

SCALARS = frozenset({"int", "float", "bool", "str", "None"})


@dataclass(frozen=True)
class Range:
    """An interval of allowed values; open ends exclude the bound."""

    low: float = 0.0
    high: float = math.inf
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        above = value > self.low if self.low_open else value >= self.low
        below = value < self.high if self.high_open else value <= self.high
        return math.isfinite(value) and above and below

    def __str__(self) -> str:
        high = "inf)" if math.isinf(self.high) else f"{self.high:g}{')' if self.high_open else ']'}"
        return f"{'(' if self.low_open else '['}{self.low:g}, {high}"


AT_LEAST_ONE = Range(1)
POSITIVE = Range(0, low_open=True)
SHARE = Range(0, 1)
RANGES: dict[str, Range] = {
    **dict.fromkeys(
        (
            "token_budget",
            "max_active",
            "decode_limit",
            "levels",
            "base_quantum",
            "prompt_tokens_per_quantum",
            "refresh",
            "frame_steps",
            "batch_size",
            "refine_every",
            "bucket",
            "window",
            "pairs",
            "refit_windows",
        ),
        AT_LEAST_ONE,
    ),
    **dict.fromkeys(("prefill_tokens_per_s", "flip_ratio", "z"), POSITIVE),
    "waiting_time_s": Range(0),  # 0: drop whatever is not scheduled at once (a test relies on it)
    **dict.fromkeys(("fairness", "explore", "uniform_mix"), SHARE),
    "quantile": Range(0, 1, low_open=True, high_open=True),
    "cutoff": Range(0, 1, low_open=True),
    "reserve_below": Range(0, 1, low_open=True),
    "best_effort_batches": Range(0),
}
DEFAULT_RANGE = Range()


def check_params(policy_class: type, params: dict[str, Any]) -> None:
    """Raise ValueError (one line: parameter, allowed values, what was given) for the first
    parameter the policy does not take, or whose value does not fit its annotation's scalar type
    or its range."""
    parameters = _init_parameters(policy_class)
    for key, value in params.items():
        if key not in parameters:
            accepted = ", ".join(parameters) or "none"
            raise ValueError(f"{key}: not a parameter of this policy; it takes {accepted}")
        _check_value(key, value, _annotation_types(parameters[key].annotation))


def _init_parameters(policy_class: type) -> dict[str, inspect.Parameter]:
    """The named parameters of a policy's constructor, those it passes on through `**kwargs` to a
    parent's (slai-fixed's to slai's) included, each where it is declared, in declaration order."""
    found: dict[str, inspect.Parameter] = {}
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    for cls in policy_class.__mro__:
        if "__init__" not in vars(cls) or cls is object:
            continue
        parameters = list(inspect.signature(cls.__init__).parameters.values())[1:]  # not self
        for parameter in parameters:
            if parameter.kind not in variadic:
                found.setdefault(parameter.name, parameter)
        if not any(p.kind is p.VAR_KEYWORD for p in parameters):
            break
    return found


def _annotation_types(annotation: Any) -> set[str]:
    """`int | None` -> {"int", "None"}; anything but a plain scalar comes back as itself (and
    is not checked). Annotations are strings here (`from __future__ import annotations`)."""
    if annotation is inspect.Parameter.empty:
        return {"Any"}
    text = annotation if isinstance(annotation, str) else getattr(annotation, "__name__", str(annotation))
    return {part.strip() for part in text.split("|")}


def _check_value(key: str, value: Any, types: set[str]) -> None:
    only_scalars = types <= SCALARS
    if value is None:
        if only_scalars and "None" not in types:
            raise ValueError(f"{key}: expected {_expected(key, types)}, got null")
        return
    if isinstance(value, bool):
        if only_scalars and "bool" not in types:
            raise ValueError(f"{key}: expected {_expected(key, types)}, got {value!r}")
        return
    if isinstance(value, numbers.Real):
        integral = isinstance(value, numbers.Integral)
        if "float" in types or ("int" in types and integral):
            allowed = RANGES.get(key, DEFAULT_RANGE)
            if float(value) not in allowed:
                raise ValueError(f"{key}: expected {_expected(key, types)}, got {value!r}")
        elif "int" in types or only_scalars:
            raise ValueError(f"{key}: expected {_expected(key, types)}, got {value!r}")
        return
    if only_scalars and not (isinstance(value, str) and "str" in types):
        raise ValueError(f"{key}: expected {_expected(key, types)}, got {value!r}")


def _expected(key: str, types: set[str]) -> str:
    """What a parameter allows, e.g. `an integer in [1, inf)` or `true or false`."""
    allowed = []
    if "int" in types and "float" not in types:
        allowed.append(f"an integer in {RANGES.get(key, DEFAULT_RANGE)}")
    elif "float" in types:
        allowed.append(f"a finite number in {RANGES.get(key, DEFAULT_RANGE)}")
    if "bool" in types:
        allowed.append("true or false")
    if "str" in types:
        allowed.append("a string")
    if "None" in types:
        allowed.append("null")
    return " or ".join(allowed)
