"""CPU weight sync through Ray's object store: no shared filesystem between any two nodes.

    sync = ObjectStoreWeightSync(cfg.sync, run_state=run_state, run="demo", learner=group)
    location = sync.location_for(3)       # WeightsObject("demo", 3): a name, not a file
    group.export_to_object(location)      # rank 0 returns the safetensors bytes as a Ray object
    sync.publish_file(location, 3)        # announce, have every generator apply it, wait

One object per version, owned by the driver (it is rank 0's task return, so it never
passes through the driver's memory). The run's named ``WeightStore`` actor holds the
refs of the newest two versions, so a generator still fetching the previous one finds it;
older ones are dropped and Ray frees them. A generator (a Ray actor, or an elastic one
attached to the cluster) asks the store for the version Redis announces, ``ray.get``s it
(Ray pulls it to that node once; other generators there read the same copy), writes it to
its own node's /dev/shm and loads it as it would a shm-published file (``fetch``/``discard``).
The model directory, when it is a local path of the driver's host, travels the same way
(``asyncrl.sync.model_ship``) and the store hands it to elastic generators.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import tempfile
import time
from dataclasses import replace
from typing import Any

import numpy as np

from asyncrl.config import SyncConfig
from asyncrl.sync.shm import SAFETENSORS_DTYPES, call_engines
from asyncrl.sync.weight_sync import ExportHolder, PublishResult, WeightAnnouncer, engine_errors
from asyncrl.types import WeightLocation, WeightsFile, WeightsObject

log = logging.getLogger(__name__)

NAMESPACE = "asyncrl"
KEEP_VERSIONS = 2


def store_name(run: str) -> str:
    return f"asyncrl-weights-{run}"


def safetensors_blob(state_dict: dict) -> np.ndarray:
    """The safetensors file of ``state_dict`` as one uint8 array (zero-copy through Ray)."""
    import torch

    header: dict[str, dict[str, Any]] = {}
    offset = 0
    parts: list[tuple[int, torch.Tensor]] = []
    for name, t in state_dict.items():
        t = t.detach().to("cpu").contiguous()
        dtype = SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise TypeError(f"state_dict[{name!r}] has dtype {t.dtype}; supported: {sorted(SAFETENSORS_DTYPES)}")
        size = t.numel() * t.element_size()
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + size]}
        parts.append((offset, t))
        offset += size
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    start = 8 + len(head)
    out = np.empty(start + offset, dtype=np.uint8)
    out[:8] = np.frombuffer(struct.pack("<Q", len(head)), dtype=np.uint8)
    out[8:start] = np.frombuffer(head, dtype=np.uint8)
    for off, t in parts:
        if t.numel():
            out[start + off : start + off + t.numel() * t.element_size()] = t.reshape(-1).view(torch.uint8).numpy()
    return out


class WeightStore:
    """Named Ray actor of one run: holds the refs of the newest versions and the model package."""

    def __init__(self) -> None:
        self.versions: dict[int, list] = {}
        self.model_package: dict | None = None

    def put(self, version: int, ref: list) -> None:
        self.versions[version] = ref  # a list, so Ray hands us the ref, not the bytes
        for old in sorted(self.versions)[:-KEEP_VERSIONS]:
            del self.versions[old]

    def get(self, version: int) -> list | None:
        return self.versions.get(version)

    def set_model(self, package: dict | None) -> None:
        self.model_package = package

    def model(self) -> dict | None:
        return self.model_package


def open_store(run: str, create: bool = False) -> Any:
    import ray

    if create:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        # On the trainer's node: the store then shares the trainer's fate, not a generator host's.
        here = NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=True)
        return (
            ray.remote(WeightStore)
            .options(
                name=store_name(run), namespace=NAMESPACE, num_cpus=0, get_if_exists=True, scheduling_strategy=here
            )
            .remote()
        )
    return ray.get_actor(store_name(run), namespace=NAMESPACE)


def fetch(location: WeightLocation, version: int, shm_dir: str, tag: str) -> str:
    """Generator side: the weights at ``location`` as a local safetensors file; returns its path.

    A file's path is returned as it is. OSError (which the generator reports as a failed load,
    with this message) if this process cannot reach the run's Ray cluster."""
    if isinstance(location, WeightsFile):
        return location.path
    import ray

    if not ray.is_initialized():
        raise OSError(
            f"weights v{version} are in the job's Ray object store ({location}) and this generator "
            f"is not attached to its Ray cluster: start it with --ray-address ray://HEAD:10001"
        )
    try:
        ref = ray.get(open_store(location.run).get.remote(version), timeout=60)
    except Exception as e:  # any Ray failure is a failed load with its reason
        raise OSError(f"weights v{version}: the run's weight store is unreachable: {e}") from e
    if ref is None:
        raise OSError(
            f"weights v{version} are no longer held by the run's weight store (a newer version replaced them)"
        )
    blob = ray.get(ref[0], timeout=300)
    # A unique name per fetch: the trainer's push and the heartbeat's poll may fetch one
    # version at once, and neither may delete or replace the file the other is loading.
    fd, path = tempfile.mkstemp(prefix=f".asyncrl-fetched-{tag}-v{version}-", suffix=".safetensors", dir=shm_dir)
    with os.fdopen(fd, "wb") as f:
        f.write(memoryview(blob))
    return path


def discard(path: str | None, location: WeightLocation) -> None:
    """Delete what ``fetch`` wrote, if it wrote anything (the engine hard-linked what it keeps)."""
    if path is not None and isinstance(location, WeightsObject):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class ObjectStoreWeightSync:
    """Publishes each version as one Ray object; see the module docstring."""

    def __init__(
        self,
        cfg: SyncConfig,
        *,
        run_state: WeightAnnouncer | None = None,
        run: str,
        engines: list | None = None,
        learner: ExportHolder | None = None,
        model_package: dict | None = None,
    ):
        self.cfg, self.run_state, self.run, self.learner = cfg, run_state, run, learner
        self.engines: list = list(engines or [])
        self.version: int | None = None
        self.store = open_store(run, create=True)
        self.store.set_model.remote(model_package)

    def register(self, handle: Any) -> None:
        self.engines.append(handle)

    def unregister(self, handle: Any) -> None:
        self.engines = [h for h in self.engines if h is not handle]

    def location_for(self, version: int) -> WeightsObject:
        return WeightsObject(self.run, version)

    def publish(self, state_dict: dict, version: int) -> PublishResult:
        import ray

        t0 = time.perf_counter()
        blob = safetensors_blob(state_dict)
        ref = ray.put(blob)
        write_s = time.perf_counter() - t0
        result = self.publish_ref(self.location_for(version), ref, version)
        return replace(result, write_s=write_s, bytes=int(blob.nbytes), seconds=time.perf_counter() - t0)

    def publish_file(self, location: WeightLocation, version: int) -> PublishResult:
        """Announce the object the learner exported to ``location`` and wait until generators run it."""
        if not isinstance(location, WeightsObject):
            raise ValueError(f"{location}: sync.backend=object_store publishes object-store names, not files")
        ref = self.learner.take_export(location) if self.learner is not None else None
        if ref is None:
            raise FileNotFoundError(
                f"no exported weights under {location}: call learner.export_to_object({location!r}) first"
            )
        return self.publish_ref(location, ref, version)

    def publish_ref(self, location: WeightsObject, ref: Any, version: int) -> PublishResult:
        import ray

        if self.version is not None and version <= self.version:
            raise ValueError(f"version {version} is not newer than the published version {self.version}")
        start = time.perf_counter()
        ray.get(self.store.put.remote(version, [ref]))
        if self.run_state is not None:
            self.run_state.set_weights(location, version)
        results = call_engines(self.engines, "update_weights", location, version)
        errors = engine_errors(results)
        if errors:
            log.warning("weights v%d: %d generator(s) failed to load: %s", version, len(errors), errors)
        self.version = version
        return PublishResult.of_apply(version, start, len(self.engines), results, errors)

    def close(self) -> None:
        import ray

        with contextlib.suppress(Exception):
            ray.kill(self.store)
