"""The host-independent pieces of multi-node runs: config keys, the in-memory safetensors
blob, the weight store's retention, ray.init arguments and the model manifest."""

from __future__ import annotations

import pytest
import torch

from asyncrl.config import ConfigError, ControlConfig, load_config


def test_placement_keys_are_validated_naming_the_field():
    cfg = load_config(None, ["rollout.resources={gen: 1}", "learner.resources.train=2", "learner.placement=SPREAD"])
    assert cfg.rollout.resources == {"gen": 1} and cfg.learner.resources == {"train": 2}
    with pytest.raises(ConfigError, match=r"learner.placement='ANYWHERE': must be one of 'PACK'"):
        load_config(None, ["learner.placement=ANYWHERE"])
    with pytest.raises(ConfigError, match=r"rollout.resources.gen=0"):
        load_config(None, ["rollout.resources={gen: 0}"])
    with pytest.raises(ConfigError, match=r"learner.resources.CPU=.*cpus_per_"):
        load_config(None, ["learner.resources={CPU: 2}"])
    assert load_config(None, ["sync.backend=object_store"]).sync.backend == "object_store"


def test_unset_ray_address_is_a_private_instance_and_a_set_one_gets_no_resource_arguments():
    from asyncrl.control.cluster import ray_init_kwargs

    private = ray_init_kwargs(ControlConfig())
    assert private["address"] == "local" and private["num_cpus"] >= 8
    assert ray_init_kwargs(ControlConfig(ray_address="auto")) == {"address": "auto"}
    assert ray_init_kwargs(ControlConfig(ray_address="10.0.0.1:6379")) == {"address": "10.0.0.1:6379"}


def test_safetensors_blob_is_the_file_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.sync.objstore import safetensors_blob

    state = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.zeros(0),
        "d": torch.randn(4, 4).to(torch.bfloat16).t(),
    }  # non-contiguous
    path = tmp_path / "w.safetensors"
    path.write_bytes(safetensors_blob(state).tobytes())
    back = load_file(str(path))
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v.contiguous()), k


def test_weight_store_keeps_the_newest_two_versions():
    from asyncrl.sync.objstore import KEEP_VERSIONS, WeightStore

    store = WeightStore()
    for v in range(1, 6):
        store.put(v, [f"ref{v}"])
    assert KEEP_VERSIONS == 2 and sorted(store.versions) == [4, 5]
    assert store.get(3) is None and store.get(5) == ["ref5"]


def test_a_model_path_holding_the_same_files_is_used_as_it_is(tmp_path):
    from asyncrl.sync.model_ship import local_model, manifest

    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    package = {"path": str(tmp_path / "m"), "manifest": manifest(tmp_path / "m"), "ref": [None]}
    assert local_model(str(tmp_path / "m"), package) == str(tmp_path / "m")
    assert local_model("org/hub-id", None) == "org/hub-id"
