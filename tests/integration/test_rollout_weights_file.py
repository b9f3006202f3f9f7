"""The /dev/shm weight file: ``save_state_dict`` writes safetensors the reference reader loads exactly.

.venv/bin/python -m pytest tests/integration/test_rollout_weights_file.py -q
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from asyncrl.sync.shm import save_state_dict


def test_written_file_reads_back_exactly_with_safetensors(tmp_path):
    g = torch.Generator().manual_seed(0)
    state = {
        "w": torch.randn(3, 5, generator=g),
        "half": torch.randn(4, generator=g).to(torch.bfloat16),
        "t": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "step": torch.tensor(7, dtype=torch.int64),  # 0-dim
        "mask": torch.tensor([True, False, True]),
        "empty": torch.zeros(0, 3),
    }
    path = str(tmp_path / "w.safetensors")
    n = save_state_dict(state, path)
    assert n == os.path.getsize(path)
    # 15*4 + 4*2 + 24*4 + 8 + 3 + 0 data bytes after the 8-byte length and the padded header
    data = Path(path).read_bytes()
    (header_len,) = struct.unpack("<Q", data[:8])
    assert header_len % 8 == 0 and n == 8 + header_len + 60 + 8 + 96 + 8 + 3
    header = json.loads(data[8 : 8 + header_len])
    assert header["half"]["dtype"] == "BF16" and header["t"]["shape"] == [6, 4]
    with safe_open(path, framework="pt") as f:
        assert set(f.keys()) == set(state)
        for name, t in state.items():
            back = f.get_tensor(name)
            assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t), name
    assert not [p for p in os.listdir(tmp_path) if ".tmp-" in p]  # written under a temp name, then renamed


def test_bad_entries_are_named(tmp_path):
    with pytest.raises(TypeError, match=r"state_dict\['x'\] is a list"):
        save_state_dict({"x": [1.0]}, str(tmp_path / "a"))
    with pytest.raises(TypeError, match=r"state_dict\['c'\] has dtype torch.complex128"):
        save_state_dict({"c": torch.zeros(2, dtype=torch.complex128)}, str(tmp_path / "b"))
