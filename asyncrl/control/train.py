"""`asyncrl train`: start everything, run the loop, shut down cleanly.

    from asyncrl.config import load_config
    from asyncrl.control.train import train
    state = train(load_config("configs/demo.yaml"))

A fresh run writes its resolved config to control.run_dir/config.yaml; `resume_dir`
restores the learners, the policy version and the exactly-once bookkeeping from the last
checkpoint there, and the queue redelivers whatever was consumed after it.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from asyncrl.config import Config, ConfigError
from asyncrl.control.loads import WeightsUnloadable
from asyncrl.control.loop import TrainLoop
from asyncrl.control.parity_gate import ParityMismatch
from asyncrl.control.progress import StepProgress
from asyncrl.control.runtime import Runtime
from asyncrl.control.state import PREEMPTED_EXIT, LoopState, StopFlag
from asyncrl.control.summary import run_summary, write_summary_file
from asyncrl.infra import ExpectedFailure
from asyncrl.monitor.sinks import build_metrics_logger
from asyncrl.queue.connection import redact_url
from asyncrl.rollout.envs.reward_fns import check_rollout_code, task_target_length
from asyncrl.rollout.sampling import check_routing_replay
from asyncrl.rundir import METRICS_FILE, latest_checkpoint
from asyncrl.rundir.store import RunPath, StorageError, run_path

if TYPE_CHECKING:
    from collections.abc import Callable

    from asyncrl.control.runtime import StartedRun

log = logging.getLogger(__name__)


def train(
    cfg: Config,
    *,
    resume_dir: str | Path | None = None,
    on_step: Callable[[TrainLoop, dict[str, float]], None] | None = None,
) -> LoopState:
    """Run one job to `control.total_steps` (or until SIGINT/SIGTERM); return the LoopState.
    After SIGTERM, once everything is stopped: Preempted (exit status 143, "requeue me")."""
    t0 = time.perf_counter()
    try:
        run_dir = run_path(resume_dir or cfg.control.run_dir, cfg.control.storage_options)
    except StorageError as e:
        raise ConfigError(f"control.run_dir: {e}") from None
    try:  # the user's code and env_kwargs: refused here in one line, not by a generator after Ray's start-up
        check_rollout_code(cfg.rollout)
        check_routing_replay(
            cfg.algo.routing_replay, cfg.rollout, cfg.control.ray_address, cfg.learner.context_parallel
        )
    except ValueError as e:
        raise ConfigError(str(e)) from e
    stop = StopFlag(grace_s=cfg.control.shutdown_grace_s)
    stop.install()
    target_length = task_target_length(cfg.rollout)
    try:
        with Runtime(cfg, run_dir) as rt:
            state = LoopState()
            if resume_dir is not None:
                ckpt = latest_checkpoint(run_dir)
                if ckpt is None:
                    log.warning("no complete checkpoint in %s: starting from step 0", run_dir)
                else:
                    state = LoopState.from_extra(rt.learner.load_checkpoint(str(ckpt)))
                    log.info("resumed from %s at step %d, policy version %d", ckpt, state.step, state.version)
            else:
                rt.write_config()
            max_staleness = 0 if cfg.control.mode == "sync" else cfg.control.max_staleness
            jump = state.continue_past(rt.highest_version, max_staleness)
            if jump:
                rt.learner.set_version(state.version)
                log.warning(
                    "this run's Redis announced weights up to v%d (a crashed run's, discarded): the restored "
                    "weights are v%d, and rollouts labelled v%d or older are dropped as stale",
                    rt.highest_version,
                    state.version,
                    rt.highest_version,
                )
            logger = build_metrics_logger(
                cfg.monitor,
                rt.redis_url,
                cfg.control.run_name,
                run_dir,
                cfg.to_dict(),
                password=cfg.queue.password,
                target_length=target_length,
                local_dir=rt.local_dir,
            )
            rt.callback(logger.close)
            dashboard_url = _start_dashboard(cfg, rt)
            _announce(cfg, rt, dashboard_url)
            loop = TrainLoop(cfg, rt, logger, state=state, stop=stop)
            loop.prepare()
            rt.launch_generators()
            log.info(
                "start-up: %s seconds after start (ready: %s)",
                rt.startup.get("generators"),
                ", ".join(f"{k} {v}s" for k, v in rt.startup.items()),
            )
            loop.on_step = on_step
            first_step = state.step
            try:
                if not cfg.monitor.console:
                    state = loop.run()
                else:
                    with StepProgress(cfg.control.total_steps, start=state.step) as progress:
                        loop.progress = progress
                        state = loop.run()
            except Exception as e:
                rt.report_lost_actors(e)
                if isinstance(e, (ParityMismatch, WeightsUnloadable)):  # ended on purpose: say why in summary.json
                    wall_s = time.perf_counter() - t0
                    _write_summary_file(
                        rt, run_dir, loop.state, first_step, loop.max_staleness, "failed", wall_s, loop, error=str(e)
                    )
                raise
            status, wall_s = _status(stop), time.perf_counter() - t0
            _write_summary_file(rt, run_dir, state, first_step, loop.max_staleness, status, wall_s, loop)
            summary = _summary(rt, run_dir, first_step, loop.max_staleness, status, wall_s, target_length)
            print(summary, flush=True)
        # Out of the Runtime: everything it started is stopped by now.
        if stop.preempted:
            raise Preempted(f"stopped by SIGTERM at step {state.step}; resume with: asyncrl train --resume {run_dir}")
        return state
    finally:
        stop.restore()


class Preempted(ExpectedFailure):
    """The run stopped cleanly on SIGTERM (a scheduler's preemption or time limit): its exit
    status, 143, asks for a requeue; `asyncrl train --resume RUN_DIR` goes on from here."""

    exit_code = PREEMPTED_EXIT


def _status(stop: StopFlag) -> str:
    """summary.json's and the summary's word for how the run ended."""
    if stop.preempted:
        return "preempted"
    return "stopped" if stop.is_set else "finished"


def _summary(
    rt: StartedRun,
    run_dir: RunPath,
    first_step: int,
    max_staleness: int,
    status: str,
    wall_s: float,
    target_length: float | None,
) -> str:
    """The end-of-run block (asyncrl.control.summary) from this session's rows of metrics.jsonl."""
    # control.export loads torch and the dashboard starlette/uvicorn: imported where used, so
    # that `asyncrl train` checks its config (and `--check` runs) without them.
    from asyncrl.control.export import HF_DIR

    path = rt.local_dir / METRICS_FILE  # the spool when run_dir is a URL: up to date before its upload
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    rows = [r for r in rows if r.get("step", 0) > first_step]  # a resumed run appends to the file
    hf = run_dir / HF_DIR / "final"
    return run_summary(
        rows,
        startup_s=rt.startup.get("generators", 0.0),
        wall_s=wall_s,
        counters=rt.run_state.counters(),
        max_staleness=max_staleness,
        status=status,
        metrics=run_dir / METRICS_FILE,
        checkpoint=latest_checkpoint(run_dir),
        hf_dir=hf if hf.is_dir() else None,
        resume_cmd=f"asyncrl train --resume {run_dir}",
        dashboard_cmd=f"asyncrl dashboard {run_dir}",
        target_length=target_length,
    )


def _write_summary_file(
    rt: StartedRun,
    run_dir: RunPath,
    state: LoopState,
    first_step: int,
    max_staleness: int,
    status: str,
    wall_s: float,
    loop: TrainLoop,
    error: str | None = None,
) -> None:
    """run_dir/summary.json: what `asyncrl dashboard RUN_DIR` shows of a run whose Redis is gone.
    ``parity_gate``: this start's gate (asyncrl.control.parity_gate), None if none ran."""
    ended = time.time()
    gate = loop.gate.result
    write_summary_file(
        run_dir,
        {
            "run": rt.cfg.control.run_name,
            "status": status,
            "step": state.step,
            "first_step": first_step,
            "policy_version": state.version,
            "max_staleness": max_staleness,
            "startup_s": round(rt.startup.get("generators", 0.0), 3),
            "wall_s": round(wall_s, 3),
            "started_at": round(ended - wall_s, 3),
            "ended_at": round(ended, 3),
            "counters": dict(rt.run_state.counters()),
            "parity_gate": gate.record() if gate is not None else None,
            **({"error": error} if error else {}),
            "resume": f"asyncrl train --resume {run_dir}",
        },
    )


def _start_dashboard(cfg: Config, rt: StartedRun) -> str | None:
    """Serve the dashboard from the trainer process; a busy port falls back to a free one."""
    if not cfg.monitor.dashboard:
        return None
    from asyncrl.monitor.dashboard.app import serve_in_thread
    from asyncrl.monitor.dashboard.guard import resolve_token

    m = cfg.monitor
    token = resolve_token(m.dashboard_token, rt.local_dir)

    def serve(port: int):
        return serve_in_thread(
            rt.redis_url,
            run=cfg.control.run_name,
            host=m.dashboard_host,
            port=port,
            token=token,
            password=cfg.queue.password,
        )

    try:
        server = serve(m.dashboard_port)
    except OSError:
        server = serve(0)
    rt.callback(setattr, server, "should_exit", True)
    return f"http://{m.dashboard_host}:{server.bound_port}/"


def _announce(cfg: Config, rt: StartedRun, dashboard_url: str | None) -> None:
    run = cfg.control.run_name
    log.info("run %r in %s; Redis at %s", run, rt.run_dir, redact_url(rt.redis_url))
    log.info(
        "metrics: %s, Redis stream asyncrl:%s:metrics%s",
        rt.run_dir / METRICS_FILE,
        run,
        f", wandb ({cfg.monitor.wandb}) in {rt.local_dir / 'wandb'}" if cfg.monitor.wandb != "disabled" else "",
    )
    if dashboard_url:
        log.info("dashboard: %s  (token required)" if cfg.monitor.dashboard_token else "dashboard: %s", dashboard_url)
    else:
        log.info("dashboard: asyncrl dashboard --redis %s --run %s", redact_url(rt.redis_url), run)
