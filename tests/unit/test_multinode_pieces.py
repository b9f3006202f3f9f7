"""The host-independent pieces of multi-node runs: config keys, the weights packet and
the files a generator writes from it, the weight store's retention, ray.init arguments and the model manifest."""

from __future__ import annotations

import os

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


def test_a_weights_packet_is_written_as_the_file_safetensors_reads(tmp_path):
    from safetensors.torch import load_file

    from asyncrl.sync.objstore import weights_packet, write_packet

    state = {
        "a": torch.randn(3, 5),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.zeros(0),
        "d": torch.randn(4, 4).to(torch.bfloat16).t(),
    }  # non-contiguous
    packet = weights_packet(state)
    assert packet.nbytes == sum(v.numel() * v.element_size() for v in state.values())
    back = load_file(write_packet(packet, str(tmp_path), "run-gen", 1))
    assert back.keys() == state.keys()
    for k, v in state.items():
        assert back[k].dtype == v.dtype and torch.equal(back[k], v.contiguous()), k


def test_a_fetch_rewrites_a_parked_file_but_never_the_engines_kept_copy(tmp_path):
    """Fetched files are parked and rewritten in place (no page allocation), except while the
    engine's last-good hard link still points at one: that copy must never change."""
    from safetensors.torch import load_file

    from asyncrl.sync.objstore import discard, drop_spares, weights_packet, write_packet
    from asyncrl.types import WeightsObject

    shm, tag, keep = str(tmp_path), "run-gen", str(tmp_path / "kept.safetensors")
    states = [{"w": torch.full((256,), float(v))} for v in range(4)]

    def load_and_keep(version: int) -> str:  # what the engine does with a fetched file
        path = write_packet(weights_packet(states[version]), shm, tag, version)
        os.link(path, keep + ".tmp")
        os.replace(keep + ".tmp", keep)
        discard(path, WeightsObject("run", version), tag)
        return path

    load_and_keep(1)
    inode_v1 = os.stat(keep).st_ino
    load_and_keep(2)  # v1's file is still the kept copy while v2 is written: a new file
    assert os.stat(keep).st_ino != inode_v1 and float(load_file(keep)["w"][0]) == 2.0
    load_and_keep(3)  # v1's inode is free now: rewritten in place
    assert os.stat(keep).st_ino == inode_v1 and float(load_file(keep)["w"][0]) == 3.0
    assert len([n for n in os.listdir(shm) if "spare" in n]) == 2
    drop_spares(shm, tag)
    assert sorted(os.listdir(shm)) == ["kept.safetensors"]


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
