"""The MLflow pyfunc wrapper of every component, logged as code ("models from code"), not pickled.

`mlflow.pyfunc.load_model("models:/qrf-length@champion")` loads the component directory with the
same verified, pickle-free reader the hot-swap path uses, and `predict` hands the input to the
component's own `predict` when it has one (by column name when that takes several inputs). The
serving path does not go through pyfunc at all (`adapt.registry.Registry.load`); this wrapper
exists so MLflow's UI, registry and tools see every component as a model.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlflow
from mlflow.pyfunc import PythonModel


class ComponentModel(PythonModel):
    def load_context(self, context) -> None:
        from adapt.component import read_component

        self.component = read_component(Path(context.artifacts["component"]))

    def predict(self, context, model_input, params=None):
        """The component's `predict` on `model_input`: passed whole to a `predict` of one input
        (cost-model: step-log columns); to one of several, one column per argument, by name
        (semantic-history: `prompt_tokens` and `texts`), as an MLflow user gives a DataFrame."""
        predict = getattr(self.component, "predict", None)
        if predict is None:
            raise TypeError(f"{self.component.name} has no predict(); use adapt.registry.Registry.load")
        names = _input_names(predict)
        if len(names) == 1:
            return predict(model_input)
        missing = [name for name in names if name not in model_input]
        if missing:
            raise ValueError(
                f"{self.component.name}: predict takes {', '.join(names)}; give model_input a column"
                f" for each (missing: {', '.join(missing)})"
            )
        return predict(**{name: list(model_input[name]) for name in names})


def _input_names(predict: Callable[..., Any]) -> list[str]:
    """The arguments `predict` cannot do without, in order."""
    return [
        p.name
        for p in inspect.signature(predict).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]


mlflow.models.set_model(ComponentModel())
