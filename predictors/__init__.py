"""Learned components: scikit-learn-style estimators that are also versioned LearnedComponents.

Each is registered under its registry name by an entry point in pyproject.toml
(`[project.entry-points."adapt.components"]`), so the core can read a version without importing
this package; its module (and heavy dependencies such as FAISS or torch) loads only when needed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from adapt.component import LearnedComponent


def require_fitted(component: LearnedComponent, attribute: str) -> None:
    """Raise `predictors.not_fitted.ComponentNotFitted` unless `component` has the fitted
    `attribute`. That module is imported only here, as it raises: it imports scikit-learn."""
    if not hasattr(component, attribute):
        from predictors.not_fitted import ComponentNotFitted

        raise ComponentNotFitted(f"{component.name}: not fitted (fit it, or load a saved version)")
