"""Evaluation every `control.eval_every` steps: a fixed held-out prompt set, rolled out by the
run's own generators (greedy by default) exactly as they roll out training prompts, logged as `eval/*`.

    ev = Evaluator(cfg)                        # draws the held-out prompts once
    metrics = ev.run(rt.generators)            # {"eval/reward_mean": ..., ...}

The set is `control.eval_size` prompts from `control.eval_prompts` (any prompt source
rollout.prompts takes, its `control.eval_split`; rollout.prompt_field / answer_field /
chat_template apply as in training), or, without one, from the environment with a seed of
its own, so it is the same set at every evaluation and across a resume. The prompts go to the
generators in round-robin batches through `GeneratorActor.evaluate` (asyncrl.rollout.evaluation),
next to their training work: each is one group of one sample through the generator's own
GroupMaker, so a single-turn completion is scored by the same RewardScorer and a multi-turn
episode is stepped through the environment as in training, and an eval reward means what a
training reward means. Nothing is admitted, queued or trained; the trainer waits for the answers.
A prompt's id is its request id, so at one set of weights every evaluation samples with the same seeds.
An evaluation is bounded by control.eval_timeout_s: what is not rolled out by then, or comes
from a generator that died, is reported (eval/timeouts, eval/failed) and the run goes on.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import statistics
import time

from asyncrl.config import Config
from asyncrl.rollout.envs import make_env
from asyncrl.rollout.evaluation import EvalOutcome
from asyncrl.rollout.prompts import open_prompts
from asyncrl.seeding import rollout_seed

log = logging.getLogger(__name__)

EVAL_GRACE_S = 30.0
"""The trainer waits control.eval_timeout_s plus this (at most the timeout again) for answers."""

EVAL_SEED_OFFSET = 1_000_003
"""Env-made eval prompts use seed + this: a stream of their own, not the generators'."""


class Evaluator:
    def __init__(self, cfg: Config):
        c, r = cfg.control, cfg.rollout
        self.temperature = c.eval_temperature
        self.timeout_s = c.eval_timeout_s
        self.grace_s = min(EVAL_GRACE_S, c.eval_timeout_s)
        """Past the generators' own timeout, for their answer to come back."""
        stream = open_prompts(
            c.eval_prompts,
            make_env(r.env, r.env_kwargs),  # for its prompts only: the generators score
            seed=rollout_seed(cfg) + EVAL_SEED_OFFSET,
            id_prefix="eval",
            split=c.eval_split,
            prompt_field=r.prompt_field,
            answer_field=r.answer_field,
            where="control.eval_prompts",
        )
        self.prompts: list[tuple[str, str, dict]] = list(itertools.islice(stream, c.eval_size))

    def run(self, generators: list, step: int | None = None) -> dict[str, float]:
        """eval/* metrics over the held-out prompts; logged as the evaluation at ``step``.

        Bounded: each generator rolls its prompts out within control.eval_timeout_s, and the
        trainer waits that long (plus a grace for the answer to travel) for the generators. A
        prompt not rolled out in time is one of eval/timeouts; a generator that died or whose
        call raised, or whose engine could not sample, makes its prompts eval/failed. The run
        goes on either way: an evaluation is a measurement, not a step."""
        import ray

        t0 = time.perf_counter()
        shares = [(gen, self.prompts[i :: len(generators)]) for i, gen in enumerate(generators)] if generators else []
        calls = {
            gen.evaluate.remote(batch, self.temperature, self.timeout_s): len(batch) for gen, batch in shares if batch
        }
        failed = len(self.prompts) - sum(calls.values())  # no generator to run them
        ready, pending = (
            ray.wait(list(calls), num_returns=len(calls), timeout=self.timeout_s + self.grace_s) if calls else ([], [])
        )
        outs: list[EvalOutcome] = []
        for ref in ready:
            try:
                outs.append(ray.get(ref))
            except Exception as e:  # the generator died (RayActorError) or its call raised
                failed += calls[ref]
                log.warning("evaluation: %d prompts failed: %s: %s", calls[ref], type(e).__name__, str(e)[:300])
        timeouts = sum(calls[ref] for ref in pending)
        for ref in pending:  # best effort: the generator abandons its own rollouts at its timeout
            with contextlib.suppress(Exception):
                ray.cancel(ref)
        if pending:
            log.warning(
                "evaluation: %d generator(s) did not answer within %.0f s (control.eval_timeout_s): %d prompts",
                len(pending),
                self.timeout_s,
                timeouts,
            )
        rewards = [x for o in outs for x in o.rewards if not math.isnan(x)]
        lengths = [n for o in outs for n in o.response_tokens]
        out = {
            "eval/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "eval/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "eval/response_length_mean": statistics.fmean(lengths) if lengths else math.nan,
            "eval/reward_errors": float(sum(o.failures for o in outs)),
            "eval/timeouts": float(timeouts + sum(o.timeouts for o in outs)),
            "eval/failed": float(failed + sum(o.not_run for o in outs)),
            "eval/prompts": float(len(self.prompts)),
        }
        log.info(
            "eval at step %s: reward %.3f over %d prompts (%.1f s)",
            step,
            out["eval/reward_mean"],
            len(self.prompts),
            time.perf_counter() - t0,
        )
        return out
