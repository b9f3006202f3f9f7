"""CPU weight sync through Ray's object store: no shared filesystem between any two nodes.

    sync = ObjectStoreWeightSync(cfg.sync, run_state=run_state, run="demo", learner=group)
    location = sync.location_for(3)       # WeightsObject("demo", 3): a name, not a file
    group.export_to_object(location)      # rank 0 returns the weights as a Ray object
    sync.publish_file(location, 3)        # announce, have every generator apply it, wait

One object per version, owned by the driver (it is rank 0's task return, so it never
passes through the driver's memory): a ``TensorPacket``, the tensors' bytes as arrays Ray
stores out of band, so the put is one copy and nothing builds a file on the learner. The
run's named ``WeightStore`` actor holds the refs of the newest two versions, so a generator
still fetching the previous one finds it; older ones are dropped and Ray frees them. A
generator (a Ray actor, or an elastic one attached to the cluster) asks the store for the
version Redis announces, ``ray.get``s it (Ray pulls it to that node once; other generators
there read the same copy), writes its bytes into a /dev/shm file of its own node (reusing a
parked file's pages where it can) and loads it as it would a shm-published file
(``fetch``/``discard``).
The model directory, when it is a local path of the driver's host, travels the same way
(``asyncrl.sync.model_ship``) and the store hands it to elastic generators.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, replace
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


@dataclass(frozen=True)
class TensorPacket:
    """A state dict as one Ray object with no copy of its own: each tensor's bytes as a flat
    uint8 array, which Ray's pickle (protocol 5) hands to the object store out of band, so a
    put is one copy into shared memory and a get on another node is the transfer alone (the
    arrays come back as read-only views of that node's object store)."""

    names: tuple[str, ...]
    dtypes: tuple[str, ...]
    """safetensors dtype codes (F32, BF16, ...), one per tensor."""
    shapes: tuple[tuple[int, ...], ...]
    arrays: tuple[np.ndarray, ...]

    @property
    def nbytes(self) -> int:
        return sum(int(a.nbytes) for a in self.arrays)

    def header(self) -> bytes:
        """The safetensors file's first bytes (length + JSON header, padded so the data is 8-byte
        aligned); the arrays' bytes follow in order."""
        meta: dict[str, dict[str, Any]] = {}
        offset = 0
        for name, dtype, shape, a in zip(self.names, self.dtypes, self.shapes, self.arrays, strict=True):
            meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + int(a.nbytes)]}
            offset += int(a.nbytes)
        head = json.dumps(meta, separators=(",", ":")).encode()
        head += b" " * (-len(head) % 8)
        return struct.pack("<Q", len(head)) + head


def weights_packet(state_dict: dict) -> TensorPacket:
    """``state_dict`` as a TensorPacket of views of its tensors (no copy here: the put copies once).

    The views alias the tensors: put the packet (or return it from a task) before they change."""
    import torch

    if sys.byteorder != "little":
        raise RuntimeError("weights are shipped as little-endian safetensors bytes: little-endian hosts only")
    names, dtypes, shapes, arrays = [], [], [], []
    for name, t in state_dict.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"state_dict[{name!r}] is a {type(t).__name__}, expected a torch.Tensor")
        dtype = SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise TypeError(f"state_dict[{name!r}] has dtype {t.dtype}; supported: {sorted(SAFETENSORS_DTYPES)}")
        t = t.detach().to("cpu").contiguous()
        names.append(name)
        dtypes.append(dtype)
        shapes.append(tuple(t.shape))
        arrays.append(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else np.empty(0, dtype=np.uint8))
    return TensorPacket(tuple(names), tuple(dtypes), tuple(shapes), tuple(arrays))


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


SPARES = 2
"""Fetched files a generator parks for reuse. Writing into a tmpfs file's existing pages costs
a third of writing a new file (measured: 9 vs 30 ms for 60 MiB, the rest is page allocation).
Two, because the newest is usually the engine's kept copy of its last good weights (a hard
link) until the next load replaces it; an inode another name still links is never rewritten."""


def spare_paths(shm_dir: str, tag: str) -> list[str]:
    return [os.path.join(shm_dir, f".asyncrl-fetched-{tag}-spare{i}.safetensors") for i in range(SPARES)]


def _take_spare(shm_dir: str, tag: str, dest: str) -> bool:
    """Move a parked file that nothing else links to ``dest`` (replacing it); whether one was."""
    for spare in spare_paths(shm_dir, tag):
        try:
            # Once a parked inode is linked by its spare name alone it stays so (the engine only
            # links files it was handed, never a spare), so the check cannot go stale before the
            # rename; of two fetches at once, one rename wins and the other looks further.
            if os.stat(spare).st_nlink != 1:
                continue
            os.rename(spare, dest)
            return True
        except FileNotFoundError:
            continue
    return False


def fetch(location: WeightLocation, version: int, shm_dir: str, tag: str) -> str:
    """Generator side: the weights at ``location`` as a local safetensors file; returns its path.

    A file's path is returned as it is. An object is pulled to this node once (Ray stores it
    there; its arrays are views of that copy) and its bytes written straight into a file the
    engine's workers map: they run in their own processes, and a /dev/shm file is the one
    memory they share with this one (and what the engine keeps as its last good weights).
    OSError (which the generator reports as a failed load, with this message) if this process
    cannot reach the run's Ray cluster."""
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
    packet = ray.get(ref[0], timeout=300)
    if not isinstance(packet, TensorPacket):
        raise OSError(f"weights v{version}: the run's weight store holds a {type(packet).__name__}, not a TensorPacket")
    return write_packet(packet, shm_dir, tag, version)


def write_packet(packet: TensorPacket, shm_dir: str, tag: str, version: int) -> str:
    """``packet`` as a safetensors file in ``shm_dir``, in a parked file's pages where one is free."""
    # A unique name per fetch: the trainer's push and the heartbeat's poll may fetch one
    # version at once, and neither may delete or replace the file the other is loading.
    fd, path = tempfile.mkstemp(prefix=f".asyncrl-fetched-{tag}-v{version}-", suffix=".safetensors", dir=shm_dir)
    os.close(fd)
    try:
        _take_spare(shm_dir, tag, path)
        with open(path, "r+b") as f:
            f.write(packet.header())
            for a in packet.arrays:
                f.write(a.data)
            f.truncate()
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        raise
    return path


def discard(path: str | None, location: WeightLocation, tag: str) -> None:
    """Park what ``fetch`` wrote, if it wrote anything, for a later fetch to rewrite (the engine
    hard-linked what it keeps, so that inode is skipped until the engine lets it go)."""
    if path is None or not isinstance(location, WeightsObject):
        return
    spares = spare_paths(os.path.dirname(path), tag)
    empty = [s for s in spares if not os.path.exists(s)]
    with contextlib.suppress(FileNotFoundError):
        os.replace(path, empty[0] if empty else spares[0])


def drop_spares(shm_dir: str, tag: str) -> None:
    """Delete the parked files (the generator is stopping)."""
    for spare in spare_paths(shm_dir, tag):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(spare)


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
        packet = weights_packet(state_dict)
        ref = ray.put(packet)
        write_s = time.perf_counter() - t0
        result = self.publish_ref(self.location_for(version), ref, version)
        return replace(result, write_s=write_s, bytes=packet.nbytes, seconds=time.perf_counter() - t0)

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
