"""GPU tests: skipped, with the reason, where no CUDA device is present."""

import pytest


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "tests/gpu/" in str(item.fspath):
            item.add_marker(skip)
