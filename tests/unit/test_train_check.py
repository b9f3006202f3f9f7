"""`asyncrl train CONFIG --check` resolves what start-up would (weight sync, engine arguments)
without a model download, Redis, Ray or CUDA, so a GPU config is checked on a CPU box up to
where CUDA is needed.

.venv/bin/python -m pytest tests/unit/test_train_check.py -q
"""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import threading

import pytest
import torch

from asyncrl.cli import main

GPU_CONFIG = "configs/gsm8k_qwen2.5_0.5b_gpu.yaml"
ONE_GPU_CONFIG = "configs/gsm8k_qwen2.5_0.5b_1gpu.yaml"


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    """Never the network: a hub model id is "not checked" here unless a test says otherwise."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def check(capsys, *args: str) -> tuple[int, list[str], str]:
    rc = main(["train", *args, "--check"])
    out, err = capsys.readouterr()
    return rc, [line for line in out.splitlines() if line.startswith("check: ")], err


@pytest.fixture
def gsm_file(tmp_path) -> list[str]:
    """The GPU config's hub dataset as a local file (the check reads it; no network here)."""
    path = tmp_path / "gsm.jsonl"
    path.write_text('{"question": "1+1=", "answer": "#### 2"}\n')
    return [f"rollout.prompts={path}", f"control.eval_prompts={path}"]


# Where the run cannot start (a GPU config on a host without one), --check prints every line and
# then refuses as for a bad config.
CAN_START = 0 if torch.cuda.is_available() else 2


def test_the_gpu_config_passes_up_to_cuda_with_nccl_engines(capsys, gsm_file):
    rc, lines, err = check(capsys, GPU_CONFIG, *gsm_file)
    assert rc == CAN_START, err
    assert "check: rollout.env=gsm8k: imported and built" in lines
    assert sum(line.endswith("gsm.jsonl: 1 records read and valid") for line in lines) == 2  # train and eval
    assert "check: weight sync: nccl" in lines
    # the engines a generator builds for a nccl sync take vLLM's nccl weight transfer
    assert "check: engine: Qwen/Qwen2.5-0.5B-Instruct, dtype float32, weight_transfer_config nccl" in lines
    cuda = "(available)" if torch.cuda.is_available() else "(not available on this host: checked up to here)"
    assert lines[-2] == (
        f"check: needs CUDA: sync.backend=nccl, learner.gpus_per_rank=1, rollout.gpus_per_generator=1 {cuda}"
    )
    assert lines[-1].startswith("check: GPUs: the config asks for 2 (learner 1 x 1, generators 1 x 1): 2 device(s)")
    if not torch.cuda.is_available():
        assert "this host has NO GPU (torch sees no CUDA device): the run cannot start here" in lines[-1]


# ----------------------------------------------------------------------------- one GPU, shared


def test_the_one_gpu_config_shares_a_device_through_shared_memory(capsys, gsm_file):
    from asyncrl.config import load_config

    cfg = load_config(ONE_GPU_CONFIG)
    assert cfg.learner.gpus_per_rank + cfg.rollout.gpus_per_generator == 1
    assert cfg.sync.backend == "shm" and cfg.rollout.engine_kwargs["gpu_memory_utilization"] == 0.3
    rc, lines, err = check(capsys, ONE_GPU_CONFIG, *gsm_file)
    assert rc == CAN_START, err
    assert "check: weight sync: shm" in lines
    assert "check: engine: Qwen/Qwen2.5-0.5B-Instruct, dtype float32, weight_transfer_config none" in lines or (
        torch.cuda.is_available()
    )
    gpus = next(line for line in lines if line.startswith("check: GPUs:"))
    assert gpus.startswith("check: GPUs: the config asks for 1 (learner 1 x 0.5, generators 1 x 0.5): 1 device(s)")
    if not torch.cuda.is_available():
        assert gpus.endswith(
            "this host has NO GPU (torch sees no CUDA device): the run cannot start here, checked up to here"
        )
    else:
        assert any(line.startswith("check: engine memory: gpu_memory_utilization 0.3 of") for line in lines)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a host without a GPU")
def test_a_gpu_config_on_a_host_without_one_is_refused_after_every_line(capsys, gsm_file):
    rc, lines, err = check(capsys, ONE_GPU_CONFIG, *gsm_file)
    assert rc == 2
    assert lines[-1].endswith("the run cannot start here, checked up to here")
    assert err.strip().splitlines()[-1] == (
        "asyncrl train --check: the run cannot start here: the config asks for 1 GPU(s) and this host has none "
        "(torch sees no CUDA device); run it on a GPU host, or on a cluster (control.ray_address)"
    )
    # A cluster may hold the GPUs: nothing to refuse from here.
    rc, lines, err = check(capsys, ONE_GPU_CONFIG, *gsm_file, "control.ray_address=ray://head:10001")
    assert rc == 0, err
    assert lines[-1].endswith("this host has NO GPU: the cluster (control.ray_address) must hold them")


def test_cannot_start_here_only_without_gpus_and_without_a_cluster():
    from asyncrl.config import load_config
    from asyncrl.control.preflight_gpu import Device, cannot_start_here

    cfg = load_config(ONE_GPU_CONFIG)
    assert cannot_start_here(cfg, []) is not None
    assert cannot_start_here(cfg, [Device("H100", 80.0)]) is None
    assert cannot_start_here(load_config(ONE_GPU_CONFIG, ["control.ray_address=auto"]), []) is None
    assert cannot_start_here(load_config("configs/demo.yaml"), []) is None  # asks for no GPU


def test_a_shared_gpu_needs_shared_memory_sync_and_an_engine_memory_share(capsys, gsm_file):
    rc, _, err = check(capsys, ONE_GPU_CONFIG, *gsm_file, "sync.backend=nccl")
    assert rc == 2 and "NCCL cannot connect them: set sync.backend=shm" in err
    rc, _, err = check(capsys, ONE_GPU_CONFIG, *gsm_file, "rollout.engine_kwargs={}")
    assert rc == 2 and "set rollout.engine_kwargs.gpu_memory_utilization" in err and "0.9" in err
    for bad in ("abc", "1.5", "0", "true"):
        rc, _, err = check(capsys, ONE_GPU_CONFIG, *gsm_file, f"rollout.engine_kwargs.gpu_memory_utilization={bad}")
        assert rc == 2 and "gpu_memory_utilization" in err and "expected a number in (0, 1]" in err, (bad, err)


def test_an_unreachable_hub_is_one_line_and_checked_offline(capsys, monkeypatch):
    """No minute of retries, each logged twice: the hub is asked once, briefly, and the rest of
    the check runs offline (what the cache holds is still read)."""
    import huggingface_hub.constants

    from asyncrl.infra import free_port

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with contextlib.suppress(ImportError):
        import datasets.config

        monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    endpoint = f"http://127.0.0.1:{free_port()}"  # nobody listens: refused at once
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    rc, lines, err = check(capsys, GPU_CONFIG)
    assert rc == CAN_START, err
    hub = [line for line in lines if line.startswith("check: hub:")]
    assert hub == [
        f"check: hub: {endpoint} does not answer from this host (ConnectError): checked offline (HF_HUB_OFFLINE=1); "
        "Qwen/Qwen2.5-0.5B-Instruct, openai/gsm8k:main: read from this host's cache where they are, else not checked"
    ]
    assert "Retrying" not in err and "Retry" not in err
    assert (
        "check: rollout.model: Qwen/Qwen2.5-0.5B-Instruct: not checked (HF_HUB_OFFLINE is set: the hub is not asked)"
        in (lines)
    )


def test_engines_without_the_nccl_transfer_are_refused(capsys, gsm_file):
    rc, _, err = check(
        capsys, GPU_CONFIG, *gsm_file, 'rollout.engine_kwargs={"weight_transfer_config": {"backend": "ipc"}}'
    )
    assert rc == 2 and "sync.backend=nccl needs engines built with vLLM's nccl weight transfer" in err


def test_unknown_engine_kwargs_and_a_missing_sync_dir_are_refused(capsys, tmp_path):
    rc, _, err = check(capsys, "configs/demo.yaml", 'rollout.engine_kwargs={"max_num_seqz": 4}')
    assert rc == 2 and "rollout.engine_kwargs=" in err and "max_num_seqz" in err
    rc, _, err = check(capsys, "configs/demo.yaml", f"sync.shm_dir={tmp_path / 'nope'}")
    assert rc == 2 and "sync.shm_dir=" in err and "not a directory" in err


def test_a_cpu_config_needs_no_cuda(capsys):
    rc, lines, err = check(capsys, "configs/demo.yaml", "sync.backend=shm")
    assert rc == 0, err
    assert lines[0] == "check: rollout.env=copy: imported and built (makes the prompts)"
    assert lines[1] == "check: weight sync: shm" and "weight_transfer_config none" in lines[2]
    assert not any("needs CUDA" in line for line in lines)


# ----------------------------------------------------------------------------- rollout.model


def test_a_model_that_does_not_exist_is_refused(capsys, tmp_path):
    rc, _, err = check(capsys, "configs/demo.yaml", "rollout.model=/no/such/dir")
    assert rc == 2 and "rollout.model='/no/such/dir': no such directory (nor is it a hub model id" in err
    rc, _, err = check(capsys, "configs/demo.yaml", "rollout.model=Qwen/Qwen2.5/0.5B")
    assert rc == 2 and "rollout.model='Qwen/Qwen2.5/0.5B': no such directory" in err
    rc, _, err = check(capsys, "configs/demo.yaml", "rollout.model=owner/bad..name")
    assert rc == 2 and "rollout.model='owner/bad..name': not a local directory, nor a hub model id" in err


def test_a_local_model_dir_needs_config_weights_and_tokenizer(capsys, tmp_path, tiny_model_dir):
    import shutil

    rc, lines, err = check(capsys, "configs/demo.yaml", f"rollout.model={tiny_model_dir}")
    assert rc == 0, err
    assert f"check: rollout.model: {tiny_model_dir}: llama, 1 weight file(s), tokenizer loaded" in lines

    broken = tmp_path / "model"
    shutil.copytree(tiny_model_dir, broken)
    for drop, why in (
        ("tokenizer*", "no tokenizer in it"),
        ("*.safetensors", "no weights in it"),
        ("config.json", "no config.json in it"),
    ):
        for f in broken.glob(drop):
            f.unlink()
        rc, _, err = check(capsys, "configs/demo.yaml", f"rollout.model={broken}")
        assert rc == 2 and f"rollout.model='{broken}': {why}" in err, err
    (broken / "config.json").write_text("[1, 2")
    rc, _, err = check(capsys, "configs/demo.yaml", f"rollout.model={broken}")
    assert rc == 2 and "its config.json cannot be read as JSON" in err

    # A sharded checkpoint whose index names a shard that is not there.
    shutil.rmtree(broken)
    shutil.copytree(tiny_model_dir, broken)
    index = {"weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}
    (broken / "model.safetensors.index.json").write_text(json.dumps(index))
    (broken / "model-00001-of-00002.safetensors").write_bytes(b"")
    rc, _, err = check(capsys, "configs/demo.yaml", f"rollout.model={broken}")
    assert rc == 2 and "names weight files that are missing: model-00002-of-00002.safetensors" in err


def test_a_hub_id_is_not_checked_offline_and_is_asked_of_the_hub_otherwise(capsys, monkeypatch):
    """Offline (HF_HUB_OFFLINE) the hub is not asked; a hub that refuses connections is
    "not checked"; one that says the repository does not exist (a stand-in hub on loopback,
    answering as the hub does) fails the check. Nothing here reaches the network."""
    rc, lines, err = check(capsys, "configs/demo.yaml", "rollout.model=someone/some-model")
    assert rc == 0, err
    assert (
        "check: rollout.model: someone/some-model: not checked (HF_HUB_OFFLINE is set: the hub is not asked)" in lines
    )

    from huggingface_hub import constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)  # the check sets it: undone after the test
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # read at its import, maybe offline then
    with closed_port() as port:
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        rc, lines, err = check(capsys, "configs/demo.yaml", "rollout.model=someone/some-model")
    assert rc == 0, err
    # the hub refuses: asked once, then the check goes on offline
    assert lines[0].startswith(f"check: hub: http://127.0.0.1:{port} does not answer from this host (ConnectError)")
    assert (
        "check: rollout.model: someone/some-model: not checked (HF_HUB_OFFLINE is set: the hub is not asked)" in lines
    )

    monkeypatch.delenv("HF_HUB_OFFLINE")  # what the check above set for the rest of its process
    monkeypatch.delenv("HF_DATASETS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with stand_in_hub(found={"someone/exists"}) as endpoint:
        monkeypatch.setenv("HF_ENDPOINT", endpoint)
        rc, _, err = check(capsys, "configs/demo.yaml", "rollout.model=someone/missing")
        assert rc == 2 and "rollout.model='someone/missing': no such model on the hub" in err
        rc, lines, err = check(capsys, "configs/demo.yaml", "rollout.model=someone/exists")
        assert rc == 0 and "check: rollout.model: someone/exists: found on the hub" in lines, (lines, err)


@contextlib.contextmanager
def closed_port():
    """A loopback port nothing listens on (bound, never listening: connections are refused)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        yield sock.getsockname()[1]


@contextlib.contextmanager
def stand_in_hub(found: set[str]):
    """GET /api/models/<id>: 200 with a model record for ``found``, else the hub's 404 with
    its RepoNotFound error code (what huggingface_hub turns into RepositoryNotFoundError)."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            repo = self.path.split("?")[0].removeprefix("/api/models/").split("/revision/")[0]
            if repo in found:
                body = json.dumps({"id": repo, "modelId": repo, "sha": "0" * 40, "private": False}).encode()
                self.send_response(200)
            else:
                body = b'{"error": "Repository not found"}'
                self.send_response(404)
                self.send_header("X-Error-Code", "RepoNotFound")
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
