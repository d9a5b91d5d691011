"""`ComponentNotFitted`: a predictor asked to predict, evaluate or save before `fit` (or a load).

It is both a `ComponentError`, which the registry and the pipelines catch, and scikit-learn's
`NotFittedError`, which scikit-learn's tools and anyone used to its estimator contract catch.
Subclassing the latter imports scikit-learn (~1.3 s), so no predictor imports this module at
module level: `predictors.require_fitted` imports it when it raises, and importing a predictor
costs a serving engine or a CLI command nothing more.
"""

from __future__ import annotations

from sklearn.exceptions import NotFittedError

from adapt.component import ComponentError


class ComponentNotFitted(ComponentError, NotFittedError):
    """Raised by `predictors.require_fitted` when the fitted state a call needs is missing."""
