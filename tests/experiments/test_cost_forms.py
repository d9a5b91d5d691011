"""The GPU step-time experiment: its step model runs, its features are the engines', and the form
comparison tells the two roofline forms apart."""

from __future__ import annotations

import csv
from pathlib import Path

import numpy as np
import pytest

from adapt.replay.cost import ModelSpec, roofline
from adapt.steplog import STEP_FIELDS, StepBatch, step_batch
from experiments.cost_forms import compare_forms
from experiments.gpu_steps import BUNDLED_LOGS, SHAPE_COLUMNS, RandomLlama, Shape, default_shapes

TINY = ModelSpec("tiny", layers=2, hidden=64, heads=4, kv_heads=2, head_dim=16, intermediate=128, vocab=100)


@pytest.mark.parametrize(
    "shape", [Shape(16, 0, 0, 0), Shape(16, 32, 0, 0), Shape(0, 0, 4, 40), Shape(8, 20, 3, 50)]
)
def test_random_llama_runs_every_kind_of_step_and_samples_the_right_rows(shape: Shape) -> None:
    torch = pytest.importorskip("torch")
    model = RandomLlama(TINY, "cpu", torch.float32, pool_tokens=1000)
    logits = model.step(shape)()
    assert logits.shape == (shape.decodes + (1 if shape.prefill_tokens else 0), TINY.vocab)
    assert torch.isfinite(logits).all()


def test_a_mixed_shape_has_the_features_both_engines_compute() -> None:
    # 8 tokens after 20 cached: attention units 8 * 20 + 8 * 9 / 2 = 196; 3 decodes of 50 context.
    row = step_batch(Shape(8, 20, 3, 50).work()).as_row()
    assert row == {
        "tokens": 11.0,
        "sampled": 4.0,
        "prefill_attn_units": 196.0,
        "prefill_kv_read": 20.0,
        "num_decodes": 3.0,
        "decode_ctx_sum": 150.0,
        "decode_ctx_max": 50.0,
    }


def test_default_shapes_fit_the_pool_and_cover_all_three_kinds() -> None:
    shapes = default_shapes(80_000)
    assert {s.kind for s in shapes} == {"prefill", "decode", "mixed"}
    assert all(
        s.prefill_cached + s.prefill_tokens + s.decodes * (s.decode_context + 1) <= 80_000 for s in shapes
    )


def _synthetic_log(path: Path, overlap: str, seed: int) -> Path:
    """A step log of the default shapes timed by the llama-2-7b/H100 roofline of one form, with 2%
    multiplicative noise: the comparison must recover the form that made it."""
    rng = np.random.default_rng(seed)
    cost = roofline("llama-2-7b", "h100-80g", overlap=overlap, step_overhead_s=0.0015)
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=[*SHAPE_COLUMNS, *STEP_FIELDS, "duration_s", "model"])
        writer.writeheader()
        for shape in default_shapes(80_000):
            features = step_batch(shape.work()).as_row()
            seconds = float(cost.time(StepBatch(**features))) * rng.lognormal(0.0, 0.02)
            writer.writerow(
                {
                    **{c: getattr(shape, c) for c in SHAPE_COLUMNS},
                    **features,
                    "duration_s": seconds,
                    "model": "llama-2-7b",
                }
            )
    return path


@pytest.mark.parametrize("overlap", ["step", "operator"])
def test_compare_recovers_the_form_that_generated_the_steps(tmp_path: Path, overlap: str) -> None:
    result = compare_forms(_synthetic_log(tmp_path / "steps.csv", overlap, seed=1))
    assert result["best_form"] == overlap
    assert result["forms"][f"roofline-{overlap}"]["mixed"]["mape"] < 0.03


def test_the_bundled_h100_logs_favour_the_operator_form() -> None:
    """The measured evidence behind the default `overlap` (adapt.replay.cost): on both bundled
    H100 logs the operator form predicts the unseen mixed steps better than the step form."""
    assert len(BUNDLED_LOGS) == 2
    for log in BUNDLED_LOGS:
        result = compare_forms(log)
        forms = result["forms"]
        assert result["best_form"] == "operator", log
        assert forms["roofline-operator"]["mixed"]["mape"] < forms["roofline-step"]["mixed"]["mape"]
        assert result["additivity"]["mixed_over_max_median"] > 1.1  # mixed steps do not overlap
