"""Offline evaluation: the replay simulator, named workloads, experiment drivers and reports."""
