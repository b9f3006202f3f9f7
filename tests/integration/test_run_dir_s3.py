"""A run directory on an object store (control.run_dir = s3://...), against moto's real S3
server on loopback (tests.support.s3): DCP checkpoints written and read through torch's fsspec
writer/reader and exported as a Hugging Face folder, retention, metrics.jsonl (spooled and
uploaded), summary.json, the ledger file, the dashboard's reader of a finished run, and the
`--check` probe. A training job with its run dir there is tests/multinode/test_two_nodes.py.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from asyncrl.config import ConfigError, load_config
from asyncrl.config.secrets import REDACTED, redact_config, rejoin_config
from asyncrl.control.ledger import record_trained, trained_ids
from asyncrl.control.preflight import check_run_dir
from asyncrl.control.summary import write_summary_file
from asyncrl.learner import checkpoint
from asyncrl.monitor.sinks import JsonlSink
from asyncrl.rundir import CONFIG_FILE, LATEST, METRICS_FILE, complete_checkpoints, read_extra
from asyncrl.rundir.store import ObjectPath, run_path, upload_tree

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def s3_root(s3_server):
    """A fresh run dir URL in a bucket of its own, opened with explicit storage options."""
    root = run_path(f"s3://{s3_server.bucket()}/runs/x", s3_server.storage_options)
    assert isinstance(root, ObjectPath)
    return root


# ----------------------------------------------------------------------------- checkpoints


def _trained(model_dir: str, mesh, seed: int):
    """The tiny model sharded as the learner shards it, with AdamW state after one step."""
    import torch
    from transformers import AutoModelForCausalLM

    from asyncrl.learner import fsdp

    torch.manual_seed(seed)
    model = fsdp.shard_model(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), mesh, None)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    if seed:  # a different starting point than the saved one
        for p in model.parameters():
            p.data.add_(torch.randn_like(p))
    ids = torch.randint(0, 20, (2, 6))
    model(input_ids=ids).logits.float().pow(2).mean().backward()
    optimizer.step()
    scheduler.step()
    return model, optimizer, scheduler


def _full(model, optimizer) -> dict:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model_sd, optim_sd = get_state_dict(model, optimizer)
    flat = {f"model.{k}": v.full_tensor() for k, v in model_sd.items()}
    for pid, state in optim_sd["state"].items():
        flat.update({f"optim.{pid}.{k}": v.full_tensor() for k, v in state.items() if k != "step"})
    return flat


def _save(root, model, optimizer, scheduler, step: int, extra: dict, *, opts: dict):
    final = root / "checkpoints" / f"step_{step:06d}"
    staging = checkpoint.staging_dir(final)
    checkpoint.save_rank_state(
        str(staging), model, optimizer, scheduler, rank=0, step=step, version=step + 1, storage_options=opts
    )
    return staging, checkpoint.publish(staging, final, extra)


def test_a_dcp_checkpoint_round_trips_through_s3_and_exports_from_there(
    mesh, s3_root, s3_server, tiny_model_dir, tmp_path
):
    import torch
    from safetensors.torch import load_file

    from asyncrl.control.export import export_checkpoint

    opts = s3_server.storage_options
    model, optimizer, scheduler = _trained(tiny_model_dir, mesh, seed=0)
    want = _full(model, optimizer)

    t0 = time.perf_counter()
    staging, final = _save(s3_root, model, optimizer, scheduler, 10, {"ids": ["g1", "g2"]}, opts=opts)
    save_s = time.perf_counter() - t0
    assert staging == final  # no rename on S3: a first save is written in place, the marker last
    assert checkpoint.resolve(s3_root / "checkpoints") == final  # through `latest`
    assert read_extra(final) == {"ids": ["g1", "g2"]}
    assert (final / "dcp" / ".metadata").is_file()

    fresh, fresh_opt, fresh_sched = _trained(tiny_model_dir, mesh, seed=1)
    assert any(not torch.equal(v, _full(fresh, fresh_opt)[k]) for k, v in want.items())
    t0 = time.perf_counter()
    step, version = checkpoint.load_rank_state(str(final), fresh, fresh_opt, fresh_sched, rank=0, storage_options=opts)
    load_s = time.perf_counter() - t0
    assert (step, version) == (10, 11)
    got = _full(fresh, fresh_opt)
    assert got.keys() == want.keys()
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert fresh_sched.state_dict() == scheduler.state_dict()

    # The same step again (an outage checkpoint after an unacked one): a new revision beside
    # it, which supersedes (and then deletes) the first once complete.
    staging, final = _save(s3_root, model, optimizer, scheduler, 10, {"ids": ["g3"]}, opts=opts)
    assert staging == final and final.name == "step_000010.r1"
    assert read_extra(checkpoint.resolve(s3_root / "checkpoints")) == {"ids": ["g3"]}
    assert not (s3_root / "checkpoints" / "step_000010").exists()
    # A save that died before its marker is no checkpoint, and the next save of it starts clean.
    (s3_root / "checkpoints" / "step_000020" / "rank_00007.msgpack").write_bytes(b"left by a crash")
    assert complete_checkpoints(s3_root / "checkpoints") == [final]
    _, newer = _save(s3_root, model, optimizer, scheduler, 20, {}, opts=opts)
    assert not (newer / "rank_00007.msgpack").exists()
    assert (s3_root / "checkpoints" / LATEST).read_text().strip() == "step_000020"

    # `asyncrl export` of the run on S3: its HF folder is uploaded beside the checkpoints.
    cfg = load_config(ROOT / "configs" / "demo.yaml", [f"rollout.model={tiny_model_dir}"])
    (s3_root / CONFIG_FILE).write_text(json.dumps(cfg.to_dict()))
    out = export_checkpoint(s3_root, step=10)
    assert out == s3_root / "hf" / "step_10"
    (tmp_path / "w.safetensors").write_bytes((out / "model.safetensors").read_bytes())
    exported = load_file(tmp_path / "w.safetensors")
    assert all(torch.equal(exported[k.removeprefix("model.")], v) for k, v in want.items() if k.startswith("model."))
    assert (out / "config.json").is_file() and (out / "tokenizer_config.json").is_file()

    # The same round trip on local disk, for the report (not asserted: timings vary).
    t0 = time.perf_counter()
    _, local_final = _save(tmp_path / "run", model, optimizer, scheduler, 10, {}, opts=opts)
    local_save_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    checkpoint.load_rank_state(str(local_final), fresh, fresh_opt, fresh_sched, rank=0)
    local_load_s = time.perf_counter() - t0
    print(
        f"\ncheckpoint of the tiny model: save {save_s * 1e3:.0f} ms on s3 vs {local_save_s * 1e3:.0f} ms local, "
        f"load {load_s * 1e3:.0f} ms on s3 vs {local_load_s * 1e3:.0f} ms local"
    )


@pytest.mark.parametrize("fault", ["tree", "marker"])
def test_a_resave_that_dies_part_way_leaves_the_previous_checkpoint_resumable(
    mesh, s3_root, s3_server, tiny_model_dir, monkeypatch, fault
):
    """The outage path saves step N again exactly when storage is least reliable. A save that
    dies part-way (while its tree is copied into place, or before its marker lands) must leave
    the previous complete step N for the resume, even with keep_checkpoints: 1."""
    import torch

    from asyncrl.rundir import latest_checkpoint
    from asyncrl.rundir.store import ObjectPath

    opts = s3_server.storage_options
    model, optimizer, scheduler = _trained(tiny_model_dir, mesh, seed=0)
    want = _full(model, optimizer)
    _save(s3_root, model, optimizer, scheduler, 10, {"ids": ["g1"]}, opts=opts)

    # "tree": the process dies while the new tree is written into its place, whether copied
    # there from a staging prefix or written there by the ranks (DCP's shards are in, the
    # rank's own file is not). "marker": everything is in place but the marker.
    def copy_then_die(source, dest):
        first = sorted(source.fs.find(source.path))[0]
        source.fs.copy(first, dest.path + first[len(source.path) :])
        raise ConnectionError("injected: the storage went away mid-copy")

    write_bytes, write_text = ObjectPath.write_bytes, ObjectPath.write_text

    def rank_file_dies(self, data):
        if self.name.startswith("rank_") and self.parent.name.startswith("step_"):
            raise ConnectionError("injected: the storage went away mid-write")
        return write_bytes(self, data)

    def marker_dies(self, data, encoding="utf-8"):
        if self.name == checkpoint.COMPLETE_MARKER:
            raise ConnectionError("injected: the storage went away before the marker")
        return write_text(self, data, encoding)

    trained_on = _trained(tiny_model_dir, mesh, seed=2)  # the re-save's own (different) state
    with monkeypatch.context() as m:
        if fault == "tree":
            m.setattr(checkpoint, "copy_tree", copy_then_die, raising=False)
            m.setattr(ObjectPath, "write_bytes", rank_file_dies)
        else:
            m.setattr(ObjectPath, "write_text", marker_dies)
        with pytest.raises(ConnectionError, match="injected"):
            _save(s3_root, *trained_on, 10, {"ids": ["g1", "g2"]}, opts=opts)
    checkpoint.prune(s3_root / "checkpoints", keep_last=1)  # control.keep_checkpoints: 1

    # What a resume takes (asyncrl.control.train: the run's latest complete checkpoint).
    found = latest_checkpoint(s3_root)
    assert found is not None and read_extra(found) == {"ids": ["g1"]}
    assert checkpoint.resolve(found) == found
    fresh, fresh_opt, fresh_sched = _trained(tiny_model_dir, mesh, seed=1)
    step, _ = checkpoint.load_rank_state(str(found), fresh, fresh_opt, fresh_sched, rank=0, storage_options=opts)
    got = _full(fresh, fresh_opt)
    assert step == 10 and all(torch.equal(got[k], want[k]) for k in want)

    # The storage is back: the next save of the step supersedes it and clears what the dead one left.
    _, final = _save(s3_root, *trained_on, 10, {"ids": ["g1", "g2"]}, opts=opts)
    assert complete_checkpoints(s3_root / "checkpoints") == [final]
    assert read_extra(checkpoint.resolve(s3_root / "checkpoints")) == {"ids": ["g1", "g2"]}
    assert sorted(p.name for p in (s3_root / "checkpoints").iterdir()) == [LATEST, final.name]


def _fake_checkpoint(root, step: int) -> None:
    final = root / f"step_{step:06d}"
    staging = checkpoint.staging_dir(final)
    (staging / "rank_00000.msgpack").write_bytes(b"x" * 10)
    checkpoint.publish(staging, final, {"step": step})


def test_retention_on_s3_keeps_the_newest_every_kth_and_what_latest_names(s3_root):
    root = s3_root / "checkpoints"
    for step in range(10, 61, 10):
        _fake_checkpoint(root, step)
    (root / "step_000070" / "rank_00000.msgpack").write_bytes(b"in progress")  # no marker
    removed = checkpoint.prune(root, keep_last=2, keep_every=30)
    assert sorted(p.name for p in removed) == ["step_000010", "step_000020", "step_000040"]
    assert [p.name for p in complete_checkpoints(root)] == ["step_000030", "step_000050", "step_000060"]
    assert not root.fs.find((root / "step_000010").path)  # the bytes went too, not only the marker
    assert (root / "step_000070" / "rank_00000.msgpack").exists()

    (root / LATEST).write_text("step_000030\n")  # a resume from an older checkpoint protects it
    _fake_checkpoint(root, 80)
    (root / LATEST).write_text("step_000030\n")
    checkpoint.prune(root, keep_last=1)
    assert [p.name for p in complete_checkpoints(root)] == ["step_000030", "step_000080"]


# ----------------------------------------------------------------------------- run files


def test_metrics_summary_and_ledger_files_on_s3(s3_root, tmp_path):
    remote = s3_root / METRICS_FILE
    sink = JsonlSink(tmp_path / "spool" / METRICS_FILE, upload_to=remote, upload_every_s=3600)
    sink.log(1, {"reward/mean": 0.5})
    assert not remote.exists()  # spooled: the upload waits for its interval, or the close
    sink.close()
    assert [json.loads(line)["step"] for line in remote.read_text().splitlines()] == [1]

    # A resume on another machine (an empty spool) continues the uploaded file.
    again = JsonlSink(tmp_path / "other" / METRICS_FILE, upload_to=remote, upload_every_s=0)
    again.log(2, {"reward/mean": 0.75})
    rows = [json.loads(line) for line in remote.read_text().splitlines()]  # uploaded at once (interval 0)
    assert [(r["step"], r["reward/mean"]) for r in rows] == [(1, 0.5), (2, 0.75)]
    again.close()

    write_summary_file(s3_root, {"status": "finished", "step": 2})
    assert json.loads((s3_root / "summary.json").read_text()) == {"status": "finished", "step": 2}

    record_trained(s3_root, 5, ["a", "b"])
    record_trained(s3_root, 10, ["c"])
    record_trained(s3_root, 10, ["c"])  # a resume writes its checkpoint's line again
    assert trained_ids(s3_root, upto_step=10) == ["a", "b", "c"]
    assert trained_ids(s3_root, upto_step=5) == ["a", "b"]


def test_the_dashboard_reads_a_finished_run_from_s3(finished_run_dir, s3_root, s3_server, monkeypatch):
    """The same finished run, local and uploaded: the dashboard's reader (given only the URL,
    with the standard AWS_* credentials, as `asyncrl dashboard s3://...` is) shows the same."""
    from asyncrl.monitor.dashboard.rundir import NotARunDir, RunDirSource

    local_dir, _ = finished_run_dir
    upload_tree(local_dir, s3_root)
    for k, v in s3_server.env.items():
        monkeypatch.setenv(k, v)
    local, remote = RunDirSource(local_dir), RunDirSource(s3_root.url)
    assert remote.run == local.run == "fin"
    want, got = local.snapshot("fin", now=2e9), remote.snapshot("fin", now=2e9)
    for snap in (want, got):
        for volatile in ("run_dir", "metrics_age_s"):
            snap["summary"]["finished"].pop(volatile)
    assert got == want
    assert got["summary"]["status"] == "finished" and got["summary"]["step"] == 30
    assert remote.series("fin", ["reward/*"], None) == local.series("fin", ["reward/*"], None)
    with pytest.raises(NotARunDir, match="not a directory"):
        RunDirSource(f"{s3_root.url}-missing")


# ----------------------------------------------------------------------------- config, --check


def test_check_probes_the_url_and_names_the_cause(s3_root, s3_server):
    base = ROOT / "configs" / "demo.yaml"
    cfg = load_config(base, [f"control.run_dir={s3_root.url}", *s3_server.overrides()])
    assert check_run_dir(cfg) == [f"run dir: {s3_root.url} is writable"]
    assert not list(s3_root.iterdir())  # the probe is deleted again

    missing = load_config(base, ["control.run_dir=s3://no-such-bucket/runs/x", *s3_server.overrides()])
    with pytest.raises(ConfigError, match=r"control.run_dir='s3://no-such-bucket/runs/x'.*bucket does not exist"):
        check_run_dir(missing)


def test_a_scheme_without_its_package_and_the_options_secret():
    import importlib.util

    cfg = load_config(
        ROOT / "configs" / "demo.yaml",
        ["control.run_dir=gs://b/runs/x", 'control.storage_options={"token": "sekrit"}'],
    )
    if importlib.util.find_spec("gcsfs") is None:
        with pytest.raises(ConfigError, match="gs:// needs the gcsfs package"):
            check_run_dir(cfg)
    redacted = redact_config(cfg)
    assert redacted["control"]["storage_options"] == REDACTED
    assert "sekrit" not in json.dumps(redacted)
    # A joining generator writes no run dir: the redacted value is dropped, not validated.
    assert "storage_options" not in rejoin_config(redacted, redis_url="redis://x", password=None)["control"]
