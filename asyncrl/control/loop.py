"""The trainer loop: staleness-bounded batches in, weights out, metrics everywhere.

Each step at policy version v:
  1. wait for `groups_per_step` groups no older than min_behavior_version(v) (queue drops
     and counts older ones, and dead-letters malformed ones; both give their admission
     slot back so generators can replace them);
  2. advantages + reduction weights (asyncrl.data.batch), one optimizer step per mini-batch;
  3. every `sync_every` optimizer steps publish the weights, and only then raise the policy
     version in Redis, so admission never lets a generator start work on weights it lacks.
     In async mode the engines load the new weights while the learner trains the next step
     (a background thread waits for them, then raises the version); one publish is in
     flight at a time. The synchronous mode (and max_staleness=0) waits, as it must;
  4. log metrics; every `checkpoint_every` steps checkpoint, then ack the queue entries the
     checkpoint covers (a crash before that redelivers them: trained exactly once; a crash
     after the checkpoint but before the ack redelivers groups a resume skips, see LoopState).

The first batch of every start (and resume) holds only groups at the learner's version, and
the parity gate (asyncrl.control.parity_gate) compares the learner's log-probs with the
engines' on it before the first update. Publishes that no generator can load are said while
they last and end the run past sync.max_load_failures / load_failure_deadline_s, with a
checkpoint and the resume command (asyncrl.control.loads).

Redis down: every call waits the outage out (queue.connection.Retrier) and the run goes on
when it is back; past queue.outage_deadline_s the loop checkpoints (no ack: the entries stay
pending for the resume) and ends, printing the resume command.

`mode=sync` is this same loop with the staleness bound forced to 0: admission lets the
generators start exactly one step's groups per version, so they generate while the
learner waits, sit idle (blocked by admission) while it trains, and resume only once the
new weights are published -- generate, train, sync, with no code of its own to drift.

Waiting for a step's groups is asyncrl.control.collect, the loop's own metrics
asyncrl.control.step_metrics, and the handles it drives come from asyncrl.control.runtime.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from asyncrl.config import Config, redact_config
from asyncrl.control.collect import BatchCollector, NoGenerators
from asyncrl.control.evaluate import EvalSchedule
from asyncrl.control.ledger import record_trained
from asyncrl.control.loads import STATE_FIELD as UNLOADABLE_FIELD
from asyncrl.control.loads import LoadWatch, WeightsUnloadable
from asyncrl.control.parity_gate import ParityGate
from asyncrl.control.publish import Publisher, WeightsUnwritable
from asyncrl.control.restart import restart_admission
from asyncrl.control.staleness import check_within_bound, min_behavior_version
from asyncrl.control.state import LoopState, StopFlag
from asyncrl.control.step_metrics import StepTimes, step_metrics
from asyncrl.control.watchdog import GeneratorWatchdog
from asyncrl.queue import QueueUnavailable
from asyncrl.queue.signing import JobSigner
from asyncrl.rundir import CHECKPOINTS_DIR
from asyncrl.rundir.store import RunPath

if TYPE_CHECKING:
    from asyncrl.control.progress import StepProgress
    from asyncrl.control.runtime import StartedRun
    from asyncrl.learner import LearnerGroup
    from asyncrl.learner.result import StepResult
    from asyncrl.monitor.sinks import MetricsLogger
    from asyncrl.queue import RolloutQueue, RunState
    from asyncrl.types import RolloutGroup

log = logging.getLogger(__name__)


class TrainedGroup(NamedTuple):
    """One group of the last step, as trained: what tests and benchmarks collect in on_step."""

    group_id: str
    generator_id: str
    staleness: int
    """Policy version of its mini-batch minus the version that generated it."""
    generate_s: float
    """Generation time (its slowest sample)."""


class TrainLoop:
    """Drives one run. Holds handles only; every decision is a small method of its own."""

    def __init__(
        self,
        cfg: Config,
        runtime: StartedRun,
        metrics_logger: MetricsLogger,
        *,
        state: LoopState | None = None,
        stop: StopFlag | None = None,
        progress: StepProgress | None = None,
    ):
        self.cfg = cfg
        self.rt = runtime
        self.queue: RolloutQueue = runtime.queue
        self.run_state: RunState = runtime.run_state
        self.learner: LearnerGroup = runtime.learner
        self.model_path: str = runtime.model_path
        self.logger = metrics_logger
        self.state = state or LoopState()
        self.stop = stop or StopFlag()
        self.progress = progress
        self.on_step: Callable[[TrainLoop, dict[str, float]], None] | None = None
        """Optional callback(loop, metrics) after every step (tests, benchmarks)."""
        self.ckpt_root = runtime.run_dir / CHECKPOINTS_DIR
        self.last_trained: list[TrainedGroup] = []
        """The last step's groups only (a run's worth would grow for days): on_step collects."""
        self.evals = EvalSchedule(cfg, stop=lambda: self.stop.is_set)

        self.watchdog = GeneratorWatchdog(
            runtime.generators,
            self.run_state,
            cfg.rollout.heartbeat_timeout_s,
            reward_failure_alert=cfg.monitor.alert_reward_failure_rate,
        )
        self.load_watch = LoadWatch(
            self.run_state,
            max_failures=cfg.sync.max_load_failures,
            deadline_s=cfg.sync.load_failure_deadline_s,
            heartbeat_timeout_s=cfg.rollout.heartbeat_timeout_s,
        )
        self.gate = ParityGate(cfg, self.model_path)
        self.collector = BatchCollector(
            cfg, self.queue, self.run_state, self.learner, self.watchdog, self.stop, also_check=self.load_watch.check
        )
        self.publisher = Publisher(
            self.learner,
            runtime.weight_sync,
            self.run_state,
            self.state,
            deadline_s=cfg.sync.publish_deadline_s,
            stop=self.stop,
            while_waiting=self._while_waiting,
            on_result=self.load_watch.note,
        )

    def _while_waiting(self) -> None:
        """While a publish is in flight: hung generators restarted, unloadable weights said."""
        self.watchdog.check()
        self.load_watch.check()

    # ------------------------------------------------------------------ set-up

    def prepare(self) -> None:
        """Align Redis with the loop's state (fresh start or resume) and publish weights.
        Call before the generators start, then `run()`."""
        c = self.cfg.control
        # The run's own key signs the job it publishes (kept in the run dir, so a resume keeps
        # it): a generator given its fingerprint refuses a config anyone else wrote.
        signer = JobSigner.for_run_dir(self.rt.run_dir)
        log.info(
            "the job's config is signed by this run's key; elastic generators pin it with: "
            "asyncrl generate --redis URL --run %s --trust-key %s",
            self.run_state.run,
            signer.fingerprint,
        )
        self.run_state.set_state(
            signer=signer,
            status="running",
            started_at=time.time(),
            alert_rollout_kl=self.cfg.monitor.alert_rollout_kl,
            alert_masked_frac=self.cfg.monitor.alert_masked_frac,
            alert_staleness_frac=self.cfg.monitor.alert_staleness_frac,
            alert_logprob_diff_max=self.cfg.monitor.alert_logprob_diff_max,
            alert_reward_failure_rate=self.cfg.monitor.alert_reward_failure_rate,
            # What `asyncrl generate` needs to join this job from another process; without
            # secrets, which it brings itself (anyone who reads Redis or the dashboard sees this).
            config=json.dumps(redact_config(self.cfg)),
            model_path=self.model_path,
            trainer_step=self.state.step,
            parity_gate=None,  # this start's gate and load failures, not a previous one's
            **{UNLOADABLE_FIELD: None},
        )
        # After a resume the weights are the checkpoint's: generators must run them, and
        # admission must count only what is still alive (queued or pending) on top of what
        # the checkpoint trained, or staleness would climb past the bound. The count is set
        # before admission opens, so no generator can be admitted against a stale count.
        if self.state.version == 0 and self.cfg.learner.dtype == "float32":
            # A fresh run's version 0 is the model file the engines load at start-up, and the
            # learner loaded that same file in float32: publishing it again would only make
            # us wait here for every engine to come up (the runtime starts them meanwhile).
            self.run_state.set_policy_version(0)
        else:
            self.publisher.publish(self.state.version, overlap=False)
        queued_skips = 0
        if self.state.skip_ids:
            # The checkpoint's own groups, still pending if its ack was lost: skipped when
            # delivered, so neither trained twice nor counted twice against admission.
            skip = set(self.state.skip_ids)
            self.queue.skip_groups(self.state.skip_ids)
            queued_skips = sum(1 for g in self.queue.queued_groups() if g.group_id in skip)
            if self.cfg.queue.ledger:
                record_trained(self.rt.run_dir, self.state.step, self.state.skip_ids)

        restart_admission(
            self.cfg, self.run_state, self.state, queued_skips=queued_skips, max_staleness=self.max_staleness
        )
        self.run_state.configure_admission(
            self.max_staleness, c.groups_per_step, self.cfg.learner.mini_batches_per_step
        )
        self.collector.start_counting()

    # ------------------------------------------------------------------ one step

    @property
    def max_staleness(self) -> int:
        return 0 if self.cfg.control.mode == "sync" else self.cfg.control.max_staleness

    def _min_version(self) -> int:
        least = min_behavior_version(self.state.version, self.max_staleness, self.cfg.learner.mini_batches_per_step)
        # The gate's batch must hold tokens the learner's own weights sampled (staleness 0);
        # after a resume older queued groups are dropped as stale once, and re-issued.
        return max(least, self.state.version) if self.gate.pending else least

    def _gate(self, sequences: list) -> dict[str, float]:
        """The parity gate on this batch, before any update (asyncrl.control.parity_gate)."""
        result = self.gate.check(self.learner, sequences, self.state.version)
        if result is None:
            return {}
        self.run_state.set_state(parity_gate=json.dumps(result.record()))
        self.gate.enforce(result)
        return result.metrics()

    def _train(self, groups: list[RolloutGroup]) -> tuple[StepResult, dict[str, float]]:
        """The learner's step over `groups` and the batch's own metrics (advantages, rewards)."""
        # data.batch, learner.checkpoint and control.export load torch: imported where used, so
        # that importing the loop (and the CLI above it) does not.
        from asyncrl.data.batch import build_minibatches, minibatch_of

        m = self.cfg.learner.mini_batches_per_step
        minibatches, batch_metrics = build_minibatches(
            groups,
            self.cfg.algo,
            num_minibatches=m,
            pad_token_id=self.learner.pad_token_id,
            max_new_tokens=self.cfg.rollout.max_tokens,
            teacher=self.cfg.rollout.teacher,
            pixels=self.learner.pixels,
        )
        if self.gate.pending:
            batch_metrics.update(self._gate([seq for mb in minibatches for seq in mb]))
        # Every record's staleness at the version its mini-batch trains at, checked one by one.
        for j, mb in enumerate(minibatches):
            at = self.state.version + j
            check_within_bound([at - seq.behavior_version for seq in mb], self.max_staleness)
        self.last_trained = [
            TrainedGroup(
                g.group_id,
                g.samples[0].generator_id,
                self.state.version + minibatch_of(g.group_id, minibatches) - g.behavior_version,
                max(s.timings.get("generate_s", 0.0) for s in g.samples),
            )
            for g in groups
        ]
        return self.learner.train_step(minibatches), batch_metrics

    @property
    def _overlap_publish(self) -> bool:
        return self.max_staleness > 0

    def _due(self, every: int, before: int, after: int) -> bool:
        return after // every > before // every

    def step(self) -> dict[str, float] | None:
        c = self.cfg.control
        t0 = time.perf_counter()
        self.load_watch.check()  # publishes no generator loaded: past the limits, the run ends here
        items = self.collector.collect(self._min_version())
        if self.stop.is_set and len(items) < c.groups_per_step:
            # Not trained: leave them un-acked so a resume redelivers them.
            return None
        t_wait = time.perf_counter() - t0
        items.sort(key=lambda item: item[1].group_id)  # arrival order is timing; float sums follow the order
        ids = [entry_id for entry_id, _ in items]
        groups = [g for _, g in items]

        t1 = time.perf_counter()
        result, batch_metrics = self._train(groups)
        metrics = {**result.metrics, **batch_metrics}
        # At the version of each group's own mini-batch: with m mini-batches the step's start
        # version would understate the staleness of all but the first.
        staleness = [t.staleness for t in self.last_trained]
        t_train = time.perf_counter() - t1
        before = self.state.version
        self.state.version = result.version
        self.state.step += 1
        self.state.trained([g.group_id for g in groups], ids)
        samples = [s for g in groups for s in g.samples]
        self.run_state.incr_many(
            {
                "groups_trained": len(groups),
                "trained_samples": len(samples),
                "trained_response_tokens": sum(len(s.response_ids) for s in samples),
            }
        )
        # The policy version trails the trainer while a publish is in flight; supervisors
        # (tests.support.job) and the dashboard read the trainer's own step here.
        self.run_state.set_state(trainer_step=self.state.step)

        t_sync = 0.0
        # The policy version is raised only after the publish, so admitted work runs the
        # weights it is counted against.
        if self._due(self.cfg.sync.sync_every, before, self.state.version):
            t_sync = self.publisher.publish(self.state.version, overlap=self._overlap_publish)
        else:
            self.publisher.finish()  # never let a late publish thread lower the version
            self.run_state.set_policy_version(self.state.version)

        if self.state.step % c.checkpoint_every == 0 or self.state.step >= c.total_steps:
            self.checkpoint()
        if c.export_every and self.state.step % c.export_every == 0:
            self.export_hf(f"step_{self.state.step}")
        # Of the version just published (an eval never mixes versions), without holding the step.
        last = self.state.step >= c.total_steps
        metrics.update(self.evals.on_step(self.state.step, self.state.published_version, self.rt.generators, last))

        times = StepTimes(t_wait, t_train, t_sync, self.publisher.last_apply_s, time.perf_counter() - t0)
        metrics.update(
            step_metrics(
                groups,
                staleness,
                times,
                version=self.state.version,
                max_staleness=c.max_staleness,
                queue=self.queue,
                run_state=self.run_state,
                watchdog=self.watchdog,
                dropped_uniform=self.collector.dropped_uniform,
            )
        )
        self.logger.log(self.state.step, metrics)
        return metrics

    # ------------------------------------------------------------------ checkpoint

    def checkpoint(self, *, redis_up: bool = True) -> RunPath:
        """Durable checkpoint first, ack second: a crash in between only redelivers (and the
        resume skips what this checkpoint trained). Without Redis nothing is acked: the
        entries stay pending, and the resume sorts them out the same way."""
        from asyncrl.learner.checkpoint import prune
        from asyncrl.rundir import complete_checkpoint_of

        path = self.ckpt_root / f"step_{self.state.step:06d}"
        done = complete_checkpoint_of(self.ckpt_root, self.state.step)  # saved again: step_N.rK
        if not self.state.since_checkpoint and done is not None:
            return done  # nothing trained since (a resume, an ack that went through): rewriting drops its ids
        path = self.learner.save_checkpoint(str(path), extra=self.state.to_extra())
        if self.cfg.queue.ledger:
            record_trained(self.rt.run_dir, self.state.step, self.state.since_checkpoint)
        if redis_up:
            # The ids are forgotten only once acked: if the ack fails (an outage), the outage
            # checkpoint that follows at this same step must still carry them.
            if self.state.unacked:
                self.queue.ack(self.state.unacked)
            self.state.checkpointed()
            self.run_state.set_state(checkpoint_step=self.state.step)
        keep = (self.cfg.control.keep_checkpoints, self.cfg.control.keep_every)
        for old in prune(self.ckpt_root, *keep):
            log.info("deleted checkpoint %s (control.keep_checkpoints=%d, keep_every=%d)", old.name, *keep)
        return path

    def export_hf(self, name: str) -> RunPath:
        """The learners' weights as a Hugging Face folder, run_dir/hf/NAME."""
        from asyncrl.control.export import HF_DIR, export_live

        path = export_live(self.learner, self.model_path, self.rt.run_dir / HF_DIR / name)
        log.info("exported a Hugging Face folder at step %d: %s", self.state.step, path)
        return path

    def _checkpoint_for_resume(self, why: str, when: str, redis_up: bool = True) -> None:
        if redis_up:
            try:
                self.checkpoint()
                self.run_state.set_state(status="failed")
            except QueueUnavailable:
                # Redis went too (the generators died of the same outage): the weights are
                # saved before the ack, so the checkpoint holds; the unacked entries stay pending.
                when = f"{when} and Redis is back"
        else:
            self.checkpoint(redis_up=False)
        msg = "%s; checkpointed step %d. Resume once %s: asyncrl train --resume %s"
        log.error(msg, why, self.state.step, when, self.rt.run_dir)

    # ------------------------------------------------------------------ run

    def run(self) -> LoopState:
        self.stop.install()
        try:
            while self.state.step < self.cfg.control.total_steps and not self.stop.is_set:
                metrics = self.step()
                if metrics is None:
                    continue
                if self.progress is not None:
                    self.progress.update(self.state.step, metrics)
                if self.on_step is not None:
                    self.on_step(self, metrics)
            self.evals.close()  # a stopped run's evaluation would hold its publish in flight
            self.publisher.finish()
            if self.stop.is_set and self.state.unacked:
                self.checkpoint()
            if self.state.step > 0:
                self.export_hf("final")
            ended = "preempted" if self.stop.preempted else "stopped"
            self.run_state.set_state(status=ended if self.stop.is_set else "finished")
        except NoGenerators:
            # The learners are fine: keep what they trained, so the run resumes from here.
            self._checkpoint_for_resume("no generator can run", "generators can run")
            raise
        except WeightsUnwritable as e:
            # Past sync.publish_deadline_s: the checkpoint goes to run_dir, not to the full shm_dir.
            self.publisher.join()
            self._checkpoint_for_resume(str(e), "there is space for the weights")
            raise
        except WeightsUnloadable as e:
            # Past sync.max_load_failures / load_failure_deadline_s: the learner's weights are
            # fine, the engines cannot take them; keep them, so the run resumes from here.
            self.publisher.join()
            self._checkpoint_for_resume(str(e), "the engines can load the weights")
            raise
        except QueueUnavailable as e:
            # Past queue.outage_deadline_s. The weights are on local disk; Redis keeps the rest.
            self.publisher.join()
            self._checkpoint_for_resume(str(e), "Redis is back", redis_up=False)
            raise
        except BaseException:
            self.run_state.set_state(status="failed")
            raise
        finally:
            self.evals.close()
            self.publisher.join()  # the engines must not be torn down mid-load
            self.stop.restore()
        return self.state
