"""The steps that bring up one part of a run each, and the matching stops, registered on the
run's ExitStack as each part comes up (asyncrl.control.runtime puts them in order)."""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from asyncrl.config import Config
from asyncrl.control.cluster import connect_ray
from asyncrl.control.preflight import HUB_SAMPLE, check_prompt_source, prompt_sources
from asyncrl.queue import RolloutQueue
from asyncrl.queue.server import EmbeddedRedis
from asyncrl.rollout.envs import resolve_env_class
from asyncrl.rollout.envs.chat import check_turn_template
from asyncrl.rollout.prompts import check_chat_template
from asyncrl.rollout.reward_model import start_reward_models, stop_reward_models
from asyncrl.rollout.teacher import start_teacher
from asyncrl.sync import build_weight_sync
from asyncrl.sync.weight_sync import lora_publish

if TYPE_CHECKING:
    from asyncrl.learner import LearnerGroup
    from asyncrl.queue import RunState
    from asyncrl.sync import WeightSync

log = logging.getLogger(__name__)


def check_prompts(cfg: Config, model_path: str) -> None:
    """Open the prompt sources and check the chat template once, here: a missing column or
    split, or a tokenizer without a template, would otherwise fail every generator's start
    (which Ray retries for ever) and the evaluator's. A hub dataset is sampled as `--check`
    samples it: reading millions of rows on the driver would hold the start for minutes."""
    r = cfg.rollout
    for where, source, split in prompt_sources(cfg):
        check_prompt_source(cfg, where, source, split, hub_sample=HUB_SAMPLE)
    if r.chat_template:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_path)
        check_chat_template(tokenizer, r.model)
        check_turn_template(tokenizer, r.env, r.env_kwargs)


def start_redis(cfg: Config, run_dir: Path, stack: contextlib.ExitStack) -> tuple[str, EmbeddedRedis | None]:
    """The Redis URL to use, and the server started for it (None: queue.redis_url names one)."""
    q = cfg.queue
    if q.redis_url is not None:
        return q.redis_url, None

    server = EmbeddedRedis(
        run_dir / "redis", password=q.password, aof=q.aof, bind=q.bind, generator_run=cfg.control.run_name
    )
    server.start()
    stack.callback(server.stop)
    return server.url, server


def generator_connection(cfg: Config, redis_url: str, server: EmbeddedRedis | None) -> tuple[str, str | None]:
    """The URL and password the run's generators connect with: the embedded server's generator
    user when it has one (the run's keys and data commands only), else the trainer's own."""
    if server is not None and server.generator_url is not None:
        return server.generator_url, None
    return redis_url, cfg.queue.password


def connect_queue(cfg: Config, redis_url: str, stack: contextlib.ExitStack) -> RolloutQueue:
    q = cfg.queue
    queue = RolloutQueue.connect(
        redis_url,
        cfg.control.run_name,
        password=q.password,
        consumer="learner-0",
        maxlen=q.maxlen,
        max_record_bytes=q.max_record_bytes,
        claim_idle_s=q.claim_idle_s,
        retry_deadline_s=q.retry_deadline_s,
        outage_deadline_s=q.outage_deadline_s,
        ledger=q.ledger,
        stale_reissues=q.stale_reissues,
    )
    stack.callback(queue.close)
    return queue


def start_ray(cfg: Config, run_dir: Path, stack: contextlib.ExitStack) -> None:
    import ray

    if ray.is_initialized():
        return  # a caller (tests, notebooks) owns Ray; leave it running
    env_vars = {
        "VLLM_CPU_KVCACHE_SPACE": str(cfg.rollout.kvcache_gib),
        "TOKENIZERS_PARALLELISM": "false",
        # vLLM's per-engine INFO lines drown the trainer's progress; WARNING keeps problems.
        "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "WARNING"),
        # So user code named by import path (envs, losses) imports in every worker too.
        "PYTHONPATH": os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p),
    }

    # ray.init puts in its own SIGTERM handler (a stack dump and sys.exit): the run's own
    # (asyncrl.control.state.StopFlag: checkpoint, stop, exit 143) must stay.
    on_sigterm = signal.getsignal(signal.SIGTERM)
    try:
        connect_ray(cfg.control, env_vars, verbose=cfg.monitor.verbose)
    finally:
        if threading.current_thread() is threading.main_thread() and on_sigterm is not None:
            signal.signal(signal.SIGTERM, on_sigterm)
    stack.callback(ray.shutdown)
    _link_ray_logs(run_dir, verbose=cfg.monitor.verbose)


def _link_ray_logs(run_dir: Path, *, verbose: bool) -> None:
    """run_dir/logs/ray -> this Ray session's log directory (worker and engine output)."""
    import ray

    node = getattr(ray._private.worker, "_global_node", None)
    if node is None:  # a client or an attached driver without a local node
        return
    session = Path(node.get_session_dir_path())
    link = run_dir / "logs" / "ray"
    link.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.suppress(FileNotFoundError):
        link.unlink()
    link.symlink_to(session / "logs", target_is_directory=True)
    if not verbose:
        log.info("Ray worker and vLLM engine logs: %s (asyncrl train --verbose streams them here)", link)


def start_reward_model_actors(
    cfg: Config, stack: contextlib.ExitStack, model_path: str | None = None
) -> list[tuple[str, Any]]:
    """One actor per reward model of rollout.rewards, and rollout.teacher's (its vocabulary is
    checked against the student's, ``model_path``), loading in the background (the run waits
    for them before its generators start: asyncrl.rollout.reward_model.wait_ready)."""
    started: list[tuple[str, Any]] = []
    stack.callback(stop_reward_models, started)
    started += start_reward_models(cfg)
    if model_path is not None:
        started += start_teacher(cfg, model_path)
    return started


def start_learner(
    cfg: Config, model_path: str, model_package: dict | None, stack: contextlib.ExitStack
) -> LearnerGroup:
    # The learner loads torch: imported only when it is started, so that importing the
    # control part (and the CLI above it) does not.
    from asyncrl.learner import LearnerGroup

    learner = LearnerGroup(
        cfg,
        model_path,
        sample_special_tokens=resolve_env_class(cfg.rollout.env).sample_special_tokens,
        collective_timeout_s=cfg.learner.collective_timeout_s,
        model_package=model_package,
    )
    stack.callback(learner.shutdown)
    return learner


def start_weight_sync(
    cfg: Config, run_state: RunState, model_package: dict | None, stack: contextlib.ExitStack
) -> WeightSync:
    weight_sync = build_weight_sync(
        cfg.sync,
        run_state=run_state,
        run=cfg.control.run_name,
        learner=None,  # not started yet: see Runtime._bring_up
        model_package=model_package,
    )
    stack.callback(weight_sync.close)
    match lora_publish(cfg.learner.lora, cfg.sync):
        case "adapter":
            log.info("LoRA: each publish sends the adapter alone; the engines load it as a vLLM LoRA")
        case "merged":
            log.info("LoRA: each publish sends the weights with the adapter merged in; the engines load them whole")
    return weight_sync
