"""Helpers for tests and benchmarks that need real multi-process set-ups."""
