"""Iteration-level replay of a vLLM-like engine: engine model, KV pool, cost models, metrics."""
