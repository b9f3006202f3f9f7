"""Harnesses for tests and benchmarks that need real multi-process set-ups.

Test code, not part of the installed package: it imports as ``tests.support`` with the
repository root on the import path (pytest's ``pythonpath`` setting; Ray workers of a test
session get the driver's working directory, the root, on theirs).
"""
