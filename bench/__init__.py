"""Benchmarks (scripts: run them as `python bench/NAME.py` or `asyncrl bench NAME`); a package
so that `bench.jsonout` and `bench.simulate` resolve here, not to another `bench` on the path."""
