"""Scheduling policies (engine-agnostic) and the adapters that run them inside serving engines."""
