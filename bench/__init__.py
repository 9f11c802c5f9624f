"""Benchmark harnesses of the shipped code paths; run from the repository root as ``python -m bench.<name>``."""
