"""Learned components: scikit-learn-style estimators that are also versioned LearnedComponents.

Importing this package registers each component's class under its registry name, lazily: the
modules (and their heavy dependencies) load only when a component of that name is read.
"""

from adapt.component import register_component


def _cost_model():
    from predictors.cost_model import FittedCostModel

    return FittedCostModel


register_component("cost-model", _cost_model)


def _slai_offset():
    from predictors.slai_offset import SlaiOffset

    return SlaiOffset


register_component("slai-offset", _slai_offset)


def _ewsjf_meta():
    from predictors.ewsjf_meta import EwsjfMetaPolicy

    return EwsjfMetaPolicy


register_component("ewsjf-meta-policy", _ewsjf_meta)


def _semantic_history():
    from predictors.semantic_history import SemanticHistory

    return SemanticHistory


register_component("semantic-history", _semantic_history)


def _qrf_length():
    from predictors.qrf_length import QrfLength

    return QrfLength


register_component("qrf-length", _qrf_length)


def _pattern_graph():
    from predictors.pattern_graph import PatternGraph

    return PatternGraph


register_component("pattern-graph", _pattern_graph)


def _neural_length():
    from predictors.neural_length import NeuralLength

    return NeuralLength


register_component("neural-length", _neural_length)
