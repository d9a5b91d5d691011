"""Learned components: scikit-learn-style estimators wrapped as versioned LearnedComponents."""
