"""Every registered component follows scikit-learn's estimator conventions.

`sklearn.utils.estimator_checks.check_estimator` cannot run here as a whole (it feeds X/y arrays;
components fit step logs, traces, program graphs or replay objectives), so its checks that need no
data run as they are, and the rest are restated for a small fitted instance of each component,
built from tiny data made below: hyper-parameters are the `__init__` arguments, stored unchanged
and round-tripping through `get_params`/`set_params`; validation waits for `fit`; `fit` returns
self and leaves the parameters alone; fitted state ends in `_` and `sklearn.base.clone` drops it
(and `metadata`); a save/load round trip predicts the same and validates; a refit of a loaded
version starts its metadata afresh; what needs fitted state raises scikit-learn's `NotFittedError`
before fit. A new entry point without a case here fails `test_every_component_has_a_case`.
"""

from __future__ import annotations

import inspect
import json
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.utils import estimator_checks
from sklearn.utils.validation import check_is_fitted

from adapt.component import (
    ComponentError,
    LearnedComponent,
    component_class,
    known_components,
    registry_version,
)
from adapt.traces import Trace
from adapt.workloads.compound import generate_graphs
from tests.replay_helpers import step_log

# ------------------------------------------------------------------------------- tiny data


def slai_objective(offset: Callable[[float], float]) -> dict[str, Any]:
    """A made-up replay: a larger offset at low KV usage costs TTFT, one below 8 at full usage
    misses the TBT SLO."""
    low, high = offset(0.0), offset(1.0)
    return {"feasible": high >= 8.0, "tbt_excess": max(0.0, 8.0 - high), "ttft_p50": 0.1 + 0.01 * low}


PROMPT_LENGTHS = np.concatenate([np.arange(8, 120, 3), np.arange(400, 700, 11), np.arange(2000, 2600, 37)])
TOPICS = ("the sea", "tax law", "sourdough bread", "graph theory")


def prompt_responses(instructions: int = 16, answers: int = 3, seed: int = 0) -> Trace:
    """Prompt/response pairs in the AlpacaEval format: several answers per instruction, lengths that
    depend on the topic, response texts of as many words as tokens."""
    rng = np.random.default_rng(seed)
    texts, outputs = [], []
    for i in range(instructions):
        for _ in range(answers):
            detail = " in detail" * (i % 5)  # prompt lengths that vary (neural-length standardises them)
            texts.append(f"Question {i}: write about {TOPICS[i % len(TOPICS)]}{detail}.")
            outputs.append(int(rng.integers(20, 60)) * (1 + i % len(TOPICS)) * 2)
    return Trace(
        name="tiny-alpaca",
        prompt_tokens=np.array([len(t.split()) + 2 for t in texts]),
        output_tokens=np.array(outputs),
        prompt_text=texts,
        columns={"output_text": [" ".join(["token"] * n) for n in outputs]},
    )


# ---------------------------------------------------------------------- prediction probes


def semantic_probe(history: Any) -> np.ndarray:
    distributions = history.predict([9, 40], ["Question 1: write about tax law.", None])
    return np.concatenate([np.r_[d.support, d.probs] for d in distributions])


BOUND_PROBE = ([12, 300], ["Question 2: write about sourdough bread.", "Say hi."], [0, 100], ["", "token"])


def pattern_probe(patterns: Any) -> list[float]:
    values = []
    for graph in generate_graphs(6, seed=99):
        for s in range(len(graph.stages)):
            for method in (patterns.stage_share, patterns.stage_output_bound):
                value = method(graph.stages[:s], graph.stages[s])
                values.append(np.nan if value is None else value)
    return values


# -------------------------------------------------------------------------------- cases


@dataclass(frozen=True)
class Case:
    """How to fit one component cheaply and what to check on it."""

    params: dict[str, Any]  # small, fast hyper-parameters of the fitted instance
    data: Callable[[], Any]
    predict: Callable[[Any], Any]  # its own prediction method, on fixed inputs
    other: dict[str, Any]  # non-default values, to see `__init__` store them unchanged
    invalid: dict[str, Any] | None = None  # a value `fit` must refuse (None: nothing validated at fit)
    fit_kwargs: dict[str, Any] = field(default_factory=dict)
    stateless: bool = False  # nothing to learn: no fitted attributes
    slow: bool = False  # over ~10 s (loads MiniLM, or trains with Lightning)


CASES: dict[str, Case] = {
    "cost-model": Case(
        params={"kv_capacity": 4321},
        data=lambda: step_log(n=40),
        predict=lambda model: model.predict(step_log(seed=1, n=10)),
        other={"kv_capacity": 1234},
        invalid={"kv_capacity": "50000"},
    ),
    "slai-offset": Case(
        params={},
        data=lambda: slai_objective,
        fit_kwargs={"n_trials": 3, "seed": 0},
        predict=lambda offset: [offset(u) for u in (0.0, 0.5, 0.9, 0.97, 1.0)],
        other={"thresholds": [0.5, 0.9], "levels": [1.0, 2.0, 3.0]},
    ),
    "ewsjf-meta-policy": Case(
        params={"alpha": 2.5, "max_queues": 6},
        data=lambda: PROMPT_LENGTHS,
        predict=lambda meta: [
            *(v for q in meta.queues_ for v in (q.low, q.high, q.mean, q.share)),
            meta.w_urg(500.0),
            meta.w_fair(500.0),
            *meta.evaluate(PROMPT_LENGTHS).values(),
        ],
        other={"a_u": 1e-4, "b_u": 2.0, "max_queues": 4, "partition": "kmeans", "k": 3, "seed": 7},
        invalid={"partition": "bogus"},
    ),
    "semantic-history": Case(
        params={"window": 30, "min_neighbors": 2, "fallback_neighbors": 6, "max_support": 8},
        data=prompt_responses,
        predict=semantic_probe,
        other={"window": 50, "threshold": 0.7, "max_neighbors": 16, "mode": "length"},
        invalid={"mode": "bogus"},
        slow=True,
    ),
    "qrf-length": Case(
        params={"n_estimators": 4, "max_depth": 4, "min_samples_leaf": 2, "prompt_features": 16},
        data=prompt_responses,
        predict=lambda qrf: qrf.predict_bound(*BOUND_PROBE),
        other={"quantile": 0.9, "n_estimators": 7, "generated_features": 0, "calibration_share": 0.0},
        invalid={"quantile": 0.3},
    ),
    "neural-length": Case(
        params={"hidden": 8, "epochs": 1, "batch_size": 32},
        data=prompt_responses,
        predict=lambda net: net.predict_bound(*BOUND_PROBE),
        other={"quantiles": [0.5, 0.8], "quantile": 0.8, "hidden": 16, "dropout": 0.0},
        invalid={"quantile": 0.8},
        slow=True,
    ),
    "pattern-graph": Case(
        params={"max_graphs": 8, "neighbors": 3},
        data=lambda: generate_graphs(20, seed=1),
        predict=pattern_probe,
        other={"max_graphs": 30, "bandwidth": 0.7, "decay": 0.5, "neighbors": 2, "random_state": 3},
        invalid={"bandwidth": 0.0},
    ),
    "policy-config": Case(
        params={"policy": "sarathi", "params": {"token_budget": 256}},
        data=lambda: None,
        predict=lambda config: config.build().describe(),
        other={"policy": "spf", "params": {"order": "spf"}},
        stateless=True,
    ),
}


@dataclass
class Fitted:
    name: str
    case: Case
    component: LearnedComponent
    returned: Any  # what `fit` returned
    params_before_fit: dict[str, Any]


def _names() -> list[Any]:
    return [
        pytest.param(name, marks=pytest.mark.slow) if name in CASES and CASES[name].slow else name
        for name in known_components()
    ]


@pytest.fixture(scope="module", params=_names())
def fitted(request) -> Fitted:
    name = request.param
    if name not in CASES:
        pytest.fail(f"{name}: no conformance case in {__name__}.CASES")
    case = CASES[name]
    component = component_class(name)(**case.params)
    before = component.get_params(deep=False)
    returned = component.fit(case.data(), **case.fit_kwargs)
    return Fitted(name, case, component, returned, before)


def fitted_attributes(component: Any) -> list[str]:
    """scikit-learn's test for fitted state (`check_is_fitted`): attributes ending in `_`."""
    return sorted(k for k in vars(component) if k.endswith("_") and not k.startswith("__"))


def init_arguments(cls: type) -> dict[str, inspect.Parameter]:
    return {k: p for k, p in inspect.signature(cls.__init__).parameters.items() if k != "self"}


def as_json(value: Any) -> Any:
    """What the header's JSON makes of parameters (a tuple comes back as a list)."""
    return json.loads(json.dumps(value, default=str))


def assert_same_predictions(got: Any, expected: Any) -> None:
    if isinstance(expected, dict):
        assert got == expected
    else:
        np.testing.assert_allclose(np.asarray(got, dtype=float), np.asarray(expected, dtype=float))


# ---------------------------------------------------------------------------------- checks


def test_every_component_has_a_case():
    assert set(known_components()) == set(CASES)


@pytest.mark.parametrize("name", known_components())
@pytest.mark.parametrize(
    "check",
    [
        estimator_checks.check_parameters_default_constructible,
        estimator_checks.check_no_attributes_set_in_init,
        estimator_checks.check_get_params_invariance,
        estimator_checks.check_set_params,
    ],
    ids=lambda check: check.__name__,
)
def test_scikit_learn_checks_that_need_no_data(name, check):
    check(name, component_class(name)())


def test_params_are_the_init_arguments_and_round_trip(fitted):
    component = fitted.component
    cls = type(component)
    params = component.get_params(deep=False)
    assert set(params) == set(init_arguments(cls)) and "metadata" not in params
    assert cls(**params).get_params(deep=False) == params
    deep = component.get_params(deep=True)
    assert all(deep[name] is value for name, value in params.items())
    state = {name: id(value) for name, value in vars(component).items()}
    assert component.set_params(**params) is component
    assert component.get_params(deep=False) == params
    assert {name: id(value) for name, value in vars(component).items()} == state  # a no-op


def test_init_stores_its_arguments_unchanged_and_defaults_are_kept(fitted):
    cls = type(fitted.component)
    given = cls(**fitted.case.other).get_params(deep=False)
    for name, value in fitted.case.other.items():
        assert given[name] is value, f"{name}: __init__ stored {given[name]!r}, not the {value!r} given"
    default = cls()
    for name, parameter in init_arguments(cls).items():
        assert default.get_params(deep=False)[name] is parameter.default, name
    # Nothing but the arguments is set in __init__ (private caches aside): no derived state.
    assert {k for k in vars(cls(**fitted.case.other)) if not k.startswith("_")} <= set(given)


def test_invalid_parameters_are_refused_at_fit_not_construction(fitted):
    if fitted.case.invalid is None:
        pytest.skip(f"{fitted.name}: no parameter is validated at fit")
    cls = type(fitted.component)
    bad = cls(**{**fitted.case.params, **fitted.case.invalid})  # must not raise
    for name, value in fitted.case.invalid.items():
        assert bad.get_params(deep=False)[name] is value
    pattern = "|".join(re.escape(name) for name in fitted.case.invalid)
    with pytest.raises(ValueError, match=pattern):
        bad.fit(fitted.case.data(), **fitted.case.fit_kwargs)


def test_fit_returns_self_and_leaves_the_parameters_alone(fitted):
    assert fitted.returned is fitted.component
    after = fitted.component.get_params(deep=False)
    assert after.keys() == fitted.params_before_fit.keys()
    for name, value in fitted.params_before_fit.items():
        assert after[name] is value, f"fit changed the parameter {name}"


def test_fitted_state_ends_in_underscore_and_clone_drops_it(fitted):
    component = fitted.component
    if fitted.case.stateless:
        assert fitted_attributes(component) == []
    else:
        check_is_fitted(component)
    twin = clone(component)
    assert type(twin) is type(component) and twin is not component
    assert as_json(twin.get_params(deep=False)) == as_json(component.get_params(deep=False))
    assert fitted_attributes(twin) == []
    assert twin.metadata == {} and twin.metadata is not component.metadata
    if not fitted.case.stateless:
        with pytest.raises(NotFittedError):
            check_is_fitted(twin)


def test_save_load_round_trip_predicts_the_same(fitted, tmp_path):
    component = fitted.component
    directory = component.save(tmp_path / fitted.name)
    loaded = type(component).load(directory)
    loaded.validate()
    assert as_json(loaded.get_params(deep=False)) == as_json(component.get_params(deep=False))
    assert fitted_attributes(loaded) == fitted_attributes(component)
    assert_same_predictions(fitted.case.predict(loaded), fitted.case.predict(component))


def test_a_refit_of_a_loaded_version_starts_its_metadata_afresh(fitted, tmp_path):
    """A refit is a new model: the registry version, save time and data window of the version it
    was loaded as must not survive it, or it reports itself as that version."""
    if fitted.case.stateless:
        pytest.skip(f"{fitted.name}: nothing to fit")
    loaded = type(fitted.component).load(fitted.component.save(tmp_path / fitted.name))
    loaded.metadata.update(registry_version=7, data_window="the loaded version's window")
    assert "saved_at" in loaded.metadata
    loaded.fit(fitted.case.data(), **fitted.case.fit_kwargs)
    assert registry_version(loaded) == "in-memory"
    assert "saved_at" not in loaded.metadata
    assert loaded.metadata.get("data_window") != "the loaded version's window"


def _save(component: LearnedComponent, directory: Any) -> Any:
    return component.save(directory)


# What each component refuses before fit. The others serve unfitted by design -- semantic-history
# and pattern-graph from an empty history, slai-offset with its given rule, policy-config has no
# state -- and qrf-length's and neural-length's `predict_bound` are left to their input checks.
UNFITTED_CALLS = [
    pytest.param("cost-model", lambda model, _: model.predict(step_log(n=3)), id="cost-model.predict"),
    pytest.param("cost-model", lambda model, _: model.evaluate(step_log(n=3)), id="cost-model.evaluate"),
    pytest.param("cost-model", _save, id="cost-model.save"),
    pytest.param("qrf-length", lambda qrf, _: qrf.evaluate(prompt_responses()), id="qrf-length.evaluate"),
    pytest.param("qrf-length", _save, id="qrf-length.save"),
    pytest.param("neural-length", lambda net, _: net.evaluate(prompt_responses()), id="neural.evaluate"),
    pytest.param("neural-length", _save, id="neural.save"),
    pytest.param("ewsjf-meta-policy", lambda meta, _: meta.evaluate(PROMPT_LENGTHS), id="ewsjf.evaluate"),
    pytest.param("ewsjf-meta-policy", _save, id="ewsjf.save"),
    pytest.param("pattern-graph", _save, id="pattern-graph.save"),
]


@pytest.mark.parametrize(("name", "call"), UNFITTED_CALLS)
def test_what_needs_fitted_state_raises_scikit_learns_not_fitted_error_before_fit(name, call, tmp_path):
    with pytest.raises(NotFittedError, match=f"{name}: not fitted") as raised:
        call(component_class(name)(), tmp_path / name)
    assert isinstance(raised.value, ComponentError)  # what the registry and the pipelines catch


def test_importing_every_component_leaves_scikit_learn_unimported():
    """`ComponentNotFitted` subclasses scikit-learn's error, whose import takes over a second: only
    raising it may import scikit-learn, never loading a component for a serving engine."""
    script = (
        "import sys\n"
        "from adapt.component import component_class, known_components\n"
        "for name in known_components(): component_class(name)\n"
        "assert 'sklearn' not in sys.modules, 'imported scikit-learn'\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True)
