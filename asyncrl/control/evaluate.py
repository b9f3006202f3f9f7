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
"""

from __future__ import annotations

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

EVAL_SEED_OFFSET = 1_000_003
"""Env-made eval prompts use seed + this: a stream of their own, not the generators'."""


class Evaluator:
    def __init__(self, cfg: Config):
        c, r = cfg.control, cfg.rollout
        self.temperature = c.eval_temperature
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
        """eval/* metrics over the held-out prompts; logged as the evaluation at ``step``."""
        import ray

        t0 = time.perf_counter()
        shares = [(gen, self.prompts[i :: len(generators)]) for i, gen in enumerate(generators)]
        refs = [gen.evaluate.remote(batch, self.temperature) for gen, batch in shares if batch]
        outs: list[EvalOutcome] = ray.get(refs)
        rewards = [x for o in outs for x in o.rewards if not math.isnan(x)]
        lengths = [n for o in outs for n in o.response_tokens]
        out = {
            "eval/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "eval/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "eval/response_length_mean": statistics.fmean(lengths) if lengths else math.nan,
            "eval/reward_errors": float(sum(o.failures for o in outs)),
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
