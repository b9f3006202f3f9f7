"""`asyncrl train`: start everything, run the loop, shut down cleanly.

    from asyncrl.config import load_config
    from asyncrl.control.train import train
    state = train(load_config("configs/demo.yaml"))

A fresh run writes its resolved config to control.run_dir/config.yaml; `resume_dir`
restores the learners, the policy version and the exactly-once ledger from the last
checkpoint there, and the queue redelivers whatever was consumed after it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from asyncrl.config import Config

log = logging.getLogger(__name__)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    root = Path(run_dir) / "checkpoints"
    steps = sorted(p for p in root.glob("step_*") if (p / ".complete").exists()) if root.exists() else []
    return steps[-1] if steps else None


def train(cfg: Config, *, resume_dir: str | Path | None = None, on_step=None):
    """Run one job to `control.total_steps` (or until SIGINT/SIGTERM); return the LoopState."""
    from asyncrl.control.loop import LoopState, StopFlag, TrainLoop
    from asyncrl.control.progress import StepProgress
    from asyncrl.control.runtime import Runtime
    from asyncrl.monitor.sinks import build_metrics_logger

    run_dir = Path(resume_dir or cfg.control.run_dir)
    stop = StopFlag()
    stop.install()
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
            logger = build_metrics_logger(cfg.monitor, rt.queue.client, cfg.control.run_name, run_dir, cfg.to_dict())
            rt.callback(logger.close)
            _announce(cfg, rt)
            loop = TrainLoop(cfg, rt, logger, state=state, stop=stop)
            rt.launch_generators()
            with StepProgress(cfg.control.total_steps, start=state.step) as progress:
                loop.progress = progress
                if on_step is not None:
                    loop.on_step = on_step
                return loop.run()
    finally:
        stop.restore()


def _announce(cfg: Config, rt) -> None:
    run = cfg.control.run_name
    log.info("run %r in %s; Redis at %s", run, rt.run_dir, _redact(rt.redis_url))
    log.info("metrics: Redis stream asyncrl:%s:metrics%s", run,
             f", wandb ({cfg.monitor.wandb}) in {rt.run_dir / 'wandb'}" if cfg.monitor.wandb != "disabled" else "")
    log.info("dashboard: asyncrl dashboard --redis %s --run %s  (then open http://127.0.0.1:%d)",
             _redact(rt.redis_url), run, cfg.monitor.dashboard_port)


def _redact(url: str | None) -> str:
    if not url or "@" not in url:
        return str(url)
    scheme, _, rest = url.partition("://")
    return f"{scheme}://***@{rest.split('@', 1)[1]}"
