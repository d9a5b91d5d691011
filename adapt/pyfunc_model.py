"""The MLflow pyfunc wrapper of every component, logged as code ("models from code"), not pickled.

`mlflow.pyfunc.load_model("models:/qrf-length@champion")` loads the component directory with the
same verified, pickle-free reader the hot-swap path uses, and `predict` hands the input to the
component's own `predict` when it has one. The serving path does not go through pyfunc at all
(`adapt.registry.Registry.load`); this wrapper exists so MLflow's UI, registry and tools see
every component as a model.
"""

from __future__ import annotations

from pathlib import Path

import mlflow
from mlflow.pyfunc import PythonModel


class ComponentModel(PythonModel):
    def load_context(self, context) -> None:
        from adapt.component import read_component

        self.component = read_component(Path(context.artifacts["component"]))

    def predict(self, context, model_input, params=None):
        predict = getattr(self.component, "predict", None)
        if predict is None:
            raise TypeError(f"{self.component.name} has no predict(); use adapt.registry.Registry.load")
        return predict(model_input)


mlflow.models.set_model(ComponentModel())
