"""Learned components: scikit-learn-style estimators that are also versioned LearnedComponents.

Each is registered under its registry name by an entry point in pyproject.toml
(`[project.entry-points."adapt.components"]`), so the core can read a version without importing
this package; its module (and heavy dependencies such as FAISS or torch) loads only when needed.
"""
