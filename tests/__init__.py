"""The test suite; a package so that its harness imports as ``tests.support`` from the repository root."""
