"""Every weight-sync backend, driven through the trainer's Publisher on CPU, keeps one contract.

.venv/bin/python -m pytest tests/integration/test_weight_sync_contract.py -q

A real 1-rank learner (whose model differs from the engine's) exports its weights; shm and
object_store hand them to a real vLLM-CPU engine as in a run. nccl runs the real
NcclWeightSync, GeneratorActor.transfer_* and the engine's vLLM weight-transfer lifecycle
(start, layer-wise receive, finish); only the wire is replaced at vLLM's boundary
(tests.support.loopback: a file instead of a CUDA broadcast). Every publish must return
a PublishResult, raise the policy version, and leave the engine sampling exactly the
learner's policy: its logprobs equal an HF forward of the learner's model. A transfer that
fails part-way (after start_weight_update, or in the worker) must leave the engine
unpaused, whole and on the new weights. The real NCCL transfer is covered by tests/gpu.
"""

from __future__ import annotations

import itertools
import os

import numpy as np
import pytest
import torch

from asyncrl.config import Config, RolloutConfig, SyncConfig
from asyncrl.rollout.tiny import SPECIAL_TOKENS, build_vocab
from asyncrl.types import WeightsFile

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

RUN = "contract"
TEMPERATURE = 0.7
NOT_SAMPLED = [build_vocab()[t] for t in SPECIAL_TOKENS if t != "<eos>"]
_versions = itertools.count(1)


@pytest.fixture(scope="module")
def learner_model_dir(tmp_path_factory) -> str:
    """Same architecture as the engine's tiny model, other weights: a publish is visible."""
    from asyncrl.rollout.tiny import write_tiny_model

    return str(write_tiny_model(tmp_path_factory.mktemp("learner-model"), seed=1))


@pytest.fixture(scope="module")
def learner(ray_session, learner_model_dir):
    from asyncrl.learner import LearnerGroup

    group = LearnerGroup(Config(), learner_model_dir, num_ranks=1, sample_special_tokens=False)  # the copy task's ban
    yield group
    group.shutdown()


@pytest.fixture(scope="module")
def learner_hf(learner_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(learner_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def shm_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("shm"))


@pytest.fixture(scope="module")
def gen(redis_server, tiny_model_dir, shm_dir):
    from asyncrl.rollout.generator import GeneratorActor
    from tests.support.loopback import LOOPBACK_ENGINE_KWARGS

    cfg = Config()
    cfg.rollout = RolloutConfig(
        env="copy",
        temperature=TEMPERATURE,
        max_tokens=8,
        engine_max_model_len=256,
        engine_max_num_seqs=8,
        engine_kwargs=LOOPBACK_ENGINE_KWARGS,  # the engine side of the nccl backend's stand-in wire
    )
    cfg.sync.shm_dir = shm_dir
    g = GeneratorActor(cfg, tiny_model_dir, "contract-0", redis_server.url, RUN, autostart=False)
    yield g
    g.shutdown()


@pytest.fixture
def run_state(redis_server):
    from asyncrl.queue import RunState

    rs = RunState.connect(redis_server.url, RUN)
    yield rs
    rs.close()


def max_logprob_diff(gen, model) -> float:
    diffs = []
    for prompt in ([5, 6, 7], [9, 8, 7, 6]):
        for c in gen.sample(prompt, 2, 8, TEMPERATURE, True):
            ids = torch.tensor([prompt + c["token_ids"]])
            with torch.no_grad():
                logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            logits[:, NOT_SAMPLED] = -torch.inf
            ref = torch.log_softmax(logits / TEMPERATURE, -1).gather(1, torch.tensor(c["token_ids"])[:, None])[:, 0]
            diffs.append(np.abs(np.asarray(c["logprobs"]) - ref.numpy()))
    return float(np.concatenate(diffs).max())


def reset_to_base(gen, tiny_model_dir) -> None:
    """Back to the engine's own weights (a newer version), so the next publish must change them."""
    gen.update_weights(WeightsFile(os.path.join(tiny_model_dir, "model.safetensors")), next(_versions))


def make_sync(backend: str, shm_dir: str, run_state, learner, gen, tmp_path):
    from asyncrl.sync.nccl import NcclWeightSync
    from asyncrl.sync.objstore import ObjectStoreWeightSync
    from asyncrl.sync.shm import ShmWeightSync
    from tests.support.loopback import LoopbackTransfer

    cfg = SyncConfig(backend=backend, shm_dir=shm_dir)
    if backend == "shm":
        sync = ShmWeightSync(cfg, run_state=run_state, run=RUN)
    elif backend == "object_store":
        sync = ObjectStoreWeightSync(cfg, run_state=run_state, run=RUN, learner=learner)
    else:
        sync = NcclWeightSync(cfg, run_state=run_state, run=RUN, transfer=LoopbackTransfer(str(tmp_path)))
    sync.register(gen)
    return sync


def assert_fetched_files_are_reused_safely(pub, gen, learner_hf, shm_dir) -> None:
    """A generator rewrites its parked fetched files in place (sync/objstore.py). That is safe
    only if the engine keeps none of a loaded file's pages: scribbling over every parked file
    no other name links must leave its sampling unchanged, and a publish into one still exact."""
    from asyncrl.sync.objstore import spare_paths

    pub.publish(next(_versions), overlap=False)  # the first publish's file is the engine's kept copy
    free = [p for p in spare_paths(shm_dir, gen.weights.tag) if os.path.exists(p) and os.stat(p).st_nlink == 1]
    assert free, os.listdir(shm_dir)
    for path in free:
        with open(path, "r+b") as f:
            f.write(b"\0" * os.path.getsize(path))
    assert max_logprob_diff(gen, learner_hf) < 1e-3
    inodes = {os.stat(p).st_ino for p in free}
    pub.publish(next(_versions), overlap=False)
    assert os.stat(gen.engine.last_good_path).st_ino in inodes  # it went into a parked file
    assert max_logprob_diff(gen, learner_hf) < 1e-3


@pytest.mark.parametrize("backend", ["shm", "object_store", "nccl"])
def test_every_backend_publishes_through_the_publisher(
    backend, ray_session, learner, learner_hf, gen, run_state, shm_dir, tiny_model_dir, tmp_path
):
    from asyncrl.control.publish import Publisher
    from asyncrl.control.state import LoopState
    from asyncrl.sync import PublishResult, WeightSync

    reset_to_base(gen, tiny_model_dir)
    assert max_logprob_diff(gen, learner_hf) > 0.1  # the engine runs other weights than the learner's
    sync = make_sync(backend, shm_dir, run_state, learner, gen, tmp_path)
    try:
        assert isinstance(sync, WeightSync)
        pub = Publisher(learner, sync, run_state, LoopState())
        version = next(_versions)
        pub.publish(version, overlap=False)
        result = pub.last_result
        assert isinstance(result, PublishResult)
        assert (result.version, result.engines, result.errors) == (version, 1, ())
        assert result.apply_s > 0 and result.seconds >= result.apply_s and pub.last_apply_s == result.apply_s
        assert run_state.policy_version() == version and gen.version() == version
        diff = max_logprob_diff(gen, learner_hf)
        print(f"{backend}: max |engine - learner logprob| after publish = {diff:.2e}")
        assert diff < 1e-3
        if backend == "nccl":
            assert sync.transfer.sent == 1 and result.fallbacks == 0  # it went through the transfer
            assert gen.engine.last_good_path is not None  # a later failed update can restore it
        if backend == "object_store":
            assert_fetched_files_are_reused_safely(pub, gen, learner_hf, shm_dir)
    finally:
        sync.close()


@pytest.mark.parametrize("where", ["trainer", "worker"])
def test_a_failed_transfer_leaves_the_engine_running_the_new_weights(
    where, ray_session, learner, learner_hf, gen, run_state, shm_dir, tiny_model_dir, tmp_path
):
    """A broadcast that dies after start_weight_update (layers on the meta device) or a worker
    that fails part-way: the engine is put back together, loads the file, and resumes; the next
    publish opens a new transfer group and goes through it again."""
    from asyncrl.control.publish import Publisher
    from asyncrl.control.state import LoopState

    sync = make_sync("nccl", shm_dir, run_state, learner, gen, tmp_path)
    try:
        pub = Publisher(learner, sync, run_state, LoopState())
        reset_to_base(gen, tiny_model_dir)
        sync.transfer.fail_next = where
        version = next(_versions)
        pub.publish(version, overlap=False)
        result = pub.last_result
        assert result is not None and (result.errors, result.fallbacks) == ((), 1)
        assert gen.version() == version and gen.stats()["weights_blocked"] is None
        assert max_logprob_diff(gen, learner_hf) < 1e-3  # sampling works: not paused, no meta tensors
        assert sync.transfer.closed == 1  # the failed group was torn down

        reset_to_base(gen, tiny_model_dir)
        version = next(_versions)
        pub.publish(version, overlap=False)
        assert pub.last_result is not None and pub.last_result.fallbacks == 0
        assert sync.transfer.opened == 2 and sync.transfer.sent == 1
        assert gen.version() == version and max_logprob_diff(gen, learner_hf) < 1e-3
    finally:
        sync.close()
