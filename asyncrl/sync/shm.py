"""CPU weight sync through shared memory: a safetensors file in /dev/shm, loaded in place.

    sync = ShmWeightSync(cfg.sync, run_state=run_state, run="demo")
    sync.register(generator_handle)                 # Ray actor handle or in-process GeneratorActor
    result = sync.publish(model.state_dict(), version=3)     # a PublishResult (sync/weight_sync.py)
    # or, when the learner writes the file itself:  sync.publish_file(sync.location_for(3), 3)

publish: write /dev/shm/asyncrl-{run}-v{version}.safetensors (temp name + rename, so a
reader never sees half a file), record (location, version) in Redis for generators that
poll (elastic ones), then ask every registered generator to apply it in flight
(``update_weights``: pause keep, load, label version, drop stale KV, resume) and wait.
Files of older versions are deleted once every registered generator runs the new one.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
import os
import struct
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

from asyncrl.config import SyncConfig
from asyncrl.sync.weight_sync import PublishResult, WeightAnnouncer, engine_errors
from asyncrl.types import WeightLocation, WeightsFile

log = logging.getLogger(__name__)


def call_engines(handles: list, method: str, *args: Any) -> list:
    """Call ``method`` on every generator at once (Ray handles in parallel) and return the results
    in order; an exception is returned in place of the result of the generator that raised."""
    import ray

    results: list = [None] * len(handles)
    pending: dict[int, Any] = {}
    for i, h in enumerate(handles):
        fn = getattr(h, method)
        if hasattr(fn, "remote"):
            pending[i] = fn.remote(*args)
        else:
            try:
                results[i] = fn(*args)
            except Exception as e:
                results[i] = e
    for i, ref in pending.items():
        try:
            results[i] = ray.get(ref)
        except Exception as e:
            results[i] = e
    return results


SAFETENSORS_DTYPES = {
    "float64": "F64",
    "float32": "F32",
    "float16": "F16",
    "bfloat16": "BF16",
    "int64": "I64",
    "int32": "I32",
    "int16": "I16",
    "int8": "I8",
    "uint8": "U8",
    "bool": "BOOL",
}


def temp_beside(path: str) -> tuple[int, str]:
    """A new file next to ``path`` (same filesystem, so ``os.replace`` onto it is atomic): an
    open fd and its name. mkstemp creates it O_EXCL, mode 0600, under an unguessable name:
    /dev/shm is world-writable, and at a predictable name another user could plant a symlink
    that we would write through (or a file they could read the weights from)."""
    directory, name = os.path.split(path)
    return tempfile.mkstemp(prefix=f"{name}.tmp-", dir=directory or ".")


def save_state_dict(state_dict: dict, path: str) -> int:
    """Write tensors to ``path`` atomically as safetensors (CPU, contiguous); return the bytes written.

    The format (https://github.com/huggingface/safetensors, "Format"): an 8-byte little-endian
    header length, a JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}}
    padded with spaces, then the raw little-endian bytes. Written straight from each
    tensor's memory: ``safetensors.torch.save_file`` first copies everything into one
    buffer, which costs a third of a publish for a 60 MB model.
    """
    import torch

    if sys.byteorder != "little":
        raise RuntimeError("save_state_dict writes little-endian safetensors on little-endian hosts only")
    tensors: dict[str, torch.Tensor] = {}
    header: dict[str, dict[str, Any]] = {}
    offset = 0
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, expected a torch.Tensor")
        dtype = SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise TypeError(f"state_dict[{name!r}] has dtype {t.dtype}; supported: {sorted(SAFETENSORS_DTYPES)}")
        t = t.detach().to("cpu").contiguous()
        size = t.numel() * t.element_size()
        tensors[name] = t
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned
    fd, tmp = temp_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for t in tensors.values():
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy().data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)  # a partial file only holds the space the next attempt needs
        raise
    return 8 + len(blob) + offset


def file_of(location: WeightLocation) -> WeightsFile:
    """``location``, which must be a file: the file backends publish nothing else."""
    if not isinstance(location, WeightsFile):
        raise ValueError(f"{location}: sync.backend shm and nccl publish files, not object-store names")
    return location


class ShmWeightSync:
    """Publishes weight files to /dev/shm and has the registered generators load them."""

    def __init__(
        self, cfg: SyncConfig, *, run_state: WeightAnnouncer | None = None, run: str, engines: list | None = None
    ):
        if not os.path.isdir(cfg.shm_dir):
            raise ValueError(f"sync.shm_dir={cfg.shm_dir!r}: not a directory")
        self.cfg, self.run_state, self.run = cfg, run_state, run
        self.engines: list = list(engines or [])
        self.version: int | None = None

    def register(self, handle: Any) -> None:
        self.engines.append(handle)

    def unregister(self, handle: Any) -> None:
        self.engines = [h for h in self.engines if h is not handle]

    def location_for(self, version: int) -> WeightsFile:
        return WeightsFile(os.path.join(self.cfg.shm_dir, f"asyncrl-{self.run}-v{version}.safetensors"))

    def publish(self, state_dict: dict, version: int) -> PublishResult:
        """Write ``state_dict`` as ``version`` and apply it on every generator."""
        t0 = time.perf_counter()
        location = self.location_for(version)
        nbytes = save_state_dict(state_dict, location.path)
        write_s = time.perf_counter() - t0
        result = self.publish_file(location, version)
        return replace(result, write_s=write_s, bytes=nbytes, seconds=time.perf_counter() - t0)

    def publish_file(self, location: WeightLocation, version: int) -> PublishResult:
        """Announce an already written file as ``version`` and wait until the generators run it."""
        path = file_of(location).path
        if not os.path.exists(path):
            raise FileNotFoundError(f"weights file {path} does not exist")
        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} is not newer than the published version {self.version}")
        start = time.perf_counter()
        if self.run_state is not None:
            self.run_state.set_weights(location, version)
        results = call_engines(self.engines, "update_weights", location, version)
        errors = engine_errors(results)
        if errors:
            log.warning("weights v%d: %d generator(s) failed to load: %s", version, len(errors), errors)
        self.version = version
        if not errors:
            self._delete_older(version)
        return PublishResult.of_apply(version, start, len(self.engines), results, errors)

    def _delete_older(self, version: int) -> None:
        for old in glob.glob(os.path.join(self.cfg.shm_dir, f"asyncrl-{self.run}-v*.safetensors")):
            tail = old.rsplit("-v", 1)[1].split(".", 1)[0]
            if tail.isdigit() and int(tail) < version:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(old)

    def close(self) -> None:
        """Delete this run's weight files (the generators have loaded them into memory)."""
        for path in glob.glob(os.path.join(self.cfg.shm_dir, f"asyncrl-{self.run}-v*.safetensors*")):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
