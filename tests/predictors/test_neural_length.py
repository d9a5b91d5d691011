"""`neural-length` and the bound helpers it shares with `qrf-length`: the pinball loss and the
conformal factor against hand-computed cases, non-crossing quantiles, and (slow) a fit on real
AlpacaEval prompts, its safetensors round trip, and the pipeline's MLflow run."""

from __future__ import annotations

import gzip
import json

import numpy as np
import pytest
import torch

from adapt.component import ComponentError, read_component
from adapt.registry import Registry
from predictors.length_bounds import (
    TRAIN_POINTS,
    apply_scales,
    conformal_scales,
    coverage_metrics,
    refinement_rows,
)
from predictors.neural_length import NeuralLength
from predictors.quantile_mlp import QuantileNet, pinball_loss


def test_pinball_loss_by_hand():
    # y = 3; predictions 1 (q = 0.5) and 4 (q = 0.9): errors 2 and -1
    # losses 0.5 * 2 = 1.0 and (0.9 - 1) * -1 = 0.1 -> mean 0.55
    loss = pinball_loss(torch.tensor([[1.0, 4.0]]), torch.tensor([3.0]), torch.tensor([0.5, 0.9]))
    assert loss.item() == pytest.approx(0.55)


def test_quantile_outputs_never_cross():
    net = QuantileNet(inputs=8, hidden=16, quantiles=3).eval()
    out = net(torch.randn(500, 8) * 10)
    assert (torch.diff(out, dim=1) >= 0).all()


def test_refinement_rows_by_hand():
    index, generated, remaining = refinement_rows([30, 120], (0, 50, 100))
    assert index.tolist() == [0, 1, 1, 1]
    assert generated.tolist() == [0, 0, 50, 100]
    assert remaining.tolist() == [30, 120, 70, 20]


def test_conformal_scale_is_the_rounded_up_ratio_quantile():
    # 39 rows at g = 0 with ratios 1/39 ... 39/39: (n + 1) * 0.95 = 38 -> the 38th smallest ratio
    n = 39
    remaining = np.arange(1, n + 1, dtype=float)
    scales = conformal_scales(remaining, np.full(n, float(n)), np.zeros(n, dtype=int), 0.95)
    assert scales["0"] == pytest.approx(38 / 39)
    assert scales["50"] == 1.0  # no rows reached 50: left alone
    bounds = apply_scales(np.array([100.0, 100.0]), np.array([10, 60]), {**scales, "50": 2.0})
    assert bounds.tolist() == pytest.approx([100 * 38 / 39, 200.0])


def test_a_negative_generated_count_has_no_calibration_point_and_is_refused():
    """-1 indexed the last factor (g = 400's) before."""
    scales = {str(p): float(1 + p) for p in TRAIN_POINTS}
    for generated in ([-1], [0, float("nan")]):
        with pytest.raises(ValueError, match="generated tokens"):
            apply_scales(np.full(len(generated), 100.0), np.array(generated), scales)


def test_coverage_metrics_by_hand():
    metrics = coverage_metrics(np.array([10.0, 30.0]), np.array([20.0, 20.0]), np.array([0, 0]), 0.95)
    assert metrics["coverage_at_0"] == 0.5
    assert metrics["overestimate_at_0"] == pytest.approx((2.0 + 2 / 3) / 2)
    assert metrics["coverage_error"] == pytest.approx(0.45)
    # 0.95 quantile loss: 0.05 * (20 - 10) over, 0.95 * (30 - 20) under, mean (0.5 + 9.5) / 2
    assert metrics["pinball_loss"] == pytest.approx(5.0)


def test_the_gate_metric_prefers_a_tight_bound_to_one_ten_times_too_high():
    """Remaining lengths 1..20: a bound of 200 covers all (misses 0.95 by 0.05); a bound of 17
    covers 0.85 (misses by 0.10), so coverage error would keep the useless one. Pinball loss:
    0.05 * (200 - 10.5) = 9.475 against (0.05 * (0 + ... + 16) + 0.95 * (1 + 2 + 3)) / 20 = 0.625."""
    remaining, at_0 = np.arange(1.0, 21.0), np.zeros(20, dtype=int)
    high = coverage_metrics(remaining, np.full(20, 200.0), at_0, 0.95)
    tight = coverage_metrics(remaining, np.full(20, 17.0), at_0, 0.95)
    assert high["coverage_error"] == pytest.approx(0.05) and tight["coverage_error"] == pytest.approx(0.10)
    assert high["pinball_loss"] == pytest.approx(9.475) and tight["pinball_loss"] == pytest.approx(0.625)


@pytest.mark.parametrize(
    "kwargs",
    [{"quantiles": (0.9, 0.5)}, {"quantiles": (0.5, 1.0), "quantile": 0.5}, {"quantile": 0.8}],
)
def test_bad_quantiles_are_refused_at_fit(kwargs):
    model = NeuralLength(**kwargs)  # scikit-learn's convention: __init__ only stores its arguments
    with pytest.raises(ValueError, match="quantile"):
        model.fit(None)  # the parameters are checked before the data is read


def _slice(tmp_path, instructions: int):
    from adapt.workloads import bundled

    with gzip.open(bundled("alpaca_eval_lengths.jsonl.gz"), "rt") as handle:
        rows = [json.loads(line) for line in handle]
    keep = set(sorted({r["instruction"] for r in rows})[:instructions])
    path = tmp_path / "slice.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows if r["instruction"] in keep))
    return path


@pytest.mark.slow
def test_fit_round_trip_and_tampering(tmp_path):
    from adapt.traces import load_trace, split_by_instruction

    train, test = split_by_instruction(load_trace(_slice(tmp_path, 120)), 0.3)
    model = NeuralLength(epochs=3).fit(train)
    metrics = model.evaluate(test)
    for g in (0, 50, 100, 200):
        assert 0.6 <= metrics[f"coverage_at_{g}"] <= 1.0
    assert metrics["pinball_0.5"] > metrics["pinball_0.95"] > 0  # the median's loss is the widest
    assert set(model.scales_) == {"0", "50", "100", "200", "400"}
    prompts = (["Write a haiku.", "Explain quantum computing in detail."], [6, 9], [0, 100])
    wide = model.predict_bound(prompts[1], prompts[0], prompts[2])
    median = model.predict_bound(prompts[1], prompts[0], prompts[2], quantile=0.5)
    assert (wide >= 1).all() and (median >= 1).all() and not np.allclose(median, wide)
    with pytest.raises(ValueError, match="not trained"):
        model.predict_bound([6], ["hi"], [0], quantile=0.7)
    directory = model.save(tmp_path / "component")
    assert (directory / "weights.safetensors").is_file()
    again = read_component(directory)
    assert np.allclose(again.predict_bound(prompts[1], prompts[0], prompts[2]), wide)
    # weights from another network shape must not load
    from safetensors.torch import save_file

    save_file({"body.0.weight": torch.zeros(2, 2)}, directory / "weights.safetensors")
    with pytest.raises(ComponentError, match="does not fit"):
        NeuralLength().load_state(directory)
    with pytest.raises(ComponentError, match="checksum mismatch"):
        read_component(directory)  # and the manifest notices the swap first


@pytest.mark.slow
def test_pipeline_logs_curves_in_the_version_run_and_skips_unchanged_data(tmp_path):
    from pipelines.neural_length import train_neural_length

    data = _slice(tmp_path, 80)
    registry = Registry(f"sqlite:///{tmp_path / 'n.db'}", cache_dir=tmp_path / "c")
    outcome = train_neural_length(registry, data, promote_if_better=True, epochs=3)
    assert outcome.version == 1 and outcome.promoted
    version = registry.versions("neural-length")[0]
    run = registry.client.get_run(version.run_id)
    history = registry.client.get_metric_history(version.run_id, "train_pinball")
    assert len(history) == 3  # one point per epoch, from Lightning's MLflow logger
    assert "val_pinball" in run.data.metrics and "coverage_error" in run.data.metrics
    assert run.data.params["epochs"] == "3"
    again = train_neural_length(registry, data, promote_if_better=True, epochs=3, skip_unchanged=True)
    assert again.version is None and len(registry.versions("neural-length")) == 1
    assert registry.load("neural-length").predict_bound([5], ["Say hi."], [0])[0] >= 1


def _fitted_with_random_network() -> NeuralLength:
    from predictors.embedding import DIMENSION

    model = NeuralLength(hidden=8)
    torch.manual_seed(0)
    net = QuantileNet(DIMENSION + 2, 8, 3).eval()
    model._serve({name: tensor.numpy().copy() for name, tensor in net.state_dict().items()})
    model.mean_, model.std_, model.scales_ = np.zeros(2), np.ones(2), {}
    return model


def test_quantiles_given_as_an_array_bound_and_save_as_the_same_tuple_does(tmp_path):
    """scikit-learn keeps a parameter as given, so `quantiles` may be an array, which has no
    `index`: its column was looked up with one, and training ended in an AttributeError."""
    from predictors.embedding import DIMENSION

    as_tuple = _fitted_with_random_network()
    as_array = _fitted_with_random_network().set_params(quantiles=np.array(as_tuple.quantiles))
    as_array.validate()
    rows = np.random.default_rng(0).standard_normal((4, DIMENSION + 2)).astype(np.float32)
    generated = [0, 0, 50, 200]
    for quantile in as_tuple.quantiles:
        np.testing.assert_array_equal(
            as_array._bounds(rows, generated, quantile), as_tuple._bounds(rows, generated, quantile)
        )
    assert read_component(as_array.save(tmp_path / "array")).quantiles == list(as_tuple.quantiles)


def test_validate_checks_the_network_without_embedding_a_prompt(monkeypatch):
    """Loading a version validates it in the loading process -- a live engine's -- where MiniLM
    must not run (issue 22): the canary goes through the network on a fixed vector instead."""
    import predictors.neural_length as module

    def no_embedding():
        raise AssertionError("validate embedded a prompt")

    model = _fitted_with_random_network()
    monkeypatch.setattr(module, "shared_cache", no_embedding)
    model.validate()
    model.scales_ = {str(p): float("nan") for p in TRAIN_POINTS}  # a broken calibration is caught
    with pytest.raises(ComponentError, match="canary"):
        model.validate()


@pytest.mark.parametrize(
    ("prompt_tokens", "generated", "match"),
    [
        ([12, -5, 30], [0, 0, 0], "prompt_tokens"),  # a NaN bound before
        ([12, 1e300, 30], [0, 0, 0], "prompt_tokens"),  # 878 tokens before
        ([12, float("inf"), 30], [0, 0, 0], "prompt_tokens"),
        ([12, 20, 30], [0, -50, 0], "generated_tokens"),
        ([12, 20, 30], [0, 0], "generated_tokens: 2"),
    ],
)
def test_a_count_that_is_no_token_count_is_refused_before_any_prompt_is_embedded(
    monkeypatch, prompt_tokens, generated, match
):
    import predictors.neural_length as module

    def no_embedding():
        raise AssertionError("a prompt was embedded before the counts were checked")

    monkeypatch.setattr(module, "shared_cache", no_embedding)
    with pytest.raises(ValueError, match=match):
        _fitted_with_random_network().predict_bound(prompt_tokens, ["a", "b", "c"], generated)


def test_a_version_saved_by_torch_loads_and_predicts_as_torch(tmp_path):
    """Versions registered before serving moved to numpy hold a file torch wrote: it must load
    and give torch's outputs."""
    from safetensors.torch import save_file

    from predictors.embedding import DIMENSION

    model = _fitted_with_random_network()
    model.save_state(tmp_path)  # scaling.json (and a numpy-written weights file, replaced next)
    torch.manual_seed(1)
    net = QuantileNet(DIMENSION + 2, 8, 3).eval()
    save_file(
        {name: tensor.contiguous() for name, tensor in net.state_dict().items()},
        tmp_path / "weights.safetensors",
    )
    loaded = NeuralLength(hidden=8)
    loaded.load_state(tmp_path)
    loaded.validate()
    rows = np.random.default_rng(0).standard_normal((50, DIMENSION + 2)).astype(np.float32)
    with torch.inference_mode():
        expected = np.expm1(np.clip(net(torch.from_numpy(rows)).numpy(), 0.0, 12.0))
    np.testing.assert_allclose(loaded._raw_quantiles(rows), expected, rtol=1e-5)
