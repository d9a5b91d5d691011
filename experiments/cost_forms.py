"""Which cost-model form predicts measured step times: fit on pure steps, test on mixed ones.

The two roofline forms (`adapt.replay.cost`) agree on a step that is all prefill or all decode and
differ only on mixed steps: "step" lets a mixed batch's decode KV reads hide under its GEMM compute,
"operator" adds attention's time to the linear layers'. So each form's free constants (FLOP
efficiency, bandwidth efficiency, per-step overhead) are fitted on the pure steps of a measured step
log and judged on the mixed steps it did not see. The linear `cost-model` component is fitted on the
same pure steps for reference. Used by `experiments.gpu_steps compare`.
"""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np

from adapt.replay.cost import GPUS, MODELS, OVERLAPS, RooflineCostModel
from adapt.steplog import STEP_FIELDS, StepBatch
from predictors.cost_model import FEATURES, FittedCostModel

FREE_CONSTANTS: tuple[str, ...] = ("flops_efficiency", "bw_efficiency", "step_overhead_s")


def load_log(path: Path) -> tuple[str, dict[str, np.ndarray]]:
    """A step log CSV written by `experiments.gpu_steps measure`: its model preset and its numeric
    columns (the GPU's name dropped)."""
    with path.open(newline="") as f:
        rows = list(csv.DictReader(f))
    if not rows:
        raise ValueError(f"{path}: no steps")
    models = {row.get("model") for row in rows}
    if len(models) != 1 or None in models or "" in models:
        raise ValueError(
            f"{path}: needs one model preset in its model column, found {sorted(map(str, models))}"
        )
    columns = {}
    for name in rows[0]:
        try:
            columns[name] = np.array([float(row[name]) for row in rows])
        except ValueError:
            continue
    return models.pop(), columns


def _batch(columns: dict[str, np.ndarray], rows: np.ndarray) -> StepBatch:
    return StepBatch(*(columns[name][rows] for name in STEP_FIELDS))


def fit_roofline(base: RooflineCostModel, batch: StepBatch, measured: np.ndarray) -> RooflineCostModel:
    """The roofline with its free constants fitted to minimise squared relative error."""
    from scipy.optimize import least_squares

    def model(theta: np.ndarray) -> RooflineCostModel:
        return base.with_options(**dict(zip(FREE_CONSTANTS, map(float, theta), strict=True)))

    start = np.array([getattr(base, name) for name in FREE_CONSTANTS])
    fit = least_squares(
        lambda theta: model(theta).time(batch) / measured - 1.0,
        x0=np.clip(start, [0.02, 0.02, 0.0], [1.0, 1.0, 0.05]),
        bounds=([0.01, 0.01, 0.0], [1.0, 1.0, 0.05]),
    )
    return model(fit.x)


def errors(predicted: np.ndarray, measured: np.ndarray) -> dict[str, float]:
    relative = np.abs(predicted - measured) / measured
    return {
        "mape": float(relative.mean()),
        "median_ape": float(np.median(relative)),
        "p90_ape": float(np.quantile(relative, 0.9)),
        "max_ape": float(relative.max()),
        "mean_signed": float(np.mean(predicted / measured - 1.0)),
    }


def compare_forms(log: Path, gpu: str = "h100-80g") -> dict:
    """Fit on the log's pure steps, test on its mixed ones; every form's errors and constants."""
    model, columns = load_log(log)
    measured = columns["duration_s"]
    mixed = (columns["prefill_tokens"] > 0) & (columns["decodes"] > 0)
    train, test = np.flatnonzero(~mixed), np.flatnonzero(mixed)
    if len(train) < len(FREE_CONSTANTS) or len(test) == 0:
        raise ValueError(f"{log}: needs pure prefill/decode steps to fit on and mixed steps to test on")
    result: dict = {
        "log": str(log),
        "model": model,
        "gpu": gpu,
        "steps": {"fit": len(train), "test_mixed": len(test)},
        "forms": {},
    }
    for overlap in OVERLAPS:
        preset = RooflineCostModel(MODELS[model], GPUS[gpu], overlap=overlap, step_overhead_s=0.0)
        fitted = fit_roofline(preset, _batch(columns, train), measured[train])
        result["forms"][f"roofline-{overlap}"] = {
            "constants": {name: getattr(fitted, name) for name in FREE_CONSTANTS},
            "fit": errors(fitted.time(_batch(columns, train)), measured[train]),
            "mixed": errors(fitted.time(_batch(columns, test)), measured[test]),
            "mixed_preset_constants": errors(preset.time(_batch(columns, test)), measured[test]),
        }
    linear = FittedCostModel().fit({name: columns[name][train] for name in (*STEP_FIELDS, "duration_s")})
    result["forms"]["linear-cost-model"] = {
        "constants": dict(zip(FEATURES, linear.coef_.tolist(), strict=True)),
        "fit": errors(linear.predict({n: columns[n][train] for n in STEP_FIELDS}), measured[train]),
        "mixed": errors(linear.predict({n: columns[n][test] for n in STEP_FIELDS}), measured[test]),
    }
    result["additivity"] = _additivity(columns, test)
    rooflines = {k: v for k, v in result["forms"].items() if k.startswith("roofline-")}
    result["best_form"] = min(rooflines, key=lambda k: rooflines[k]["mixed"]["mape"]).removeprefix(
        "roofline-"
    )
    return result


def _additivity(columns: dict[str, np.ndarray], mixed: np.ndarray) -> dict[str, float]:
    """Each mixed step against its own parts measured alone: mixed / (prefill + decode) and
    mixed / max(prefill, decode), medians over the mixed steps whose parts were both measured."""
    key = {
        (
            columns["prefill_tokens"][i],
            columns["prefill_cached"][i],
            columns["decodes"][i],
            columns["decode_context"][i],
        ): columns["duration_s"][i]
        for i in range(len(columns["duration_s"]))
    }
    to_sum, to_max = [], []
    for i in mixed:
        P, p, D, C = (
            columns[c][i] for c in ("prefill_tokens", "prefill_cached", "decodes", "decode_context")
        )
        prefill, decode = key.get((P, p, 0.0, 0.0)), key.get((0.0, 0.0, D, C))
        if prefill is None or decode is None:
            continue
        to_sum.append(columns["duration_s"][i] / (prefill + decode))
        to_max.append(columns["duration_s"][i] / max(prefill, decode))
    if not to_sum:
        return {"pairs": 0}
    return {
        "pairs": len(to_sum),
        "mixed_over_sum_median": float(np.median(to_sum)),
        "mixed_over_max_median": float(np.median(to_max)),
    }


def print_comparison(result: dict) -> None:
    print(
        f"{result['model']} on {result['gpu']}: fitted on {result['steps']['fit']} pure steps,"
        f" tested on {result['steps']['test_mixed']} mixed steps ({result['log']})"
    )
    print(f"{'form':<22}{'fit MAPE':>10}{'mixed MAPE':>12}{'median':>9}{'P90':>8}{'bias':>8}   constants")
    for name, form in result["forms"].items():
        fit, mixed = form["fit"], form["mixed"]
        constants = ", ".join(f"{k}={v:.3g}" for k, v in form["constants"].items())
        print(
            f"{name:<22}{fit['mape']:>10.1%}{mixed['mape']:>12.1%}{mixed['median_ape']:>9.1%}"
            f"{mixed['p90_ape']:>8.1%}{mixed['mean_signed']:>+8.1%}   {constants}"
        )
    for name, form in result["forms"].items():
        if "mixed_preset_constants" in form:
            print(f"{name} with preset efficiencies: mixed MAPE {form['mixed_preset_constants']['mape']:.1%}")
    add = result["additivity"]
    if add.get("pairs"):
        print(
            "mixed step / (its prefill alone + its decodes alone): median"
            f" {add['mixed_over_sum_median']:.2f}; / max of the two:"
            f" {add['mixed_over_max_median']:.2f} ({add['pairs']} pairs)"
        )
    print(f"best roofline form on mixed steps: {result['best_form']}")
