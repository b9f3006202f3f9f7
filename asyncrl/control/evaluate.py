"""Evaluation every `control.eval_every` steps: a fixed held-out prompt set, sampled by the
run's own engines (greedy by default) and scored by the run's reward, logged as `eval/*`.

    ev = Evaluator(cfg, model_path)            # draws the held-out prompts once
    metrics = ev.run(rt.generators)            # {"eval/reward_mean": ..., ...}

The set is `control.eval_size` prompts from `control.eval_prompts` (any prompt source
rollout.prompts takes, its `control.eval_split`; rollout.prompt_field / answer_field /
chat_template apply as in training), or, without one, from the environment with a seed of
its own, so it is the same set at every evaluation and across a resume. Requests go to the generators round
robin through `GeneratorActor.sample`, next to their training work; nothing is admitted,
queued or trained, and the trainer waits for the answers (a few engine steps).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import math
import statistics
import time

from asyncrl.config import Config
from asyncrl.rollout.envs.reward_fns import make_rollout_env
from asyncrl.rollout.prompts import encode_prompt, open_prompts
from asyncrl.rollout.scoring import RewardLimits, RewardScorer
from asyncrl.seeding import rollout_seed

log = logging.getLogger(__name__)

EVAL_SEED_OFFSET = 1_000_003
"""Env-made eval prompts use seed + this: a stream of their own, not the generators'."""


class Evaluator:
    def __init__(self, cfg: Config, model_path: str):
        from transformers import AutoTokenizer

        c, r = cfg.control, cfg.rollout
        self.temperature = c.eval_temperature
        self.max_tokens = r.max_tokens
        self.env = make_rollout_env(r, c.run_name)
        # The generators' scorer: the same timeouts, failure rule and reward-model batching.
        self.scorer = RewardScorer(self.env, RewardLimits.from_rollout(r))
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        stream = open_prompts(
            c.eval_prompts,
            self.env,
            seed=rollout_seed(cfg) + EVAL_SEED_OFFSET,
            id_prefix="eval",
            split=c.eval_split,
            prompt_field=r.prompt_field,
            answer_field=r.answer_field,
            where="control.eval_prompts",
        )
        self.prompts = [
            (text, meta, encode_prompt(self.tokenizer, text, r.chat_template, meta))
            for _, text, meta in itertools.islice(stream, c.eval_size)
        ]

    def run(self, generators: list, step: int | None = None) -> dict[str, float]:
        """eval/* metrics over the held-out prompts; logged as the evaluation at ``step``."""
        import ray

        t0 = time.perf_counter()
        refs = [
            generators[i % len(generators)].sample.remote(ids, 1, self.max_tokens, self.temperature)
            for i, (_, _, ids) in enumerate(self.prompts)
        ]
        outs = ray.get(refs)
        failed_before = self.scorer.errors + self.scorer.timeouts

        async def score_all() -> list[tuple[float, str | None]]:
            return await asyncio.gather(
                *(
                    self.scorer.score_completion(self.tokenizer, text, out[0]["token_ids"], meta)
                    for (text, meta, _), out in zip(self.prompts, outs, strict=True)
                )
            )

        scored = asyncio.run(score_all())
        lengths = [len(out[0]["token_ids"]) for out in outs]
        rewards = [reward for reward, error in scored if error is None]
        errors = self.scorer.errors + self.scorer.timeouts - failed_before
        out = {
            "eval/reward_mean": statistics.fmean(rewards) if rewards else math.nan,
            "eval/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "eval/response_length_mean": statistics.fmean(lengths) if lengths else math.nan,
            "eval/reward_errors": float(errors),
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
